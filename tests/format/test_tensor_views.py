"""Tensor views round-trip through every path: container §5.2, "a non-contiguous tensor is
written as its contiguous copy", for any view torch can make.

A view may have strides that ``is_contiguous()`` ignores (``torch.ones(2)[::2]`` is one
element of stride 2 and reports contiguous); ``save``, ``AsyncSaver.save``,
``load(into=...)`` and the lazy reader must all handle it and raise only ckptkit errors.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptkit import AsyncSaver, Checkpoint, StateMismatch, load, open_checkpoint, save
from ckptkit.format._section import DTYPE_SIZES

DTYPES = sorted(DTYPE_SIZES)


def exact(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    """dtype, shape and the exact element bytes (a fresh dense copy: strides do not matter)."""
    dense = t.detach().clone(memory_format=torch.contiguous_format)
    return t.dtype, tuple(t.shape), dense.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def filled(shape: list[int], dtype_name: str, salt: int) -> torch.Tensor:
    """A dense tensor of distinct-ish values exact in every dtype of the table."""
    n = 1
    for d in shape:
        n *= d
    values = (torch.arange(n, dtype=torch.float64) + salt) % 7 - 3
    dtype = getattr(torch, dtype_name)
    if dtype_name == "bool":
        t = values > 0
    elif dtype_name.startswith("uint"):
        t = (values + 3).to(dtype)
    elif dtype_name.startswith("complex"):
        t = torch.complex(values, -values).to(dtype)
    else:
        t = values.to(dtype)
    return t.reshape(shape)


@st.composite
def views(draw: st.DrawFn) -> tuple[str, list[int], list[tuple[Any, ...]]]:
    """(dtype, base shape, view ops): applied to any base of that shape, the ops give the same view."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    ops: list[tuple[Any, ...]] = []
    ndim = len(shape)
    sizes = list(shape)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["step", "transpose", "expand", "select"]))
        if kind == "step" and ndim:
            d = draw(st.integers(0, ndim - 1))
            start = draw(st.integers(0, sizes[d]))
            step = draw(st.integers(1, 3))
            ops.append(("step", d, start, step))
            sizes[d] = len(range(start, sizes[d], step))
        elif kind == "transpose" and ndim >= 2:
            a, b = draw(st.integers(0, ndim - 1)), draw(st.integers(0, ndim - 1))
            ops.append(("transpose", a, b))
            sizes[a], sizes[b] = sizes[b], sizes[a]
        elif kind == "expand" and ndim < 4:
            d, k = draw(st.integers(0, ndim)), draw(st.integers(0, 3))
            ops.append(("expand", d, k))
            sizes.insert(d, k)
            ndim += 1
        elif kind == "select" and ndim and sizes[0]:
            ops.append(("select", draw(st.integers(0, sizes[0] - 1))))
            sizes.pop(0)
            ndim -= 1
    return dtype, shape, ops


def apply(base: torch.Tensor, ops: list[tuple[Any, ...]]) -> torch.Tensor:
    t = base
    for op in ops:
        if op[0] == "step":
            _, d, start, step = op
            index = [slice(None)] * t.dim()
            index[d] = slice(start, None, step)
            t = t[tuple(index)]
        elif op[0] == "transpose":
            t = t.transpose(op[1], op[2])
        elif op[0] == "expand":
            _, d, k = op
            t = t.unsqueeze(d)
            sizes = list(t.shape)
            sizes[d] = k
            t = t.expand(sizes)
        else:
            t = t[op[1]]
    return t


def _overlaps(t: torch.Tensor) -> bool:
    return t.numel() > 1 and any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride(), strict=True))


@given(views())
def test_every_view_saves_loads_async_saves_loads_into_and_reads_lazily_as_its_dense_copy(
    case: tuple[str, list[int], list[tuple[Any, ...]]],
) -> None:
    dtype, shape, ops = case
    view = apply(filled(shape, dtype, 0), ops)
    want = exact(view)
    with tempfile.TemporaryDirectory() as tmp:
        sync, asynchronous = Path(tmp) / "sync.ckpt", Path(tmp) / "async.ckpt"
        save(sync, Checkpoint(step=1, model={"v": view}))
        assert exact(load(sync).model["v"]) == want
        with AsyncSaver() as saver:
            saver.save(asynchronous, Checkpoint(step=1, model={"v": view}))
        assert asynchronous.read_bytes() == sync.read_bytes()
        with open_checkpoint(sync) as ck:
            assert exact(ck.tensor("model", "v")) == want
        base = filled(shape, dtype, 3)
        dest = apply(base, ops)
        if _overlaps(dest):  # one memory location for several elements cannot hold distinct values
            with pytest.raises(StateMismatch, match=r"model\['v'\]: the destination .* overlaps itself"):
                load(sync, into={"model": {"v": dest}})
            return
        untouched = exact(base)
        got = load(sync, into={"model": {"v": dest}}).model["v"]
        assert got is dest and exact(dest) == want
        if view.numel() == 0:
            assert exact(base) == untouched


def test_a_one_element_view_with_stride_2_saves_and_loads_into_itself(tmp_path: Path) -> None:
    one = torch.ones(2)[::2]
    assert one.is_contiguous() and one.stride() == (2,)  # the torch quirk this guards against
    save(tmp_path / "a.ckpt", Checkpoint(step=1, model={"w": one}))
    with AsyncSaver() as saver:
        saver.save(tmp_path / "b.ckpt", Checkpoint(step=1, model={"w": one}))
    assert (tmp_path / "a.ckpt").read_bytes() == (tmp_path / "b.ckpt").read_bytes()
    base = torch.zeros(3)
    load(tmp_path / "a.ckpt", into={"model": {"w": base[1::2]}})
    assert base.tolist() == [0.0, 1.0, 0.0]
