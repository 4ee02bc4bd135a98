"""The fast paths give the same answers as the plain ones (spec/performance.md).

Lazy (mapped) reads, restore into existing tensors, threaded and streamed reads,
mapped verify, write-behind, and asynchronous saves: each is checked for the same
bytes, the same values and the same errors as the straightforward path. Nothing
here measures time; ``bench/`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import time

import pytest
import torch
import xxhash
from helpers import bits, same

import ckptkit.format._container as container
import ckptkit.format._io as _fileio
import ckptkit.format._read as _read
from ckptkit import (
    AsyncSaver,
    Checkpoint,
    ChecksumMismatch,
    ResumeRefused,
    RunState,
    SaveFailed,
    StateMismatch,
    UnsupportedValue,
    load,
    open_checkpoint,
    save,
    verify,
)
from ckptkit.format._container import Source, read_layout


def state() -> dict:
    """Every awkward case at once: dtypes, NaN payloads, -0.0, aliases, views, empties, tuples."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g)
    w[0, 0], w[0, 1] = float("nan"), -0.0
    w.view(torch.int32)[0, 2] = 0x7FC00123  # a NaN with a payload
    return {
        "w": w,
        "tied": w,
        "wT": w.t(),
        "b": torch.randn(8, generator=g).to(torch.bfloat16),
        "i": torch.arange(5, dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "nested": {"t": (1, 2.5, "x", b"y", None, torch.ones(3, dtype=torch.float16))},
    }


def saved(tmp_path, name="s.ckpt", **kw) -> tuple[object, Checkpoint]:
    path = tmp_path / name
    ckpt = Checkpoint(step=5, model={"net": state()}, optim={"lr": 0.1, "m": torch.zeros(4)}, **kw)
    save(path, ckpt)
    return path, ckpt


def tensor_offset(path, section: str, i: int) -> tuple[int, int]:
    with Source(path) as src:
        sec = read_layout(src).sections[section]
    assert sec is not None
    record = sec.tensors[i]
    assert record.digest is not None
    return sec.data_start + record.offset, record.digest


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# ================================================================ lazy (mapped) reads


def test_open_checkpoint_returns_every_value_bit_exact(tmp_path):
    path, _ckpt = saved(tmp_path)
    with open_checkpoint(path) as ck:
        assert (ck.step, ck.flags, ck.legacy, ck.sections) == (5, 0, False, ("model", "optim"))
        assert ck.keys("model", "net") == sorted(state())
        assert ck.keys("model", "net", "nested", "t") == [0, 1, 2, 3, 4, 5]
        assert same(ck.get("model"), load(path).model)
        assert ck.get("optim", "lr") == 0.1
        assert ck.tensor("model", "net", "tied") is ck.tensor("model", "net", "w")  # one tensor, one object


def test_a_lazy_checksum_failure_is_found_on_first_access_with_the_exact_message(tmp_path):
    path, _ = saved(tmp_path)
    at, digest = tensor_offset(path, "model", 0)  # tensor 0 in first-reference order: "b" (bfloat16[8])
    flip(path, at + 3)
    with open(path, "rb") as f:
        f.seek(at)
        got = xxhash.xxh3_64_intdigest(f.read(16))
    with open_checkpoint(path) as ck:  # opening reads no tensor byte: no error yet
        assert torch.equal(ck.tensor("model", "net", "i"), torch.arange(5))  # others unaffected
        with pytest.raises(ChecksumMismatch) as e:
            ck.tensor("model", "net", "b")
    err = e.value
    assert (err.offset, err.field, err.expected, err.actual) == (at, "model data", f"0x{digest:016x}", f"0x{got:016x}")
    assert str(err).startswith(
        f"{path}: offset {at} (0x{at:x}): model data: tensor 0 (bfloat16[8]) digest does not match its bytes "
        f"(expected 0x{digest:016x}, got 0x{got:016x}); "
    )
    assert "R-007" in str(err)
    with pytest.raises(ChecksumMismatch) as again:  # the full load names the same tensor the same way
        load(path)
    assert str(again.value) == str(e.value)


def test_lazy_tensors_are_private_copies_on_write_and_outlive_close(tmp_path):
    path, ckpt = saved(tmp_path)
    before = path.read_bytes()
    ck = open_checkpoint(path)
    w = ck.tensor("model", "net", "w")
    ck.close()
    w.mul_(0)  # writable, after close, and the file does not change
    assert path.read_bytes() == before
    assert bits(open_checkpoint(path).tensor("model", "net", "w")) == bits(ckpt.model["net"]["w"])


def test_lazy_access_names_missing_keys_and_non_tensors(tmp_path):
    path, _ = saved(tmp_path)
    with open_checkpoint(path) as ck:
        with pytest.raises(KeyError) as e:
            ck.tensor("model", "net", "nope")
        assert e.value.args[0] == (
            f"{path}: model['net']: no key 'nope' (keys here: 'b', 'empty', 'flag', 'i', "
            "'nested', 'scalar', 'tied', 'w', ... (9 keys))"
        )
        with pytest.raises(KeyError, match=r"no section 'teacher' in this checkpoint \(present: model, optim\)"):
            ck.get("teacher")
        with pytest.raises(TypeError, match=r"optim\['lr'\]: is a float, not a tensor"):
            ck.tensor("optim", "lr")


def test_lazy_reads_a_zstd_section(tmp_path):
    path = tmp_path / "z.ckpt"
    ckpt = Checkpoint(step=1, model={"net": state()})
    save(path, ckpt, compression="zstd")
    with open_checkpoint(path) as ck:
        assert same(ck.get("model"), load(path).model)


# ================================================================ restore into existing tensors


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3).to(torch.bfloat16))


def test_load_into_fills_the_module_in_place_bit_exactly(tmp_path):
    src, dst = _net(0), _net(1)
    with torch.no_grad():
        src[0].weight[0, 0] = float("nan")
    save(tmp_path / "m.ckpt", Checkpoint(step=1, model={"net": src.state_dict()}))
    ptrs = [p.data_ptr() for p in dst.parameters()]
    ck = load(tmp_path / "m.ckpt", into={"model": {"net": dst.state_dict()}})
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert bits(a) == bits(b), k
    assert [p.data_ptr() for p in dst.parameters()] == ptrs  # the same memory, no new tensors
    assert ck.model["net"]["0.weight"].data_ptr() == dst[0].weight.data_ptr()  # the tree holds the destination


def test_load_into_restores_optimizer_state_in_place(tmp_path):
    def trained(seed: int, steps: int):
        net = _net(seed)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for _ in range(steps):
            torch.stack([p.float().square().sum() for p in net.parameters()]).sum().backward()
            opt.step()
        return net, opt

    net_a, opt_a = trained(0, 3)
    save(
        tmp_path / "o.ckpt",
        Checkpoint(step=3, model={"net": net_a.state_dict()}, optim={"optimizers": {"adamw": opt_a.state_dict()}}),
    )
    net_b, opt_b = trained(1, 1)
    state_b = opt_b.state_dict()
    ck = load(
        tmp_path / "o.ckpt", into={"model": {"net": net_b.state_dict()}, "optim": {"optimizers": {"adamw": state_b}}}
    )
    opt_b.load_state_dict(ck.optim["optimizers"]["adamw"])  # param_groups; state tensors already in place
    for sa, sb in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values(), strict=True):
        assert all(bits(sa[k]) == bits(sb[k]) for k in sa)
    assert opt_b.state_dict()["state"][0]["exp_avg"].data_ptr() == state_b["state"][0]["exp_avg"].data_ptr()


def test_load_into_an_empty_optimizer_needs_strict_false(tmp_path):
    net = torch.nn.Linear(6, 3)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(2, 6)).sum().backward()
    opt.step()
    save(tmp_path / "o.ckpt", Checkpoint(step=1, optim={"optimizers": {"adamw": opt.state_dict()}}))
    fresh = torch.optim.AdamW(torch.nn.Linear(6, 3).parameters())
    with pytest.raises(
        ResumeRefused,
        match=r"optim\['optimizers'\]\['adamw'\]\['state'\]\[0\]: in the checkpoint "
        r"but not in the destination \(strict=False loads it into new memory\)",
    ):
        load(tmp_path / "o.ckpt", into={"optim": {"optimizers": {"adamw": fresh.state_dict()}}})
    ck = load(tmp_path / "o.ckpt", into={"optim": {"optimizers": {"adamw": fresh.state_dict()}}}, strict=False)
    fresh.load_state_dict(ck.optim["optimizers"]["adamw"])
    assert bits(fresh.state_dict()["state"][0]["exp_avg"]) == bits(opt.state_dict()["state"][0]["exp_avg"])


def test_load_into_refuses_a_different_layout_listing_every_problem_and_writes_nothing(tmp_path):
    save(
        tmp_path / "m.ckpt",
        Checkpoint(step=1, model={"net": {"w": torch.ones(2, 3), "b": torch.ones(3), "extra": torch.ones(1)}}),
    )
    dest = {"w": torch.zeros(3, 2), "b": torch.zeros(3, dtype=torch.float64), "gone": torch.zeros(1)}
    with pytest.raises(StateMismatch) as e:
        load(tmp_path / "m.ckpt", into={"model": {"net": dest}})
    assert isinstance(e.value, ResumeRefused) and len(e.value.problems) == 4
    assert str(e.value) == (
        f"{tmp_path / 'm.ckpt'}: does not fit the destination tensors: "
        "model['net']['w']: shape [2, 3] in the checkpoint, [3, 2] in the destination; "
        "model['net']['b']: dtype float32 in the checkpoint, float64 in the destination; "
        "model['net']['gone']: missing from the checkpoint; "
        "model['net']['extra']: in the checkpoint but not in the destination (strict=False loads it into new memory); "
        "the checkpoint was written for another model or optimizer layout"
    )
    assert all(not t.any() for t in dest.values())  # checked before any byte was read


def test_load_into_an_absent_section_is_refused(tmp_path):
    save(tmp_path / "m.ckpt", Checkpoint(step=1, model={"w": torch.ones(2)}))
    with pytest.raises(ResumeRefused, match=r"teacher: section is absent from the checkpoint"):
        load(tmp_path / "m.ckpt", into={"teacher": {"w": torch.zeros(2)}})


def test_load_into_strided_destinations_goes_through_a_temporary(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    save(tmp_path / "m.ckpt", Checkpoint(step=1, model={"w": w}))
    backing = torch.zeros(4, 3)
    dest = backing.t()  # non-contiguous (3, 4) view
    load(tmp_path / "m.ckpt", into={"model": {"w": dest}})
    assert torch.equal(backing.t(), w)


def test_a_corrupt_tensor_met_while_restoring_in_threads_is_the_earliest_in_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(_read, "_PARALLEL_MIN", 0)  # threads even for a small file
    monkeypatch.setattr(_read, "_READ_PIECE", 64)  # many pieces per tensor
    path, ckpt = saved(tmp_path)
    dest = {k: torch.zeros_like(v) for k, v in state().items() if k not in ("nested", "tied", "wT")}
    got = load(path, into={"model": {"net": dest}}, strict=False)
    assert same(got.model, ckpt.model)
    first, _ = tensor_offset(path, "model", 3)  # "i": int64[5]
    later, _ = tensor_offset(path, "model", 6)  # "w": float32[16, 8]
    flip(path, later + 100)
    flip(path, first + 1)
    with pytest.raises(ChecksumMismatch, match=rf"offset {first} .*tensor 3 \(int64\[5\]\)"):
        load(path, into={"model": {"net": dest}}, strict=False)


# ================================================================ streamed, mapped and chunked I/O


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_chunk_size_changes_neither_the_bytes_nor_what_is_read(tmp_path, monkeypatch, chunk):
    ref, ckpt = saved(tmp_path, "ref.ckpt")
    zref = tmp_path / "zref.ckpt"
    save(zref, ckpt, compression="zstd")
    monkeypatch.setattr(container, "_CHUNK", chunk)
    monkeypatch.setattr(_read, "_CHUNK", chunk)
    monkeypatch.setattr(_read, "_READ_PIECE", chunk)
    monkeypatch.setattr(_fileio, "_WRITE_BEHIND", 256)  # write-behind after every few pieces
    for codec, want in (("raw", ref), ("zstd", zref)):
        p = tmp_path / f"{codec}-{chunk}.ckpt"
        save(p, ckpt, compression=codec)
        assert p.read_bytes() == want.read_bytes()
        assert same(load(p).model, ckpt.model)
        assert verify(p).ok


def test_saves_are_the_same_bytes_without_write_behind(tmp_path, monkeypatch):
    ref, ckpt = saved(tmp_path, "ref.ckpt")
    monkeypatch.setattr(_fileio, "_sync_file_range", False)  # as on a system without sync_file_range
    save(tmp_path / "b.ckpt", ckpt)
    assert (tmp_path / "b.ckpt").read_bytes() == ref.read_bytes()


def test_verify_through_small_mapped_windows_finds_a_flipped_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(_fileio, "_MAP_MIN", 0)
    monkeypatch.setattr(_fileio, "_WINDOW", 4096)
    monkeypatch.setattr(_read, "_PARALLEL_MIN", 0)  # threads even for a small file
    big = torch.arange(5000, dtype=torch.float32)  # 20000 bytes: several windows
    path = tmp_path / "v.ckpt"
    save(path, Checkpoint(step=1, model={"a": torch.ones(3), "big": big}, optim={"c": torch.ones(100)}))
    assert verify(path).ok and verify(path).bytes_hashed == 12 + 20000 + 400
    at, _ = tensor_offset(path, "model", 1)
    flip(path, at + 19_000)
    r = verify(path)
    assert isinstance(r.error, ChecksumMismatch)
    assert f"offset {at} (0x{at:x}): model data: tensor 1 (float32[5000])" in str(r.error)
    later, _ = tensor_offset(path, "optim", 0)
    flip(path, later)  # a second corrupt tensor, later in the file: the report names the earlier one
    assert f"offset {at} (0x{at:x}): model data: tensor 1" in str(verify(path).error)


def test_a_corrupt_zstd_tensor_is_found_by_the_streamed_verify_and_load(tmp_path, monkeypatch):
    monkeypatch.setattr(_read, "_CHUNK", 10)
    path = tmp_path / "z.ckpt"
    save(path, Checkpoint(step=1, model={"a": torch.arange(40.0), "b": torch.arange(30.0)}), compression="zstd")
    with Source(path) as src:
        sec = read_layout(src).sections["model"]
    # Re-stamp tensor 1's digest in the index (same length) and reseal the skeleton: only R-007 can fire.
    data = bytearray(path.read_bytes())
    old = sec.tensors[1].digest.to_bytes(8, "little")
    i = data.index(old, sec.start)
    data[i : i + 8] = (sec.tensors[1].digest ^ 1).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with Source(path) as src:
        layout = read_layout(src)
        h = xxhash.xxh3_64()
        for a, b in container.skeleton_extents(layout):
            h.update(bytes(data[a:b]))
    data[layout.trailer_offset : layout.trailer_offset + 8] = h.intdigest().to_bytes(8, "little")
    path.write_bytes(bytes(data))
    r = verify(path)
    assert isinstance(r.error, ChecksumMismatch) and "tensor 1 (float32[30])" in str(r.error)
    with pytest.raises(ChecksumMismatch, match=r"tensor 1 \(float32\[30\]\)"):
        load(path)


# ================================================================ asynchronous save


def test_async_and_sync_saves_produce_identical_bytes(tmp_path):
    path, ckpt = saved(tmp_path, "sync.ckpt")
    with AsyncSaver() as saver:
        saver.save(tmp_path / "async.ckpt", ckpt)
        saver.save(tmp_path / "async2.ckpt", ckpt)  # the second reuses the buffer
    assert (tmp_path / "async.ckpt").read_bytes() == path.read_bytes()
    assert (tmp_path / "async2.ckpt").read_bytes() == path.read_bytes()
    for z in ("sync-z.ckpt", "async-z.ckpt"):
        (save if z.startswith("sync") else _async_save)(tmp_path / z, ckpt, compression="zstd")
    assert (tmp_path / "sync-z.ckpt").read_bytes() == (tmp_path / "async-z.ckpt").read_bytes()


def _async_save(path, ckpt, **kw):
    with AsyncSaver(**kw) as saver:
        saver.save(path, ckpt)


def test_async_save_writes_the_state_as_it_was_when_save_returned(tmp_path):
    w = torch.ones(1000)
    with AsyncSaver() as saver:
        saver.save(tmp_path / "a.ckpt", Checkpoint(step=1, model={"w": w}))
        w.fill_(7.0)  # training goes on while the write runs
    assert torch.equal(load(tmp_path / "a.ckpt").model["w"], torch.ones(1000))


def test_async_save_reuses_its_buffer(tmp_path):
    ckpt = Checkpoint(step=1, model={"w": torch.ones(1000), "b": torch.ones(10)})
    with AsyncSaver() as saver:
        saver.save(tmp_path / "a.ckpt", ckpt)
        saver.wait()
        arena = saver._pool._arena
        assert arena is not None
        saver.save(tmp_path / "b.ckpt", dataclasses.replace(ckpt, step=2))
        assert saver._pool._arena is arena


def test_async_save_refuses_unstorable_values_at_once(tmp_path):
    with AsyncSaver() as saver:
        with pytest.raises(UnsupportedValue, match=r"model\['act'\]: a torch.nn.modules.activation.GELU"):
            saver.save(tmp_path / "a.ckpt", Checkpoint(step=1, model={"act": torch.nn.GELU()}))
        assert not saver.pending
    assert os.listdir(tmp_path) == []


def _enospc(monkeypatch):
    def failing_write(fd, buf):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(container.os, "write", failing_write)


def test_a_failed_background_write_is_raised_by_the_next_save_and_loses_nothing(tmp_path, monkeypatch):
    path, _ = saved(tmp_path)
    before = path.read_bytes()
    saver = AsyncSaver()
    _enospc(monkeypatch)
    saver.save(path, Checkpoint(step=6, model={"w": torch.ones(100)}))  # returns: the write fails in the background
    while saver.pending:
        time.sleep(0.001)
    monkeypatch.undo()
    with pytest.raises(SaveFailed) as e:
        saver.save(path, Checkpoint(step=7, model={"w": torch.ones(100)}))  # not started: the failure comes first
    assert e.value.errno == errno.ENOSPC
    assert str(e.value) == f"{path}: write failed (ENOSPC: No space left on device); the previous file is intact"
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["s.ckpt"]
    saver.save(path, Checkpoint(step=7, model={"w": torch.ones(100)}))  # the error was raised once; retry works
    saver.close()
    assert load(path).step == 7


def test_a_failed_background_write_is_raised_by_wait_and_by_close(tmp_path, monkeypatch):
    for finish in ("wait", "close"):
        saver = AsyncSaver()
        _enospc(monkeypatch)
        saver.save(tmp_path / f"{finish}.ckpt", Checkpoint(step=1, model={"w": torch.ones(10)}))
        with pytest.raises(SaveFailed, match="ENOSPC"):
            getattr(saver, finish)()
        monkeypatch.undo()
        saver.close()
    assert os.listdir(tmp_path) == []


# ================================================================ RunState(async_save=True)


@dataclasses.dataclass(frozen=True)
class Cfg:
    lr: float = 0.1
    steps: int = 10


def _run(run_dir, async_save: bool) -> tuple[RunState, torch.nn.Module]:
    net = _net(0)
    rs = RunState(run_dir, config=Cfg(), keep=2, async_save=async_save)
    rs.add_model("net", net)
    rs.add_sidecar("ngram", get=lambda: (3, {"counts": torch.arange(4)}), set=lambda step, tree: None)
    return rs, net


def test_runstate_async_save_writes_the_same_files_as_a_sync_save(tmp_path):
    for mode in ("sync", "async"):
        rs, _ = _run(tmp_path / mode, mode == "async")
        rs.start()
        for step in (1, 2, 3):
            rs.save(step)
        rs.close()
    names = sorted(os.listdir(tmp_path / "sync"))
    assert names == sorted(os.listdir(tmp_path / "async"))
    assert "step-00000001.ckpt" not in names and "step-00000003.ckpt.ngram" in names  # retention ran
    for n in names:
        if n != "environment.json":
            assert (tmp_path / "sync" / n).read_bytes() == (tmp_path / "async" / n).read_bytes(), n


def test_runstate_async_save_failure_surfaces_at_resume_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    rs, _net = _run(tmp_path, True)
    rs.start()
    rs.save(1)
    rs.wait()
    _enospc(monkeypatch)
    rs.save(2)
    with pytest.raises(SaveFailed, match=r"step-00000002\.ckpt\.ngram: write failed \(ENOSPC"):
        rs.resume()  # the first file of the failed save was its sidecar
    monkeypatch.undo()
    info = rs.resume()
    assert info.step == 1
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]
    rs.close()


def test_every_truncation_and_byte_flip_gives_the_lazy_reader_only_typed_errors(tmp_path):
    from ckptkit import CheckpointError

    path, _ = saved(tmp_path)
    data = path.read_bytes()
    bad = tmp_path / "bad.ckpt"

    def read_all() -> None:
        with open_checkpoint(bad) as ck:
            for name in ck.sections:
                ck.get(name)

    variants = [data[:n] for n in range(0, len(data), 17)]
    variants += [data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1 :] for i in range(0, len(data), 7)]
    for v in variants:
        bad.write_bytes(v)
        with contextlib.suppress(CheckpointError):
            read_all()
