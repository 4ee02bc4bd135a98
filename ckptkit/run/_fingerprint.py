"""Exact, comparable fingerprints of training state.

Two runs that should be the same are compared by fingerprints, not by eye:

* :func:`float_bits` — a loss or grad-norm as the hex of its exact bit pattern (the
  history's own, :mod:`ckptkit.run._history`);
* :func:`tensor_digest` — xxh3-64 over a tensor's name, dtype, shape and exact bytes,
  so a single flipped bit, a reshape or a renamed tensor all change it;
* :func:`state_digest` — an order-independent digest of many named tensors: the
  sum mod 2**64 of their mixed digests (integer arithmetic, never float sums), so
  iteration order never matters but a permutation of contents does;
* :func:`leaf_digest` / :func:`leaf_digests` — the same for any leaf of a state tree
  (tensors by their bytes, plain values by a typed canonical encoding), so a whole
  checkpoint can be fingerprinted tensor by tensor, named as :func:`ckptkit.audit._compare.flatten`
  names it;
* :func:`combine` — the order-independent sum behind :func:`state_digest`;
* :func:`step_rows` — a history's step rows, one per step.

Where two recordings part is searched once, by :func:`ckptkit.run._difference.first_row_difference`.

Implements ``spec/replay.md``. Usable by any trainer: only ``tensor_digest`` and
``state_digest`` need torch, and they import it lazily.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import xxhash

from ..errors import UnsupportedValue
from ._history import float_bits
from ._rng import mix64

__all__ = [
    "FINGERPRINT_FIELDS",
    "combine",
    "data_digest",
    "float_bits",
    "leaf_digest",
    "leaf_digests",
    "checkpoint_digests",
    "state_digest",
    "step_rows",
    "tensor_digest",
]

_MASK64 = (1 << 64) - 1

#: The history fields that must match bit for bit between a run and its replay.
FINGERPRINT_FIELDS = ("loss_bits", "grad_norm_bits", "lr_bits", "params_digest")


def tensor_digest(name: str, tensor: Any) -> int:
    """xxh3-64 of ``name``, dtype, shape and the exact bytes of ``tensor``.

    Example:
        >>> import torch
        >>> tensor_digest("w", torch.zeros(2)) != tensor_digest("w", torch.zeros(1, 2))
        True
    """
    from ..format._codec import dtype_name, tensor_bytes

    _held, raw = tensor_bytes(tensor)
    h = xxhash.xxh3_64()
    h.update(name.encode("utf-8") + b"\0" + dtype_name(tensor.dtype).encode() + b"\0")
    h.update(struct.pack(f"<I{tensor.dim()}Q", tensor.dim(), *tensor.shape))
    h.update(raw)
    return h.intdigest()


def state_digest(named: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> int:
    """Order-independent digest of named tensors: ``sum(mix64(tensor_digest)) mod 2**64``.

    ``mix64`` keeps a shared structure in the per-tensor digests from cancelling.
    """
    items = named.items() if isinstance(named, Mapping) else named
    return combine(tensor_digest(name, t) for name, t in items)


def combine(digests: Iterable[int]) -> int:
    """``sum(mix64(d)) mod 2**64``: one digest for many, independent of their order.

    ``state_digest(named) == combine(tensor_digest(n, t) for n, t in named)``, so a
    trainer that keeps per-tensor digests gets the state digest without hashing twice.

    Example:
        >>> combine([1, 2]) == combine([2, 1])
        True
    """
    total = 0
    for d in digests:
        total = (total + mix64(d)) & _MASK64
    return total


def _value_bytes(value: Any, name: str) -> bytes:
    # Type-tagged and exact: True is not 1, 1 is not 1.0, and a float is its bit pattern.
    if value is None:
        return b"none"
    if isinstance(value, bool):
        return b"bool:" + (b"1" if value else b"0")
    if isinstance(value, int):
        return b"int:" + str(value).encode()
    if isinstance(value, float):
        return b"float:" + struct.pack("<d", value)
    if isinstance(value, str):
        return b"str:" + value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return b"bytes:" + bytes(value)
    raise UnsupportedValue(
        f"{name}: cannot fingerprint a {type(value).__name__} (tensors, None, bool, int, "
        "float, str and bytes only; flatten containers first)"
    )


def leaf_digest(name: str, value: Any) -> int:
    """Digest of one leaf of a state tree: :func:`tensor_digest` for a tensor, else an
    xxh3-64 of ``name`` and the value's type-tagged exact encoding.

    Raises:
        UnsupportedValue: a value that is neither a tensor nor a plain scalar.

    Example:
        >>> leaf_digest("lr", 1) != leaf_digest("lr", 1.0) != leaf_digest("lr", True)
        True
    """
    if hasattr(value, "dtype") and hasattr(value, "numel") and hasattr(value, "untyped_storage"):
        return tensor_digest(name, value)
    return xxhash.xxh3_64_intdigest(b"leaf\0" + name.encode("utf-8") + b"\0" + _value_bytes(value, name))


def leaf_digests(named: Mapping[str, Any]) -> dict[str, int]:
    """:func:`leaf_digest` of every entry, keys sorted (e.g. of
    :func:`ckptkit.audit._compare.checkpoint_state`, so names match ``ckptkit diff --tensors``)."""
    return {name: leaf_digest(name, named[name]) for name in sorted(named)}


def data_digest(batch: Any) -> str:
    """What a step consumed, as one digest for its ``step`` row's ``data`` field (spec/determinism.md
    R-D26): a tensor, bytes, a plain value, or a list, tuple or dict of them (a ``DataLoader``
    batch), leaf by leaf in order (dict keys sorted), each by :func:`leaf_digest` under its path.

    Raises:
        UnsupportedValue: a leaf that is neither a tensor nor a plain value.

    Example:
        >>> data_digest([b"ab", 1]) != data_digest([b"ab", 2])
        True
    """
    h = xxhash.xxh3_64()
    for path, leaf in _leaves("data", batch):
        h.update(struct.pack("<Q", leaf_digest(path, leaf)))
    return f"0x{h.intdigest():016x}"


def _leaves(path: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from _leaves(f"{path}.{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(f"{path}.{i}", item)
    else:
        yield path, value


def checkpoint_digests(ckpt: Any) -> dict[str, int]:
    """:func:`leaf_digests` of a :class:`~ckptkit.Checkpoint`'s every leaf, by the names of
    :func:`ckptkit.format._tree.checkpoint_state`: what a ``checkpoint`` or ``digests`` row records."""
    from ..format._tree import checkpoint_state

    return leaf_digests(checkpoint_state(ckpt))


def step_rows(rows: Iterable[Mapping[str, Any]], kind: str = "step") -> list[Mapping[str, Any]]:
    """The rows of ``kind`` (rows without a ``kind`` count as steps) that have an int
    ``step``, one per step: a later row for the same step replaces an earlier one (a
    re-run, or a rollback's new timeline, supersedes what it replaced). Sorted by step."""
    by_step: dict[int, Mapping[str, Any]] = {}
    for r in rows:
        if r.get("kind", "step") == kind and isinstance(r.get("step"), int) and not isinstance(r["step"], bool):
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]
