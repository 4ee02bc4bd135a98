"""Torch state trees <-> section trees: the dtype table and zero-copy tensor bytes.

The only module of the format core that imports torch. A state tree (a module's
``state_dict()``, an optimizer's nested ``state_dict()``, plain monitor values) is
turned into a plain tree whose tensors are :class:`~ckptkit.section.TensorRef`
entries plus one contiguous byte buffer per distinct tensor; decoding does the
reverse. Implements ``spec/container.md`` ("Tensor codec").

Invariants:
    * No pickle, ever: a tree holds None, bool, int, float, str, bytes, lists,
      tuples, dicts (str/int keys) and tensors; anything else is refused by name.
    * Two names for one tensor (same object, or the same storage, offset, shape and
      strides) are stored once and load as one tensor object.
    * Tensor bytes are handed to the writer as views: no copy unless the tensor is
      not contiguous, not on the CPU, or needs a dtype-preserving detach.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from .container import Source, decoded_region, tensor_mismatch
from .errors import UnsupportedValue
from .section import CODECS, DTYPE_SIZES, SectionIndex, SectionPlan, TensorRef, check_plain, plan_section

__all__ = ["decode_tree", "dtype_name", "encode_tree", "load_section", "plan_trees", "tensor_bytes", "torch_dtype"]

_CHUNK = 1 << 20

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPE_SIZES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _TORCH_DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - no such host in CI
    raise ImportError("ckptkit stores tensors little-endian and runs on little-endian hosts only")


def dtype_name(dtype: torch.dtype, where: str = "tensor") -> str:
    """The on-disk name of a torch dtype.

    Raises:
        UnsupportedValue: the dtype has no entry in the dtype table.
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise UnsupportedValue(
            f"{where}: dtype {dtype} is not in the dtype table ({', '.join(sorted(_TORCH_DTYPES))})"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for an on-disk dtype name (names come from a validated index)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise UnsupportedValue(f"dtype {name} is not available in torch {torch.__version__}") from None


def tensor_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A contiguous CPU tensor with the same values, and a byte view of its memory.

    The tensor is returned so the caller keeps the memory alive while writing.
    """
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()  # each a no-op when already so
    if t.numel() == 0:
        return t, memoryview(b"")
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def encode_tree(tree: Any, where: str) -> tuple[Any, list[tuple[str, tuple[int, ...], memoryview]], list[torch.Tensor]]:
    """Canonicalise ``tree`` and pull out its tensors.

    Args:
        tree: the state to store.
        where: how to name the tree's root in error messages (``"model"``).

    Returns:
        ``(plain_tree, tensors, keep_alive)``: the tree with :class:`TensorRef` in
        place of tensors, ``(dtype, shape, bytes)`` per distinct tensor in
        first-reference order, and the tensors backing those bytes.

    Raises:
        UnsupportedValue: a value or dtype the container cannot carry, named by path.
    """
    ids: dict[Any, int] = {}
    tensors: list[tuple[str, tuple[int, ...], memoryview]] = []
    keep: list[torch.Tensor] = []

    def leaf(value: Any, at: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return NotImplemented
        if value.layout != torch.strided:
            raise UnsupportedValue(f"{at}: {value.layout} tensors cannot be stored; convert with .to_dense()")
        if value.is_quantized:
            raise UnsupportedValue(f"{at}: quantized tensors cannot be stored; store int_repr() and the scales")
        key = _storage_key(value) if value.numel() else ("empty", id(value))
        tid = ids.get(key)
        if tid is None:
            name = dtype_name(value.dtype, at)
            held, buf = tensor_bytes(value)
            tid = ids[key] = len(tensors)
            tensors.append((name, tuple(value.shape), buf))
            keep.append(held)
        return TensorRef(tid)

    plain = check_plain(tree, where, on_leaf=leaf)
    return plain, tensors, keep


def decode_tree(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every :class:`TensorRef` in ``tree`` by its tensor (shared refs share)."""
    if isinstance(tree, TensorRef):
        return tensors[tree.id]
    if isinstance(tree, tuple):
        return tuple(decode_tree(v, tensors) for v in tree)
    if isinstance(tree, list):
        return [decode_tree(v, tensors) for v in tree]
    if isinstance(tree, dict):
        return {k: decode_tree(v, tensors) for k, v in tree.items()}
    return tree


def empty_like_record(dtype: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, memoryview]:
    """A fresh CPU tensor for a record, and a writable byte view of it."""
    t = torch.empty(shape, dtype=torch_dtype(dtype))
    if t.numel() == 0:
        return t, memoryview(bytearray(0))
    return t, memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _compressor(level: int) -> Any:
    import zstandard

    return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True).compress


def plan_trees(
    trees: Mapping[str, Any], *, start: int, compression: str | Mapping[str, str] = "raw", level: int = 3
) -> tuple[list[SectionPlan | None], list[Any]]:
    """Encode and lay out sections that follow each other from offset ``start``.

    Args:
        trees: section name -> state tree (None = absent), in on-disk order.
        start: absolute offset of the first section (the header size).
        compression: one codec for every section, or ``{section: codec}``.
        level: zstd level.

    Returns:
        ``(plans, keep_alive)``; keep ``keep_alive`` referenced until written.

    Raises:
        UnsupportedValue: a value the container cannot carry, named by path.
        ValueError: an unknown section name or codec in ``compression``.
    """
    codecs = dict.fromkeys(trees, compression) if isinstance(compression, str) else dict(compression)
    for name, codec in codecs.items():
        if name not in trees:
            raise ValueError(f"compression names an unknown section {name!r} (sections: {', '.join(trees)})")
        if codec not in CODECS:
            raise ValueError(f"compression for {name} must be one of {', '.join(CODECS)} (got {codec!r})")
    plans: list[SectionPlan | None] = []
    keep: list[Any] = []
    for name, value in trees.items():
        if value is None:
            plans.append(None)
            continue
        tree, tensors, held = encode_tree(value, name)
        codec = codecs.get(name, "raw")
        plan = plan_section(tree, tensors, start=start, codec=codec,
                            compress=_compressor(level) if codec != "raw" else None)
        plans.append(plan)
        keep.append(held)
        start += plan.length
    return plans, keep


def load_section(src: Source, sec: SectionIndex | None, map_location: Any = "cpu") -> Any:
    """Read one section's tree with its tensors, checking each digest as it is read.

    Raises:
        ChecksumMismatch: a tensor's bytes do not match its digest (R-007).
        MalformedIndex: a compressed region that does not decode (R-008).
    """
    if sec is None:
        return None
    tensors = []
    region = decoded_region(src, sec) if sec.codec != "raw" else None
    for i, rec in enumerate(sec.tensors):
        t, view = empty_like_record(rec.dtype, rec.shape)
        h = xxhash.xxh3_64()
        if region is not None:
            view[:] = region[rec.offset : rec.offset + rec.nbytes]
            h.update(view)
        else:
            base = sec.data_start + rec.offset
            for a in range(0, rec.nbytes, _CHUNK):
                piece = view[a : a + _CHUNK]
                src.readinto(base + a, piece)
                h.update(piece)
        if rec.digest is not None and h.intdigest() != rec.digest:
            raise tensor_mismatch(src.path, sec, i, h.intdigest())
        if str(map_location) != "cpu":
            t = t.to(map_location)
        tensors.append(t)
    return decode_tree(sec.tree, tensors)
