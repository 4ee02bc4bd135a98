"""ckptkit's DCP backend against DCP's default filesystem backend, on 2 gloo ranks.

    python bench/bench_distributed.py                              # ~400 MB FSDP2 + AdamW, 5 rounds
    python bench/bench_distributed.py --size-mb 40 --rounds 1      # a smoke run in seconds
    python bench/bench_distributed.py --json > bench-dist.json     # one JSON object (schema_version 1)

What it builds, on each of 2 CPU ranks joined by gloo: a stack of square Linear
layers, each ``fully_shard``-ed (FSDP2, rows split between the ranks), and AdamW
after one step, so model + exp_avg + exp_avg_sq come to about ``--size-mb`` in all
(fp32). Every operation runs on that same state, the two backends interleaved within
each round (who goes first alternates) so a noisy neighbour and the page cache's
writeback hit both alike; the first round is a warm-up and is not counted; the
reported time is the median over rounds of the slowest rank.

- save: ``dcp.save`` with ``FileSystemWriter`` (fsync'd, its default) vs
  ``ckptkit.distributed.save`` (fsync'd, metadata committed last, every chunk hashed);
- load: ``dcp.load`` with ``FileSystemReader`` vs ``ckptkit.distributed.load``
  (every byte hashed and checked, every key/shape/dtype checked first), warm page cache;
- async stall: how long ``dcp.async_save`` blocks the caller (staging) with each
  backend, both on a dedicated gloo group (``ckptkit.distributed.AsyncSaver``).

Ratios are ckptkit / default: below 1.0 ckptkit is faster. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import ckptkit.distributed as ckd

OPS = ("save", "load", "async_stall")
BACKENDS = ("default", "ckptkit")


def _model(size_mb: float, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    params = int(size_mb * (1 << 20) / 4 / 3)  # fp32 weights + two AdamW moments
    width = 1024
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad()
    return model, optim


def _timed(fn: Any) -> float:
    gc.collect()  # no op pays for garbage the previous one left (ckptkit defers collection while it runs)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the job waits for its slowest rank
    return float(took.item())


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _model(args.size_mb, world)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    nbytes = sum(t.to_local().nbytes if hasattr(t, "to_local") else 0 for t in _tensors(state))
    total = torch.tensor([nbytes], dtype=torch.float64)
    dist.all_reduce(total)
    group = dist.new_group(backend="gloo")  # the default backend's async saves get one too
    saver = ckd.AsyncSaver()
    times: dict[str, dict[str, list[float]]] = {op: {b: [] for b in BACKENDS} for op in OPS}
    root = args.dir
    for rnd in range(args.rounds + 1):
        for backend in BACKENDS if rnd % 2 else BACKENDS[::-1]:  # alternate who goes first
            d = os.path.join(root, f"{backend}-{rnd}")
            if backend == "default":
                save = lambda d=d: dcp.save(state, storage_writer=dcp.FileSystemWriter(d))  # noqa: E731
                load = lambda d=d: dcp.load(state, storage_reader=dcp.FileSystemReader(d))  # noqa: E731
            else:
                save = lambda d=d: ckd.save(state, d)  # noqa: E731
                load = lambda d=d: ckd.load(state, d)  # noqa: E731
            t_save = _timed(save)
            t_load = _timed(load)
            a = d + "-async"
            if backend == "default":
                pending: list[Any] = []
                t_async = _timed(
                    lambda a=a, pending=pending: pending.append(
                        dcp.async_save(state, storage_writer=dcp.FileSystemWriter(a), process_group=group)
                    )
                )
                pending[0].result()
            else:
                t_async = _timed(lambda a=a: saver.save(state, a))
                saver.wait()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d)
                shutil.rmtree(a)
            if rnd:  # round 0 is the warm-up
                for op, t in zip(OPS, (t_save, t_load, t_async), strict=True):
                    times[op][backend].append(t)
    saver.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "state_bytes": int(total.item())}, f)
    dist.destroy_process_group()


def _tensors(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=400.0, help="model + AdamW state, all ranks together (MB)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up round)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    world = 2
    with tempfile.TemporaryDirectory(prefix="ckptkit-bench-dist-") as tmp:
        args.dir = tmp
        init, out = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(world, init, args, out), nprocs=world, join=True, start_method="spawn")
        with open(out) as f:
            result = json.load(f)
    med = {op: {b: statistics.median(ts) for b, ts in result["times"][op].items()} for op in OPS}
    ratios = {op: med[op]["ckptkit"] / med[op]["default"] for op in OPS}
    if args.json:
        print(
            json.dumps(
                {
                    "schema_version": 1,
                    "world_size": world,
                    "state_bytes": result["state_bytes"],
                    "rounds": args.rounds,
                    "seconds": med,
                    "ratio_ckptkit_over_default": ratios,
                },
                sort_keys=True,
            )
        )
        return 0
    mb = result["state_bytes"] / 1e6
    print(f"{mb:.0f} MB of FSDP2 + AdamW state on {world} gloo ranks, median of {args.rounds} round(s), slowest rank")
    print(f"{'op':<12} {'default s':>10} {'ckptkit s':>10} {'ratio':>7}")
    for op in OPS:
        print(f"{op:<12} {med[op]['default']:>10.3f} {med[op]['ckptkit']:>10.3f} {ratios[op]:>7.2f}")
    print("ratio = ckptkit / DCP default backend (FileSystemWriter/Reader); < 1.0: ckptkit is faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
