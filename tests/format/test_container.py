"""The v2 container and tensor codec: round trips, integrity, refusals (spec/container.md)."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys

import pytest
import torch
import xxhash
from helpers import bits, examples, same
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit.format._container as container
from ckptkit.errors import (
    BadMagic,
    ChecksumMismatch,
    FormatError,
    ReservedBitSet,
    SaveFailed,
    TruncatedFile,
    UnsupportedValue,
    UnsupportedVersion,
)
from ckptkit.format import verify
from ckptkit.format._checkpoint import Checkpoint, load, save
from ckptkit.format._codec import encode_tree
from ckptkit.format._container import FLAG_FP32_FALLBACK
from ckptkit.format._section import plan_section

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = 1
    for d in shape:
        n *= d
    raw = draw(
        st.binary(
            min_size=n * torch.empty((), dtype=dtype).element_size(),
            max_size=n * torch.empty((), dtype=dtype).element_size(),
        )
    )
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        t = t & 1
    t = t.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous input
    return t


plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
trees = st.recursive(
    st.one_of(plain, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(0, 50)), children, max_size=3),
    ),
    max_leaves=10,
)


@settings(max_examples=examples(2.5))
@given(
    model=trees,
    optim=st.one_of(st.none(), trees),
    teacher=st.one_of(st.none(), trees),
    monitor=st.one_of(st.none(), trees),
    step=st.integers(0, 2**64 - 1),
    flags=st.sampled_from([0, 1]),
    compression=st.sampled_from(["raw", "zstd"]),
)
def test_arbitrary_state_trees_round_trip_exactly(
    tmp_path_factory, model, optim, teacher, monitor, step, flags, compression
):
    path = tmp_path_factory.mktemp("rt") / "x.ckpt"
    ckpt = Checkpoint(step=step, model=model, optim=optim, teacher=teacher, monitor=monitor, flags=flags)
    save(path, ckpt, compression=compression)
    got = load(path)
    assert got.step == step and got.flags == flags and not got.legacy and got.missing == ()
    for name in ("model", "optim", "teacher", "monitor"):
        assert same(getattr(ckpt, name), getattr(got, name)), name
    assert verify(path).ok


@settings(max_examples=examples(1))
@given(tree=trees)
def test_encoding_is_reproducible_and_independent_of_dict_order(tmp_path_factory, tree):
    d = tmp_path_factory.mktemp("order")
    save(d / "a.ckpt", Checkpoint(step=1, model=tree))
    flipped = _reverse_dicts(tree)
    save(d / "b.ckpt", Checkpoint(step=1, model=flipped))
    assert (d / "a.ckpt").read_bytes() == (d / "b.ckpt").read_bytes()


def _reverse_dicts(tree):
    if isinstance(tree, dict):
        return {k: _reverse_dicts(tree[k]) for k in reversed(list(tree))}
    if isinstance(tree, list):
        return [_reverse_dicts(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_reverse_dicts(v) for v in tree)
    return tree


def test_shared_storage_is_stored_once_and_loads_as_one_tensor(tmp_path):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save(tmp_path / "s.ckpt", Checkpoint(step=0, model={"embed": w, "head": w, "view": w.view(3, 4)}))
    got = load(tmp_path / "s.ckpt").model
    assert got["embed"] is got["head"] is got["view"]
    assert verify(tmp_path / "s.ckpt").sections[0].tensors == 1


def test_adamw_state_resumes_optimisation_bit_identically(tmp_path):
    def make():
        g = torch.Generator().manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 2))
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)

    def step(net, opt, i):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(8, 5, generator=g)
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()

    net, opt = make()
    for i in range(3):
        step(net, opt, i)
    save(tmp_path / "o.ckpt", Checkpoint(step=3, model={"net": net.state_dict()}, optim={"adamw": opt.state_dict()}))
    for i in range(3, 6):
        step(net, opt, i)
    net2, opt2 = make()
    ck = load(tmp_path / "o.ckpt")
    net2.load_state_dict(ck.model["net"])
    opt2.load_state_dict(ck.optim["adamw"])
    for i in range(3, 6):
        step(net2, opt2, i)
    for (n, a), b in zip(net.state_dict().items(), net2.state_dict().values(), strict=True):
        assert bits(a) == bits(b), n
    for pa, pb in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert all(bits(pa[k]) == bits(pb[k]) for k in pa)


def _small(tmp_path, **kw):
    path = tmp_path / "small.ckpt"
    ckpt = Checkpoint(
        step=7,
        model={"w": torch.arange(6, dtype=torch.float32)},
        optim={"lr": 0.5, "t": torch.ones(2, dtype=torch.int64)},
        monitor={"window": [1.0, 2.0]},
        **kw,
    )
    save(path, ckpt)
    return path, path.read_bytes()


def test_every_truncation_is_detected_with_a_typed_error(tmp_path):
    _path, data = _small(tmp_path)
    cut = tmp_path / "cut.ckpt"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        r = verify(cut)
        assert not r.ok and isinstance(r.error, FormatError), n
        with pytest.raises(FormatError):
            load(cut)


@settings(max_examples=examples(8))
@given(data=st.data())
def test_any_single_bit_flip_is_detected(tmp_path_factory, data):
    path, raw = _small(tmp_path_factory.mktemp("flip"))
    i = data.draw(st.integers(0, len(raw) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(raw)
    bad[i] ^= 1 << bit
    path.write_bytes(bad)
    r = verify(path)
    assert not r.ok and isinstance(r.error, FormatError)


def test_a_flipped_tensor_byte_names_the_section_and_offset(tmp_path):
    path, raw = _small(tmp_path)
    layout = container.read_layout(container.Source(path))
    at = layout.sections["model"].data_start + 4
    bad = bytearray(raw)
    bad[at] ^= 0x01
    path.write_bytes(bad)
    with pytest.raises(ChecksumMismatch) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: offset {at - 4} (0x{at - 4:x}): model data: tensor 0 (float32[6]) digest")


def test_a_huge_length_field_fails_fast_without_allocating(tmp_path):
    path = tmp_path / "huge.ckpt"
    path.write_bytes(container.MAGIC + struct.pack("<QQQQQQ", 1, 2**64 - 1, 0, 0, 0, 0) + bytes(16))
    with pytest.raises(TruncatedFile) as e:
        load(path)
    assert str(e.value) == (
        f"{path}: offset 16 (0x10): model_len: model section of 18446744073709551615 bytes at offset 56 runs "
        "past the end of the file (expected <= 0, got 18446744073709551615); the file is incomplete or a length "
        "field is damaged; resume from an earlier checkpoint (R-003)"
    )


def test_an_unknown_version_is_refused_with_its_number(tmp_path):
    path, raw = _small(tmp_path)
    path.write_bytes(_resealed(raw[:5] + struct.pack("<H", 3) + raw[7:], raw))  # as a newer writer would sign it
    with pytest.raises(UnsupportedVersion) as e:
        load(path)
    assert str(e.value) == (
        f"{path}: offset 5 (0x5): magic: container version 3 is not supported "
        "(expected version 2 (or a legacy v1 file), got 3); a newer ckptkit wrote it; upgrade ckptkit (R-002)"
    )


def test_a_flipped_version_bit_under_a_failing_digest_is_damage_not_a_newer_version(tmp_path):
    path, raw = _small(tmp_path)
    path.write_bytes(raw[:5] + struct.pack("<H", 3) + raw[7:])
    with pytest.raises(
        ChecksumMismatch,
        match=r": offset 5 \(0x5\): magic: header damaged: the version field reads 3, "
        r"but the file is laid out as a v2 container and its skeleton digest \(which covers the version\) "
        r"does not match \(expected 0x[0-9a-f]{16}, got 0x[0-9a-f]{16}\); the file is damaged; resume "
        r"from an earlier checkpoint \(R-005\)$",
    ):
        load(path)


def _with_flags(raw: bytes, flags: int) -> bytes:
    """Set the flags field and re-seal the skeleton digest, as a future writer would."""
    out = bytearray(raw)
    out[40:48] = struct.pack("<Q", flags)
    return _resealed(bytes(out), raw)


def _resealed(data: bytes, source: bytes) -> bytes:
    """``data`` with its skeleton digest recomputed over ``source``'s skeleton extents."""
    out = bytearray(data)
    with container.Source(data=source) as src:
        layout = container.read_layout(src)
        h = xxhash.xxh3_64()
        for a, b in container.skeleton_extents(layout):
            h.update(bytes(out[a:b]))
    assert layout.trailer_offset is not None
    out[layout.trailer_offset : layout.trailer_offset + 8] = struct.pack("<Q", h.intdigest())
    return bytes(out)


def test_load_refuses_unknown_flag_bit_naming_it(tmp_path):
    path, raw = _small(tmp_path)
    path.write_bytes(_with_flags(raw, 1 << 5 | 1))
    with pytest.raises(ReservedBitSet) as e:
        load(path)
    assert str(e.value) == (
        f"{path}: offset 40 (0x28): flags: reserved bit 5 set (expected 0, got 0x20); "
        "a newer ckptkit wrote state this reader cannot restore; upgrade ckptkit (R-006)"
    )


def test_the_fp32_fallback_latch_round_trips_as_flag_bit_0(tmp_path):
    path, _ = _small(tmp_path, flags=FLAG_FP32_FALLBACK)
    ck = load(path)
    assert ck.fp32_fallback and ck.flags == 1
    assert verify(path).flags == ("fp32_fallback",)


def test_absent_teacher_and_monitor_load_as_none_and_say_so(tmp_path):
    save(tmp_path / "a.ckpt", Checkpoint(step=1, model={"w": torch.zeros(2)}))
    ck = load(tmp_path / "a.ckpt")
    assert ck.teacher is None and ck.monitor is None and ck.optim is None
    assert ck.absent == ("optim", "teacher", "monitor")


def _v1_bytes(step: int, model, optim) -> bytes:
    plans = []
    start = 24
    for tree in (model, optim):
        t, tens, _keep = encode_tree(tree, "x")
        plan = plan_section(t, tens, start=start, legacy=True)
        plans.append(plan)
        start += plan.length
    return container._encode_v1(step, *plans)


def test_a_v1_file_loads_as_legacy_and_names_what_it_lacks(tmp_path):
    path = tmp_path / "old.ckpt"
    path.write_bytes(_v1_bytes(42, {"w": torch.arange(3.0)}, {"lr": 0.1}))
    ck = load(path)
    assert ck.legacy and ck.version == 1 and ck.step == 42
    assert ck.missing == ("teacher", "flags", "monitor", "integrity")
    assert torch.equal(ck.model["w"], torch.arange(3.0)) and ck.optim == {"lr": 0.1}
    r = verify(path)
    assert r.ok and r.legacy and r.missing == ck.missing


def test_a_v1_file_whose_lengths_do_not_add_up_is_refused(tmp_path):
    path = tmp_path / "old.ckpt"
    path.write_bytes(_v1_bytes(42, {"w": torch.arange(3.0)}, {"lr": 0.1})[:-1])
    with pytest.raises(BadMagic, match="not a legacy v1 container either"):
        load(path)


def test_a_pickle_is_never_unpickled_and_gets_a_hint(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(BadMagic) as e:
        load(path)
    assert "ckptkit never unpickles" in str(e.value)


def test_unsupported_values_are_refused_by_path_and_nothing_is_written(tmp_path):
    path = tmp_path / "x.ckpt"
    with pytest.raises(UnsupportedValue) as e:
        save(path, Checkpoint(step=0, model={"layers": [{"act": torch.nn.GELU()}]}))
    assert str(e.value).startswith("model['layers'][0]['act']: a torch.nn.modules.activation.GELU cannot be stored")
    with pytest.raises(UnsupportedValue, match=r"model\['big'\]: integer 18446744073709551616 does not fit"):
        save(path, Checkpoint(step=0, model={"big": 2**64}))
    with pytest.raises(UnsupportedValue, match=r"model: map key \(1, 2\) is a tuple"):
        save(path, Checkpoint(step=0, model={(1, 2): 3}))
    assert os.listdir(tmp_path) == []


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path, before = _small(tmp_path)
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd, buf):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, buf)

    monkeypatch.setattr(container.os, "write", failing_write)
    with pytest.raises(SaveFailed) as e:
        save(path, Checkpoint(step=8, model={"w": torch.ones(1000)}))
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC
    assert str(e.value) == f"{path}: write failed (ENOSPC: No space left on device); the previous file is intact"
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["small.ckpt"]


def test_map_location_places_tensors(tmp_path):
    path, _ = _small(tmp_path)
    ck = load(path, map_location="meta")
    assert ck.model["w"].device.type == "meta"


def test_importing_the_format_core_does_not_import_torch():
    code = (
        "import sys, ckptkit, ckptkit.format._container, ckptkit.format._sidecar, ckptkit.format._snapshot, "
        "ckptkit.format._atomic, "
        "ckptkit.cli, ckptkit.cli._verify, ckptkit.cli._inspect_cmd; assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
