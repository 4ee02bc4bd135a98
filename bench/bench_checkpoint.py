"""Checkpoint speed and memory: ckptkit against torch.save, safetensors and the machine's limits.

    python bench/bench_checkpoint.py                          # ~1 GiB of state, 3 reps: < 5 min on 2 cores
    python bench/bench_checkpoint.py --size-mb 258 --reps 5   # the issue's 258 MiB figure
    python bench/bench_checkpoint.py --json > bench.json      # one JSON object (schema_version 1)
    python bench/bench_checkpoint.py --size-mb 64 --reps 2 --skip memory,zstd   # a smoke run in seconds
    python bench/bench_checkpoint.py --state flat --reps 7    # the load paths on the 304 MiB flat state dict

What it builds: a GPT-like model (fp32 master weights), its bf16 EMA teacher and the
AdamW state after one step (fp32 exp_avg / exp_avg_sq), the three parts of a real
training checkpoint, about ``--size-mb`` in all; and, for the ``load`` + ``load_state_dict``
ratio, whose value differs between states, a plain stack of ``Linear(1024, 3072)`` layers
(24 of them, 302 MB, at ``--size-mb 512``). Every operation runs on the same
state in one process; repetitions are interleaved (op A, op B, ..., then again) so
a noisy neighbour hits every op alike, and the reported time is the median. The
first round is a warm-up and is not counted. Peak memory is measured in a fresh
child process per operation (see ``bench/README.md`` for the method).

Every save is fsync'd (ckptkit's own atomic save: temp, fsync, rename, fsync dir;
peers: write, then fsync). Restores read a warm page cache unless marked "cold"
(cold = the file's pages dropped with ``posix_fadvise(DONTNEED)`` first).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash
from torch import nn

import ckptkit
from ckptkit import AsyncSaver, Checkpoint, open_checkpoint

MiB = 1 << 20
VOCAB, CTX, N_LAYER = 32768, 1024, 8

# ============================================================================ the state


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(d, 3 * d), "c_proj": nn.Linear(d, d)})
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(d, 4 * d), "c_proj": nn.Linear(4 * d, d)})


class GPT(nn.Module):
    """GPT-2 layout (untied output: the embedding doubles as the output projection)."""

    def __init__(self, d: int, n_layer: int = N_LAYER) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(CTX, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)


def width_for(size_mb: float) -> int:
    """Model width whose model + bf16 teacher + AdamW state is about ``size_mb`` MiB (14 bytes/param)."""
    params = size_mb * MiB / 14
    a, b = 12 * N_LAYER, VOCAB + CTX
    d = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    return max(64, round(d / 64) * 64)


def empty_model(d: int, dtype: torch.dtype = torch.float32) -> GPT:
    with torch.device("meta"):
        m = GPT(d)
    return m.to_empty(device="cpu").to(dtype)


def build_state(d: int, seed: int = 0) -> tuple[GPT, GPT, torch.optim.AdamW]:
    """A trained-looking state: weights ~ N(0, 0.02), norms ~ 1, AdamW moments after one step."""
    g = torch.Generator().manual_seed(seed)
    net = empty_model(d)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.01, generator=g)
            elif "ln" in name:
                p.normal_(1.0, 0.05, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()
    for p in net.parameters():
        p.grad = None
    teacher = empty_model(d, torch.bfloat16)
    with torch.no_grad():
        for pt, p in zip(teacher.parameters(), net.parameters(), strict=True):
            pt.copy_(p)
    teacher.requires_grad_(False)
    return net, teacher, opt


def linear_stack(size_mb: float) -> nn.Sequential:
    """The second state of the load + load_state_dict ratio: a plain stack of ``Linear(1024, 3072)``
    (12 MiB each; 24 of them, 302 MB, at ``--size-mb 512``), the state the ratio differs most on."""
    g = torch.Generator().manual_seed(1)
    with torch.device("meta"):
        stack = nn.Sequential(*(nn.Linear(1024, 3072) for _ in range(max(1, round(size_mb * 24 / 512)))))
    stack = stack.to_empty(device="cpu")
    with torch.no_grad():
        for p in stack.parameters():
            p.normal_(0.0, 0.02, generator=g)
    return stack


def ckpt_of(net: GPT, teacher: GPT, opt: torch.optim.Optimizer, step: int = 1000) -> Checkpoint:
    return Checkpoint(
        step=step,
        model={"net": net.state_dict()},
        teacher=teacher.state_dict(),
        optim={"optimizers": {"adamw": opt.state_dict()}},
        monitor={"values": {"loss": 2.75}},
    )


def torch_obj(net: GPT, teacher: GPT, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {"net": net.state_dict()},
        "teacher": teacher.state_dict(),
        "optim": {"optimizers": {"adamw": opt.state_dict()}},
    }


def flat_of(net: GPT, teacher: GPT, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors needs one flat {name: tensor}; the optimizer's param_groups go in the metadata."""
    flat = {f"model.net.{k}": v for k, v in net.state_dict().items()}
    flat.update({f"teacher.{k}": v for k, v in teacher.state_dict().items()})
    osd = opt.state_dict()
    for pid, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optim.adamw.{pid}.{k}"] = v
    return flat, {"param_groups": json.dumps(osd["param_groups"])}


def all_tensors(net: GPT, teacher: GPT, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(net.state_dict().values()) + list(teacher.state_dict().values())
    for st in opt.state_dict()["state"].values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


# ============================================================================ operations


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path: str) -> None:
    buf = bytearray(8 * MiB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


SYNC_FILE_RANGE = _sync_file_range()


def raw_write(path: str, header: bytes, views: list[memoryview], write_behind: bool) -> None:
    """The floor: a msgpack header and the tensors' own memory, written and fsync'd.

    ``write_behind`` also asks the kernel to start writing back every 8 MiB as it goes
    (what ckptkit does), so the disk works while the copy into the page cache goes on.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = done = 0
        for v in [memoryview(header), *views]:
            step = 8 * MiB if write_behind else max(v.nbytes, 1)
            for a in range(0, v.nbytes, step):
                piece = v[a : a + step]
                while piece.nbytes:
                    n = os.write(fd, piece)
                    piece, pos = piece[n:], pos + n
                if write_behind and SYNC_FILE_RANGE and pos - done >= 8 * MiB:
                    SYNC_FILE_RANGE(fd, done, pos - done, 2)
                    done = pos
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read_into(path: str, extents: list[tuple[int, memoryview]], hashed: bool) -> None:
    """The floor: positional reads of each tensor straight into its destination (one thread)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, dest in extents:
            h = xxhash.xxh3_64() if hashed else None
            for a in range(0, dest.nbytes, MiB):
                piece = dest[a : a + MiB]
                os.preadv(fd, [piece], off + a)
                if h is not None:
                    h.update(piece)
    finally:
        os.close(fd)


def parallel_copy(pairs: list[tuple[memoryview, memoryview]], lanes: int = 2) -> None:
    """The memory-copy limit: numpy copies (GIL released) of 8 MiB pieces in ``lanes`` threads."""
    import threading

    pieces = [(d[a : a + 8 * MiB], s[a : a + 8 * MiB]) for d, s in pairs for a in range(0, s.nbytes, 8 * MiB)]

    def lane(k: int) -> None:
        for d, s in pieces[k::lanes]:
            np.copyto(np.frombuffer(d, dtype=np.uint8), np.frombuffer(s, dtype=np.uint8))

    threads = [threading.Thread(target=lane, args=(k,)) for k in range(1, lanes)]
    for t in threads:
        t.start()
    lane(0)
    for t in threads:
        t.join()


def read_file(path: str, buf: bytearray) -> None:
    """Read bandwidth: the whole file in 8 MiB positional reads into one reused buffer."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mv, off = memoryview(buf), 0
        while True:
            n = os.preadv(fd, [mv], off)
            if n <= 0:
                break
            off += n
    finally:
        os.close(fd)


def ckpt_extents(path: str, net: GPT, teacher: GPT, opt: torch.optim.Optimizer) -> list[tuple[int, memoryview]]:
    """(file offset, destination) for every tensor of the ckptkit file, via its index."""
    from ckptkit.format._codec import match_destinations
    from ckptkit.format._container import Source, read_layout

    with Source(path) as src:
        layout = read_layout(src)
    dest = {
        "model": {"net": net.state_dict()},
        "teacher": teacher.state_dict(),
        "optim": {"optimizers": {"adamw": opt.state_dict()}},
    }
    out = []
    for name, tree in dest.items():
        sec = layout.sections[name]
        problems: list[str] = []
        for i, t in match_destinations(sec, tree, name, problems).items():
            out.append((sec.data_start + sec.tensors[i].offset, byte_view(t)))
        assert not problems, problems
    return out


def unflatten_st(flat: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    model, teacher, state = {}, {}, {}
    for k, v in flat.items():
        part, rest = k.split(".", 1)
        if part == "model":
            model[rest.split(".", 1)[1]] = v
        elif part == "teacher":
            teacher[rest] = v
        else:
            _, pid, name = rest.split(".", 2)
            state.setdefault(int(pid), {})[name] = v
    return model, teacher, state


# ============================================================================ measuring


class Runner:
    def __init__(self, reps: int, log: Callable[[str], None]) -> None:
        self.reps, self.log = reps, log
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}  # process CPU time (all threads, user + system)

    def interleaved(self, ops: dict[str, tuple[Callable[[], Any] | None, Callable[[], Any]]]) -> None:
        """Run every op ``reps`` times, round robin, after one uncounted warm-up round."""
        t_start = time.perf_counter()
        for r in range(self.reps + 1):
            for name, (prep, op) in ops.items():
                if prep is not None:
                    prep()
                gc.collect()
                c0, t0 = time.process_time(), time.perf_counter()
                op()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if r:
                    self.times.setdefault(name, []).append(dt)
                    self.cpu.setdefault(name, []).append(dc)
            self.log(f"  round {r}/{self.reps} done ({time.perf_counter() - t_start:.0f} s)")

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])


def vm_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


MEMORY_OPS = (
    "ckptkit_save",
    "torch_save",
    "safetensors_save",
    "ckptkit_restore_into",
    "ckptkit_load",
    "torch_load",
    "safetensors_load",
    "ckptkit_verify",
    "ckptkit_lazy_one",
    "ckptkit_async_save",
)


def child_main(args: argparse.Namespace) -> None:
    """Operations in a fresh process, one after the other: each one's peak RSS above what was live before it."""
    import safetensors.torch as st

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    d = args.width
    net, teacher = empty_model(d), empty_model(d, torch.bfloat16)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1)
    ck = ckptkit.load(args.files["ckptkit"])
    net.load_state_dict(ck.model["net"])
    teacher.load_state_dict(ck.teacher)
    opt.load_state_dict(ck.optim["optimizers"]["adamw"])
    del ck
    gc.collect()
    out_dir = args.dir
    ops: dict[str, Callable[[], Any]] = {
        "ckptkit_save": lambda: ckptkit.save(os.path.join(out_dir, "mem.ckpt"), ckpt_of(net, teacher, opt)),
        "torch_save": lambda: _torch_save(os.path.join(out_dir, "mem.pt"), torch_obj(net, teacher, opt)),
        "safetensors_save": lambda: _st_save(os.path.join(out_dir, "mem.safetensors"), *flat_of(net, teacher, opt)),
        "ckptkit_restore_into": lambda: _restore_into(args.files["ckptkit"], net, teacher, opt),
        "ckptkit_load": lambda: _ckpt_load(args.files["ckptkit"], net, teacher, opt),
        "torch_load": lambda: _torch_load(args.files["torch"], net, teacher, opt),
        "safetensors_load": lambda: _st_load(args.files["safetensors"], net, teacher, opt, st),
        "ckptkit_verify": lambda: ckptkit.verify(args.files["ckptkit"]),
        "ckptkit_lazy_one": lambda: _lazy_one(args.files["ckptkit"]),
        "ckptkit_async_save": lambda: _async_save(os.path.join(out_dir, "mem-async.ckpt"), ckpt_of(net, teacher, opt)),
    }
    for op in args.child.split(","):
        warm_cache(args.files["ckptkit"])
        gc.collect()
        ok = reset_peak()
        base = vm_status()
        ops[op]()
        peak = vm_status()
        print(
            json.dumps(
                {
                    "op": op,
                    "reset_ok": ok,
                    "base_rss": base["VmRSS"],
                    "peak_rss": peak["VmHWM"],
                    "extra": peak["VmHWM"] - base["VmRSS"],
                }
            ),
            flush=True,
        )
        for f in ("mem.ckpt", "mem.pt", "mem.safetensors", "mem-async.ckpt"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(out_dir, f))


def _torch_save(path: str, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _st_save(path: str, flat: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    import safetensors.torch as st

    st.save_file(flat, path, metadata=meta)
    fsync_path(path)


def _restore_into(path: str, net: GPT, teacher: GPT, opt: torch.optim.Optimizer) -> None:
    ck = ckptkit.load(
        path,
        into={
            "model": {"net": net.state_dict()},
            "teacher": teacher.state_dict(),
            "optim": {"optimizers": {"adamw": opt.state_dict()}},
        },
    )
    opt.load_state_dict(ck.optim["optimizers"]["adamw"])  # param_groups; the state tensors are already in place


def _into_live_optimizer(opt: torch.optim.Optimizer, state: dict, groups: list) -> None:
    """Copy loaded optimizer state into the optimizer's own tensors, as ``copy_`` does for parameters.

    ``opt.load_state_dict(loaded)`` would keep the loaded tensors instead -- for
    safetensors, views of a private file mapping whose bytes are read (and copied on
    write) only when the next step touches them -- so the restore would not be done
    when the clock stops. Every restore here ends with every byte in the live memory.
    """
    live = opt.state_dict()["state"]
    with torch.no_grad():
        for pid, st in state.items():
            for k, v in st.items():
                live[pid][k].copy_(v)
    opt.load_state_dict({"state": live, "param_groups": groups})


def _ckpt_load(path: str, net: GPT, teacher: GPT, opt: torch.optim.Optimizer) -> None:
    ck = ckptkit.load(path)
    net.load_state_dict(ck.model["net"])
    teacher.load_state_dict(ck.teacher)
    osd = ck.optim["optimizers"]["adamw"]
    _into_live_optimizer(opt, osd["state"], osd["param_groups"])


def _torch_load(path: str, net: GPT, teacher: GPT, opt: torch.optim.Optimizer) -> None:
    sd = torch.load(path, weights_only=True)
    net.load_state_dict(sd["model"]["net"])
    teacher.load_state_dict(sd["teacher"])
    osd = sd["optim"]["optimizers"]["adamw"]
    _into_live_optimizer(opt, osd["state"], osd["param_groups"])


def _st_load(path: str, net: GPT, teacher: GPT, opt: torch.optim.Optimizer, st: Any) -> None:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
    model, teach, state = unflatten_st(st.load_file(path))
    net.load_state_dict(model)
    teacher.load_state_dict(teach)
    _into_live_optimizer(opt, state, groups)


def _lazy_one(path: str) -> float:
    with open_checkpoint(path) as ck:
        return float(ck.tensor("model", "net", lazy_key()).sum())


def lazy_key() -> str:
    return f"h.{N_LAYER // 2}.mlp.c_fc.weight"


_SAVERS: dict[str, AsyncSaver] = {}


def _async_save(path: str, ckpt: Checkpoint) -> None:
    saver = _SAVERS.setdefault("mem", AsyncSaver())
    saver.save(path, ckpt)
    saver.wait()


# ============================================================================ zstd


def zstd_table(net: GPT, teacher: GPT, opt: torch.optim.Optimizer, sample_mb: int, levels: list[int]) -> list[dict]:
    """Size ratio and speed per level, plain and byte-shuffled, on each kind of tensor."""
    import zstandard

    osd = opt.state_dict()["state"]
    kinds = {
        "fp32 weights (model)": [t for k, t in net.state_dict().items() if k.endswith("weight")],
        "bf16 weights (teacher)": [t for k, t in teacher.state_dict().items() if k.endswith("weight")],
        "AdamW exp_avg (fp32)": [s["exp_avg"] for s in osd.values()],
        "AdamW exp_avg_sq (fp32)": [s["exp_avg_sq"] for s in osd.values()],
    }
    rows = []
    for kind, ts in kinds.items():
        ts = sorted(ts, key=lambda t: -t.numel())
        parts, n = [], 0
        for t in ts:  # a sample from several tensors, the largest first
            b = t.detach().reshape(-1).view(torch.uint8).numpy()
            take = min(b.nbytes, sample_mb * MiB - n)
            parts.append(b[: take - take % t.element_size()])
            n += parts[-1].nbytes
            if n >= sample_mb * MiB:
                break
        raw = np.concatenate(parts)
        item = ts[0].element_size()
        shuffled = raw.reshape(-1, item).T.copy().reshape(-1)
        for level in levels:
            for shuffle, data in (("no", raw), ("yes", shuffled)):
                cctx = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
                t0 = time.perf_counter()
                comp = cctx.compress(data)
                tc = time.perf_counter() - t0
                t0 = time.perf_counter()
                zstandard.ZstdDecompressor().decompress(comp)
                td = time.perf_counter() - t0
                ratio = data.nbytes / len(comp)
                c_gbps = data.nbytes / tc / 1e9
                rows.append(
                    {
                        "kind": kind,
                        "level": level,
                        "shuffle": shuffle,
                        "ratio": ratio,
                        "compress_gbps": c_gbps,
                        "decompress_gbps": data.nbytes / td / 1e9,
                        # compress-then-write beats writing raw only below this disk speed
                        "pays_below_gbps": c_gbps * (1 - 1 / ratio) if ratio > 1 else 0.0,
                    }
                )
    return rows


# ============================================================================ the flat state


def flat_state() -> dict[str, torch.Tensor]:
    """304 MiB of fp32 and bf16 tensors in one flat dict: the state where load(into=) measured 1.22-1.32x."""
    g = torch.Generator().manual_seed(0)
    out = {"embed.weight": torch.randn(16384, 1024, generator=g)}  # 64 MiB fp32
    for i in range(12):
        out[f"layers.{i}.fc.weight"] = torch.randn(1536, 2048, generator=g)  # 12 MiB fp32
        out[f"layers.{i}.fc.bias"] = torch.randn(2048, generator=g)
        out[f"layers.{i}.proj.weight"] = torch.randn(2048, 2048, generator=g).to(torch.bfloat16)  # 8 MiB bf16
        out[f"layers.{i}.proj.bias"] = torch.randn(2048, generator=g).to(torch.bfloat16)
    return out


FLAT_LAZY_KEY = "layers.6.fc.weight"


def flat_ops(ck_path: str, st_path: str, live: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """The load paths on the flat state, each ending with every byte in ``live`` (or one tensor summed)."""
    import safetensors.torch as st
    from safetensors import safe_open

    def copy_all(src: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, t in live.items():
                t.copy_(src[k])

    def st_lazy() -> float:
        with safe_open(st_path, "pt") as f:
            return float(f.get_tensor(FLAT_LAZY_KEY).sum())

    def ck_lazy() -> float:
        with open_checkpoint(ck_path) as ck:
            return float(ck.tensor("model", FLAT_LAZY_KEY).sum())

    return {
        "ckptkit load + copy_ (verified)": lambda: copy_all(ckptkit.load(ck_path).model),
        "safetensors load_file + copy_": lambda: copy_all(st.load_file(st_path)),
        "ckptkit load(into=...) (verified)": lambda: ckptkit.load(ck_path, into={"model": live}),
        "ckptkit load alone (verified)": lambda: ckptkit.load(ck_path),
        "safetensors load_file alone": lambda: st.load_file(st_path),
        "ckptkit open_checkpoint + one tensor": ck_lazy,
        "safetensors safe_open + get_tensor": st_lazy,
    }


def _run_flat(args: argparse.Namespace, log: Callable[[str], None], work: str) -> int:
    """Time (interleaved medians) and peak memory (a fresh child per op) of the load paths on the flat state."""
    import safetensors.torch as st

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    state = flat_state()
    ck_path, st_path = os.path.join(work, "flat.ckpt"), os.path.join(work, "flat.safetensors")
    ckptkit.save(ck_path, Checkpoint(step=1, model=state))
    st.save_file(state, st_path)
    live = {k: torch.empty_like(t) for k, t in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    del state
    ops = flat_ops(ck_path, st_path, live)
    warm = {k: functools.partial(warm_cache, st_path if k.startswith("safetensors") else ck_path) for k in ops}
    r = Runner(args.reps, log)
    r.interleaved({k: (warm[k], op) for k, op in ops.items()})
    med = {k: r.median(k) for k in ops}
    memory = {}
    if "memory" not in set(filter(None, args.skip.split(","))):
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        for k in ops:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--state",
                "flat",
                "--child",
                k,
                "--files",
                json.dumps({"ckptkit": ck_path, "safetensors": st_path}),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            memory[k] = (
                json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-300:]}
            )
    ratios = {
        "load + copy_ / safetensors load_file + copy_": med["ckptkit load + copy_ (verified)"]
        / med["safetensors load_file + copy_"],
        "load(into=) / safetensors load_file + copy_": med["ckptkit load(into=...) (verified)"]
        / med["safetensors load_file + copy_"],
        "lazy open + one tensor / safe_open + get_tensor": med["ckptkit open_checkpoint + one tensor"]
        / med["safetensors safe_open + get_tensor"],
    }
    result = {
        "schema_version": 1,
        "state": "flat",
        "bytes": nbytes,
        "reps": args.reps,
        "median_s": med,
        "times_s": r.times,
        "ratios": ratios,
        "peak_extra_rss_bytes": memory,
    }
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
        return 0
    print(f"flat state dict: {nbytes / MiB:.0f} MiB, {len(live)} tensors; medians of {args.reps} interleaved reps")
    for k, v in med.items():
        m = memory.get(k, {})
        extra = f"{m['extra'] / MiB:8.1f} MiB peak above live" if "extra" in m else ""
        print(f"  {k:<42} {v * 1e3:9.2f} ms  {extra}")
    for k, v in ratios.items():
        print(f"  {k:<52} {v:6.2f}x")
    return 0


def flat_child(args: argparse.Namespace) -> None:
    """One flat-state op in a fresh process: its peak RSS above what was live before it (anon + file pages)."""
    live = {k: torch.empty_like(t) for k, t in ckptkit.load(args.files["ckptkit"]).model.items()}
    for t in live.values():
        t.zero_()  # touch: the destinations are resident before the op, as in a live run
    gc.collect()
    op = flat_ops(args.files["ckptkit"], args.files["safetensors"], live)[args.child]
    warm_cache(args.files["ckptkit"])
    warm_cache(args.files["safetensors"])
    ok = reset_peak()
    base = vm_status()
    keep = op()
    peak = vm_status()
    del keep
    print(
        json.dumps(
            {
                "op": args.child,
                "reset_ok": ok,
                "base_rss": base["VmRSS"],
                "peak_rss": peak["VmHWM"],
                "extra": peak["VmHWM"] - base["VmRSS"],
            }
        ),
        flush=True,
    )


# ============================================================================ main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--size-mb", type=float, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--reps", type=int, default=3, help="counted repetitions per op (default 3; medians)")
    p.add_argument("--dir", default=None, help="where files go (default: a new directory under the system temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: cold, memory, zstd, async")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads (default: torch's own choice, one per core)",
    )
    p.add_argument("--zstd-sample-mb", type=int, default=16, help="MiB per tensor kind for the zstd table (16)")
    p.add_argument(
        "--state",
        choices=("gpt", "flat"),
        default="gpt",
        help="gpt (default): model + bf16 teacher + AdamW state of --size-mb; flat: the 304 MiB flat "
        "state dict of issue 12 (one 64 MiB fp32 embedding, 12 x 12 MiB fp32, 12 x 8 MiB bf16, "
        "24 small biases), load paths only, with their peak memory",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, help=argparse.SUPPRESS)
    p.add_argument("--files", type=json.loads, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be >= 1 (got {args.reps})")
    if args.size_mb <= 0:
        p.error(f"--size-mb must be > 0 (got {args.size_mb})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        flat_child(args) if args.state == "flat" else child_main(args)
        return 0
    started = time.perf_counter()
    skip = set(filter(None, args.skip.split(",")))

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    own_dir = args.dir is None
    work = tempfile.mkdtemp(prefix="ckptkit-bench-") if own_dir else args.dir
    os.makedirs(work, exist_ok=True)
    try:
        if args.state == "flat":
            return _run_flat(args, log, work)
        return _run(args, skip, log, work, started)
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, skip: set[str], log: Callable[[str], None], work: str, started: float) -> int:
    import safetensors
    import safetensors.torch as st

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    d = width_for(args.size_mb)
    log(f"building the state (width {d}, {N_LAYER} layers) ...")
    net, teacher, opt = build_state(d)
    tensors = all_tensors(net, teacher, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    parts = {
        "model fp32": sum(t.numel() * 4 for t in net.state_dict().values()),
        "teacher bf16": sum(t.numel() * 2 for t in teacher.state_dict().values()),
        "AdamW state": sum(
            v.numel() * v.element_size() for s in opt.state_dict()["state"].values() for v in s.values()
        ),
    }
    P = {
        k: os.path.join(work, f)
        for k, f in (
            ("ckptkit", "state.ckpt"),
            ("torch", "state.pt"),
            ("safetensors", "state.safetensors"),
            ("raw", "state.raw"),
            ("raw_wb", "state-wb.raw"),
            ("async", "async.ckpt"),
        )
    }
    views = [byte_view(t) for t in tensors]
    header = msgpack.packb([[str(t.dtype), list(t.shape), t.numel() * t.element_size()] for t in tensors])
    r = Runner(args.reps, log)

    def fresh(key: str) -> Callable[[], None]:
        return lambda: os.path.exists(P[key]) and os.unlink(P[key])

    # ------------------------------------------------------------ save
    log("save ...")
    r.interleaved(
        {
            "ckptkit save": (fresh("ckptkit"), lambda: ckptkit.save(P["ckptkit"], ckpt_of(net, teacher, opt))),
            "torch.save + fsync": (fresh("torch"), lambda: _torch_save(P["torch"], torch_obj(net, teacher, opt))),
            "safetensors save_file + fsync": (
                fresh("safetensors"),
                lambda: _st_save(P["safetensors"], *flat_of(net, teacher, opt)),
            ),
            "raw write + fsync (naive floor)": (fresh("raw"), lambda: raw_write(P["raw"], header, views, False)),
            "raw write + fsync, write-behind (limit)": (
                fresh("raw_wb"),
                lambda: raw_write(P["raw_wb"], header, views, True),
            ),
        }
    )
    file_size = os.path.getsize(P["ckptkit"])

    # ------------------------------------------------------------ restore
    log("restore ...")
    extents = ckpt_extents(P["ckptkit"], net, teacher, opt)
    stack = linear_stack(args.size_mb)
    P["stack"], P["stack_st"] = os.path.join(work, "stack.ckpt"), os.path.join(work, "stack.safetensors")
    ckptkit.save(P["stack"], Checkpoint(step=1, model={"net": stack.state_dict()}))
    st.save_file(stack.state_dict(), P["stack_st"])
    warm = {k: (lambda k=k: warm_cache(P[k])) for k in ("ckptkit", "torch", "safetensors", "stack", "stack_st")}
    r.interleaved(
        {
            "ckptkit load(into=...) (verified)": (
                warm["ckptkit"],
                lambda: _restore_into(P["ckptkit"], net, teacher, opt),
            ),
            "ckptkit load + load_state_dict (verified)": (
                warm["ckptkit"],
                lambda: _ckpt_load(P["ckptkit"], net, teacher, opt),
            ),
            "torch.load(weights_only) + load_state_dict": (
                warm["torch"],
                lambda: _torch_load(P["torch"], net, teacher, opt),
            ),
            "safetensors load_file + load_state_dict": (
                warm["safetensors"],
                lambda: _st_load(P["safetensors"], net, teacher, opt, st),
            ),
            "ckptkit load + load_state_dict, Linears (verified)": (
                warm["stack"],
                lambda: stack.load_state_dict(ckptkit.load(P["stack"]).model["net"]),
            ),
            "safetensors load_file + load_state_dict, Linears": (
                warm["stack_st"],
                lambda: stack.load_state_dict(st.load_file(P["stack_st"])),
            ),
            "raw pread into params (limit)": (warm["ckptkit"], lambda: raw_read_into(P["ckptkit"], extents, False)),
            "raw pread + xxh3 into params, 1 thread": (
                warm["ckptkit"],
                lambda: raw_read_into(P["ckptkit"], extents, True),
            ),
        }
    )

    # ------------------------------------------------------------ lazy, verify, limits
    log("lazy, verify, limits ...")
    key = lazy_key()
    lazy_bytes = net.state_dict()[key].numel() * 4

    def st_lazy() -> float:
        from safetensors import safe_open

        with safe_open(P["safetensors"], "pt") as f:
            return float(f.get_tensor(f"model.net.{key}").sum())

    def torch_lazy() -> float:
        return float(torch.load(P["torch"], weights_only=True, mmap=True)["model"]["net"][key].sum())

    buf = bytearray(8 * MiB)
    copies = [torch.empty_like(t) for t in tensors]
    pairs = [(byte_view(d_).cast("B"), byte_view(s_).cast("B")) for d_, s_ in zip(copies, tensors, strict=True)]

    def memcopy() -> None:
        parallel_copy(pairs)

    def hash_all() -> None:
        for v in views:
            xxhash.xxh3_64_intdigest(v)

    def verify() -> None:
        rep = ckptkit.verify(P["ckptkit"])
        assert rep.ok, rep.error

    ops: dict[str, tuple[Callable[[], Any] | None, Callable[[], Any]]] = {
        "ckptkit open_checkpoint + one tensor": (warm["ckptkit"], lambda: _lazy_one(P["ckptkit"])),
        "safetensors safe_open + get_tensor": (warm["safetensors"], st_lazy),
        "torch.load(mmap=True) + one tensor": (warm["torch"], torch_lazy),
        "ckptkit verify": (warm["ckptkit"], verify),
        "read file, 8 MiB preads (read bandwidth)": (warm["ckptkit"], lambda: read_file(P["ckptkit"], buf)),
        "memory copy of every tensor (2 threads)": (None, memcopy),
        "xxh3 of every tensor in memory, 1 thread": (None, hash_all),
    }
    if "cold" not in skip:
        ops["ckptkit verify, cold cache"] = (lambda: drop_cache(P["ckptkit"]), verify)
        ops["read file, cold cache (read bandwidth)"] = (
            lambda: drop_cache(P["ckptkit"]),
            lambda: read_file(P["ckptkit"], buf),
        )
    r.interleaved(ops)
    del copies

    # ------------------------------------------------------------ async save
    asyncres: dict[str, Any] = {}
    if "async" not in skip:
        log("async save ...")
        saver = AsyncSaver()
        stalls, waits = [], []
        for _i in range(args.reps + 1):
            fresh("async")()
            gc.collect()
            t0 = time.perf_counter()
            saver.save(P["async"], ckpt_of(net, teacher, opt))
            t1 = time.perf_counter()
            saver.wait()
            t2 = time.perf_counter()
            stalls.append(t1 - t0)
            waits.append(t2 - t1)
        saver.close()
        ckptkit.save(P["ckptkit"], ckpt_of(net, teacher, opt))  # the same state, synchronously
        same = _file_digest(P["async"]) == _file_digest(P["ckptkit"])
        asyncres = {
            "first_stall_s": stalls[0],
            "stall_s": statistics.median(stalls[1:]),
            "write_s": statistics.median(waits[1:]),
            "identical_bytes": same,
        }

    # ------------------------------------------------------------ memory
    memory: dict[str, Any] = {}
    if "memory" not in skip:
        log("peak memory (a child process runs each op in turn) ...")
        files = json.dumps({k: P[k] for k in ("ckptkit", "torch", "safetensors")})
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            ",".join(MEMORY_OPS),
            "--width",
            str(d),
            "--files",
            files,
            "--dir",
            work,
        ]
        # A fixed mmap threshold: every large block is its own mapping, returned to the
        # system when freed, so RSS measures what is live (not glibc's cached heap).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        for line in proc.stdout.splitlines():
            m = json.loads(line)
            memory[m["op"]] = m
        if proc.returncode != 0:
            failed = next((op for op in MEMORY_OPS if op not in memory), "?")
            memory[failed] = {"error": proc.stderr.strip().splitlines()[-1:]}

    # ------------------------------------------------------------ zstd
    zrows: list[dict] = []
    if "zstd" not in skip:
        log("zstd ...")
        zrows = zstd_table(net, teacher, opt, args.zstd_sample_mb, [1, 3, 9])

    result = _report(
        args,
        r,
        nbytes,
        file_size,
        parts,
        d,
        lazy_bytes,
        asyncres,
        memory,
        zrows,
        safetensors.__version__,
        time.perf_counter() - started,
        work,
    )
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
    else:
        _print(result)
    return 0


def _file_digest(path: str) -> int:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.intdigest()


def _fs_type(path: str) -> str:
    best, kind = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, fs, *_ = line.split()
            if os.path.realpath(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fs
    return kind


def _report(args, r, nbytes, file_size, parts, d, lazy_bytes, asyncres, memory, zrows, st_version, wall, work):
    med = {k: r.median(k) for k in r.times}
    gb = nbytes / 1e9
    ops = {
        k: {"median_s": v, "gbps": gb / v, "times_s": r.times[k], "cpu_s": statistics.median(r.cpu[k])}
        for k, v in med.items()
    }
    for k in (
        "ckptkit open_checkpoint + one tensor",
        "safetensors safe_open + get_tensor",
        "torch.load(mmap=True) + one tensor",
    ):
        ops[k]["gbps"] = lazy_bytes / 1e9 / med[k]
    S, T, ST = med["ckptkit save"], med["torch.save + fsync"], med["safetensors save_file + fsync"]
    WL = med["raw write + fsync, write-behind (limit)"]
    RI, TL, SL = (
        med["ckptkit load(into=...) (verified)"],
        med["torch.load(weights_only) + load_state_dict"],
        med["safetensors load_file + load_state_dict"],
    )
    RL = med["raw pread into params (limit)"]
    V, RB = med["ckptkit verify"], med["read file, 8 MiB preads (read bandwidth)"]
    ratios = {
        "save / torch.save": S / T,
        "save / safetensors": S / ST,
        "save / write limit": S / WL,
        "save / naive floor": S / med["raw write + fsync (naive floor)"],
        "restore_into / safetensors": RI / SL,
        "restore_into / torch.load path": RI / TL,
        "restore_into / pread limit": RI / RL,
        "verify speed / read bandwidth (warm)": RB / V,
        "lazy one tensor (ms)": med["ckptkit open_checkpoint + one tensor"] * 1e3,
        "load + load_state_dict / safetensors": med["ckptkit load + load_state_dict (verified)"] / SL,
        "load + load_state_dict / safetensors, Linear stack": med["ckptkit load + load_state_dict, Linears (verified)"]
        / med["safetensors load_file + load_state_dict, Linears"],
        "lazy one tensor / safetensors safe_open": med["ckptkit open_checkpoint + one tensor"]
        / med["safetensors safe_open + get_tensor"],
    }
    if "ckptkit verify, cold cache" in med:
        ratios["verify speed / read bandwidth (cold)"] = (
            med["read file, cold cache (read bandwidth)"] / med["ckptkit verify, cold cache"]
        )
    if asyncres:
        ratios["async stall / sync save"] = asyncres["stall_s"] / S
    mem = {}
    for op, m in memory.items():
        if "extra" in m:
            mem[op] = {"extra_bytes": m["extra"], "of_checkpoint": m["extra"] / file_size, "reset_ok": m["reset_ok"]}
        else:
            mem[op] = m
    targets = [
        ("save <= 0.8x torch.save+fsync", ratios["save / torch.save"], 0.8, "<="),
        ("save <= 1.1x safetensors save+fsync", ratios["save / safetensors"], 1.1, "<="),
        ("verified restore_into <= 1.2x safetensors restore", ratios["restore_into / safetensors"], 1.2, "<="),
        ("verified restore_into <= 0.3x torch.load path", ratios["restore_into / torch.load path"], 0.3, "<="),
        ("lazy: one tensor in milliseconds (<= 20 ms)", ratios["lazy one tensor (ms)"], 20, "<="),
        (
            "verified load + load_state_dict <= 1.2x safetensors",
            ratios["load + load_state_dict / safetensors"],
            1.2,
            "<=",
        ),
        (
            "verified load + load_state_dict <= 1.2x safetensors, Linear stack",
            ratios["load + load_state_dict / safetensors, Linear stack"],
            1.2,
            "<=",
        ),
        ("verified restore_into <= 1.0x safetensors restore", ratios["restore_into / safetensors"], 1.0, "<="),
        (
            "lazy open + one tensor <= 2x safetensors safe_open",
            ratios["lazy one tensor / safetensors safe_open"],
            2,
            "<=",
        ),
        ("verify >= 0.8x read bandwidth (warm)", ratios["verify speed / read bandwidth (warm)"], 0.8, ">="),
    ]
    if "verify speed / read bandwidth (cold)" in ratios:
        targets.append(
            ("verify >= 0.8x read bandwidth (cold)", ratios["verify speed / read bandwidth (cold)"], 0.8, ">=")
        )
    if asyncres:
        targets.append(("async save stall <= 0.1x sync save", ratios["async stall / sync save"], 0.1, "<="))
        targets.append(
            ("async and sync saves: identical bytes", 1.0 if asyncres["identical_bytes"] else 0.0, 1.0, ">=")
        )
    for op in ("ckptkit_save", "ckptkit_restore_into"):
        if op in mem and "of_checkpoint" in mem[op]:
            targets.append((f"{op}: peak extra RSS <= 0.2x checkpoint", mem[op]["of_checkpoint"], 0.2, "<="))
    tgt = [
        {"target": n, "value": v, "limit": lim, "met": (v <= lim) if op == "<=" else (v >= lim)}
        for n, v, lim, op in targets
    ]
    return {
        "schema_version": 1,
        "config": {
            "size_mb": args.size_mb,
            "reps": args.reps,
            "state_bytes": nbytes,
            "file_bytes": file_size,
            "parts_bytes": parts,
            "width": d,
            "layers": N_LAYER,
            "vocab": VOCAB,
            "lazy_tensor": f"model/net/{lazy_key()} ({lazy_bytes} bytes)",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_1min_at_end": os.getloadavg()[0],
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "safetensors": st_version,
            "ckptkit": ckptkit.__version__,
            "fs": _fs_type(work),
            "dir": work,
            "platform": platform.platform(),
        },
        "ops": ops,
        "ratios": ratios,
        "async": asyncres,
        "memory": mem,
        "zstd": zrows,
        "targets": tgt,
        "wall_s": wall,
    }


def _print(res: dict) -> None:
    c, m = res["config"], res["machine"]
    print(
        f"ckptkit bench: {c['state_bytes'] / MiB:.0f} MiB of state "
        f"({', '.join(f'{k} {v / MiB:.0f} MiB' for k, v in c['parts_bytes'].items())}); "
        f"GPT width {c['width']}, {c['layers']} layers; {c['reps']} reps, medians"
    )
    print(
        f"machine: {m['cpus']} cpus, torch threads {m['torch_threads']} (load average "
        f"{m['loadavg_1min_at_end']:.1f} at the end), {m['fs']} at "
        f"{m['dir']}, Python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}"
    )
    groups = [
        (
            "save (every byte checksummed by ckptkit; all fsync'd)",
            [
                "ckptkit save",
                "torch.save + fsync",
                "safetensors save_file + fsync",
                "raw write + fsync (naive floor)",
                "raw write + fsync, write-behind (limit)",
            ],
        ),
        (
            "restore into a live model + teacher + AdamW (warm cache)",
            [
                "ckptkit load(into=...) (verified)",
                "ckptkit load + load_state_dict (verified)",
                "torch.load(weights_only) + load_state_dict",
                "safetensors load_file + load_state_dict",
                "ckptkit load + load_state_dict, Linears (verified)",
                "safetensors load_file + load_state_dict, Linears",
                "raw pread into params (limit)",
                "raw pread + xxh3 into params, 1 thread",
            ],
        ),
        (
            f"lazy: open + one tensor ({c['lazy_tensor']}) + read it",
            [
                "ckptkit open_checkpoint + one tensor",
                "safetensors safe_open + get_tensor",
                "torch.load(mmap=True) + one tensor",
            ],
        ),
        (
            "verify and the machine's limits",
            [
                "ckptkit verify",
                "read file, 8 MiB preads (read bandwidth)",
                "ckptkit verify, cold cache",
                "read file, cold cache (read bandwidth)",
                "memory copy of every tensor (2 threads)",
                "xxh3 of every tensor in memory, 1 thread",
            ],
        ),
    ]
    ops = res["ops"]
    for title, names in groups:
        print(f"\n{title}")
        base = ops[names[0]]["median_s"]
        for n in names:
            if n not in ops:
                continue
            o = ops[n]
            rel = "" if n == names[0] else f"   ckptkit is {base / o['median_s']:.2f}x this time"
            t = o["median_s"]
            ts = f"{t * 1e3:8.1f} ms" if t < 1 else f"{t:8.3f} s "
            print(f"  {n:46} {ts} {o['gbps']:6.2f} GB/s  cpu {o['cpu_s']:6.3f} s{rel}")
    print("\nratios (ckptkit time / other time; < 1 is faster)")
    for k, v in res["ratios"].items():
        print(f"  {k:42} {v:7.3f}")
    a = res["async"]
    if a:
        print(
            f"\nasync save: stall {a['stall_s'] * 1e3:.1f} ms (first save, allocating the buffer: "
            f"{a['first_stall_s'] * 1e3:.1f} ms), background write {a['write_s']:.3f} s, "
            f"bytes identical to a synchronous save: {a['identical_bytes']}"
        )
    if res["memory"]:
        print("\npeak extra resident memory during the op (VmHWM - VmRSS before; fresh process each)")
        for op, mm in res["memory"].items():
            if "extra_bytes" in mm:
                print(
                    f"  {op:24} {mm['extra_bytes'] / MiB:8.1f} MiB  = {mm['of_checkpoint']:.2f}x the checkpoint"
                    + ("" if mm["reset_ok"] else "  (peak reset unavailable: upper bound)")
                )
            else:
                print(f"  {op:24} failed: {mm}")
    if res["zstd"]:
        print(
            "\nzstd on realistic tensors (one core; 'pays below' = disk speed under which compress-then-write "
            "beats writing raw)"
        )
        print(
            f"  {'kind':26} {'level':>5} {'shuffle':>7} {'ratio':>6} {'comp GB/s':>9} {'dec GB/s':>8} "
            f"{'pays below':>11}"
        )
        for z in res["zstd"]:
            print(
                f"  {z['kind']:26} {z['level']:5d} {z['shuffle']:>7} {z['ratio']:6.3f} {z['compress_gbps']:9.2f} "
                f"{z['decompress_gbps']:8.2f} {z['pays_below_gbps'] * 1e3:7.0f} MB/s"
            )
    print("\ntargets")
    for t in res["targets"]:
        print(f"  {'MET ' if t['met'] else 'MISS'} {t['target']:52} {t['value']:.3f} (limit {t['limit']})")
    print(f"\nwall time {res['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
