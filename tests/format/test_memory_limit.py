"""A load never asks for more memory than there is (spec/guarantees.md G-04).

A zstd section may declare up to 32768 x its stored size, so a 128 KiB file can hold a
4 GiB tensor. ``load`` and the lazy reader compare what the file declares with the
memory available (or ``max_memory``) and raise ``InsufficientMemory`` naming the tensor
before they allocate anything -- checked here under a real address-space limit. And
the cheapest thing a file can repeat, a tensor reference, costs a pointer (G-05); the
cheapest thing it can count, an empty tensor, costs memory in proportion to its bytes
in the index, in verify and in load (G-70).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
import torch
from helpers import hostile_generator

from ckptkit import Checkpoint, InsufficientMemory, load, save, verify
from ckptkit.format._container import Source, read_layout

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
hostile = hostile_generator()  # the independent writer of fixtures/hostile


def _bomb(path: Path, n: int) -> Path:
    """A valid file: one uint8 zero tensor of ``n`` bytes in a zstd frame of RLE blocks (4 bytes per 128 KiB)."""
    h = hostile
    frame = h.rle_frame([(0, n)])
    index = h.idx([["uint8", [n], 0, n, h.zeros_digest(n)]], {"z": h.ref(0)}, len(frame), raw_len=n, codec="zstd")
    path.write_bytes(h.model_index(index, frame))
    return path


def test_a_128_kib_file_declaring_a_4_gib_tensor_fails_before_allocating_under_an_address_space_limit(
    tmp_path: Path,
) -> None:
    bomb = _bomb(tmp_path / "bomb.ckpt", 4 * GIB)
    assert bomb.stat().st_size < 130 * 1024
    child = textwrap.dedent("""
        import resource, sys
        import torch, ckptkit
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
        for reader in (ckptkit.load, lambda p: ckptkit.open_checkpoint(p).tensor("model", "z")):
            try:
                reader(sys.argv[1])
            except ckptkit.InsufficientMemory as e:
                print(type(e).__name__, e)
    """)
    proc = subprocess.run([sys.executable, "-c", child, str(bomb)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert re.fullmatch(
            rf"InsufficientMemory {re.escape(str(bomb))}: loading needs 4294967296 bytes \(4\.00 GiB\) of new tensor "
            r"memory but only \d+ \(0\.\d\d GiB\) are available \(the address-space limit RLIMIT_AS\); the largest "
            r"tensor is model\['z'\] \(uint8\[4294967296\], 4294967296 bytes\); nothing was allocated\. Free memory, "
            r"load into existing tensors \(into=\.\.\.\), or pass max_memory=N bytes if the file is trusted",
            line,
        ), line


def test_verify_checks_the_bomb_with_bounded_memory_and_finds_it_valid(tmp_path: Path) -> None:
    report = verify(_bomb(tmp_path / "bomb.ckpt", 64 << 20))
    assert report.ok and report.sections[0].raw_len == 64 << 20


def test_max_memory_is_the_limit_to_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "z.ckpt"
    save(
        path,
        Checkpoint(step=1, model={"a": torch.zeros(1000), "b": torch.ones(24, dtype=torch.int64)}),
        compression="zstd",
    )
    need = 1000 * 4 + 24 * 8
    assert load(path, max_memory=need).model["a"].shape == (1000,)
    with pytest.raises(InsufficientMemory) as info:
        load(path, max_memory=need - 1)
    assert str(info.value) == (
        f"{path}: loading needs 4192 bytes (0.00 GiB) of new tensor memory but only 4191 (0.00 GiB) are available "
        "(max_memory); the largest tensor is model['a'] (float32[1000], 4000 bytes); nothing was allocated. Free "
        "memory, load into existing tensors (into=...), or pass max_memory=N bytes if the file is trusted"
    )


def test_tensors_loaded_into_existing_memory_do_not_count(tmp_path: Path) -> None:
    path = tmp_path / "r.ckpt"
    save(path, Checkpoint(step=1, model={"a": torch.arange(1000.0)}))
    dest = torch.zeros(1000)
    load(path, into={"model": {"a": dest}}, max_memory=0)
    assert dest[999] == 999.0


def test_a_million_references_to_one_tensor_cost_a_pointer_each_not_an_object(tmp_path: Path) -> None:
    """G-05: a 5.7 MiB tree of 10^6 references decodes to one reference object and one tensor."""
    n = 10**6
    index = hostile.idx([["float32", [4], 0, 16, hostile.d8(bytes(16))]], {"w": [hostile.ref(0)] * n}, 16)
    path = tmp_path / "refs.ckpt"
    path.write_bytes(hostile.model_index(index, bytes(16)))
    assert 5 << 20 < path.stat().st_size < 6 << 20
    tracemalloc.start()
    try:
        with Source(path) as src:
            model = read_layout(src).sections["model"]
            assert model is not None
            tree = model.tree["w"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(tree) == n and len({id(r) for r in tree}) == 1
    assert peak < 3 * path.stat().st_size  # the index bytes and one list of pointers
    assert verify(path).ok
    loaded = load(path).model["w"]
    assert len(loaded) == n and all(t is loaded[0] for t in loaded)


_COUNTS_CHILD = textwrap.dedent("""
    import json, resource, sys

    from ckptkit.format import verify

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    out = {"rss": status("VmRSS")}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + (5 << 20), hard))  # far too little
    report = verify(sys.argv[1])
    out["verify-5"] = f"{type(report.error).__name__}: {report.error}"
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    report = verify(sys.argv[1])  # torch-free: nothing else in this process yet
    out["verify"] = [report.ok, status("VmHWM") - out["rss"]]
    import torch, ckptkit

    vm = status("VmSize")
    for extra in (20 << 20, 110 << 20):  # too little, then enough: 10^5 empty tensors are ~40 MiB of torch objects
        resource.setrlimit(resource.RLIMIT_AS, (vm + extra, resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            out[str(extra >> 20)] = len(ckptkit.load(sys.argv[1]).model["t"])
        except BaseException as e:
            out[str(extra >> 20)] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
""")


def test_a_file_declaring_a_hundred_thousand_tensors_costs_memory_in_proportion_to_its_size(tmp_path: Path) -> None:
    """G-04, G-70: the tensor table is flat arrays, verify streams it, load batches its work.

    10^5 empty tensors, written by ckptkit's own writer (the bytes ``save`` writes for
    ``{"t": [torch.empty(0) for _ in range(n)]}``): a 2.9 MB file. Before, verify peaked
    at 25x the file (one TensorRecord and one task per tensor) and load needed ~150 MiB
    of address space beyond torch, raising a bare MemoryError (or calling the file
    damaged: "msgpack MemoryError") under less.
    """
    from ckptkit.format._container import HEADER_SIZE, write_container
    from ckptkit.format._section import TensorRef, plan_section

    n = 10**5
    plan = plan_section(
        {"t": [TensorRef(i) for i in range(n)]}, [("float32", (0,), memoryview(b""))] * n, start=HEADER_SIZE
    )
    path = tmp_path / "counts.ckpt"
    with open(path, "wb", buffering=0) as f:
        write_container(f, step=1, flags=0, plans={"model": plan})
    size = path.stat().st_size
    assert 2_800_000 < size < 3_000_000
    proc = subprocess.run([sys.executable, "-c", _COUNTS_CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    ok, peak = out["verify"]
    assert ok and peak < 10 * size, f"verify's peak extra resident memory is {peak / size:.1f}x the file"
    assert out["verify-5"] == (
        f"InsufficientMemory: {path}: ran out of memory while verifying it ({size} bytes); the file is neither "
        "damaged nor sound by this run: free memory or raise the limit (ulimit -v, the cgroup) and verify again"
    )
    assert out["110"] == n  # loads under an address-space limit of 110 MiB beyond torch's
    assert out["20"] == (
        f"InsufficientMemory: {path}: ran out of memory while loading it ({size} bytes; the tensors' memory was "
        "checked before allocating, so its index and the tensor objects did not fit): nothing of the load is kept. "
        "Free memory or raise the limit (ulimit -v, the cgroup), or read only the tensors you need with "
        "ckptkit.open_checkpoint"
    )
