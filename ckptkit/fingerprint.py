"""Exact, comparable fingerprints of training state, and the first divergence between runs.

Two runs that should be the same are compared by fingerprints, not by eye:

* :func:`float_bits` — a loss or grad-norm as the hex of its exact bit pattern;
* :func:`tensor_digest` — xxh3-64 over a tensor's name, dtype, shape and exact bytes,
  so a single flipped bit, a reshape or a renamed tensor all change it;
* :func:`state_digest` — an order-independent digest of many named tensors: the
  sum mod 2**64 of their mixed digests (integer arithmetic, never float sums), so
  iteration order never matters but a permutation of contents does;
* :func:`first_divergence` — the first step at which two histories differ, and in
  which field.

Implements ``spec/replay.md``. Usable by any trainer: only ``tensor_digest`` and
``state_digest`` need torch, and they import it lazily.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from .rng import mix64

__all__ = ["Divergence", "FINGERPRINT_FIELDS", "first_divergence", "float_bits", "state_digest", "tensor_digest"]

_MASK64 = (1 << 64) - 1

#: The history fields that must match bit for bit between a run and its replay.
FINGERPRINT_FIELDS = ("loss_bits", "grad_norm_bits", "lr_bits", "params_digest")


def float_bits(x: Any) -> str:
    """The exact bit pattern of a float as hex: float32 for 0-d float32 tensors, else float64.

    Example:
        >>> float_bits(1.0)
        '0x3ff0000000000000'
    """
    if hasattr(x, "dtype") and hasattr(x, "numel"):  # a torch tensor: its own width
        import torch

        t = x.detach().cpu().reshape(-1).contiguous()
        if t.numel() != 1:
            raise ValueError(f"float_bits takes one value (got a tensor of {t.numel()} elements)")
        return "0x" + t.view(torch.uint8).numpy().tobytes()[::-1].hex()
    return "0x" + struct.pack(">d", float(x)).hex()


def tensor_digest(name: str, tensor: Any) -> int:
    """xxh3-64 of ``name``, dtype, shape and the exact bytes of ``tensor``.

    Example:
        >>> import torch
        >>> tensor_digest("w", torch.zeros(2)) != tensor_digest("w", torch.zeros(1, 2))
        True
    """
    from .codec import dtype_name, tensor_bytes

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
    total = 0
    for name, t in items:
        total = (total + mix64(tensor_digest(name, t))) & _MASK64
    return total


@dataclass(frozen=True)
class Divergence:
    """Where two histories part: the first step, and each field that differs there."""

    step: int
    fields: tuple[str, ...]
    expected: Mapping[str, Any]
    actual: Mapping[str, Any]

    def describe(self) -> str:
        parts = [f"{f}: recorded {self.expected.get(f)!r}, replayed {self.actual.get(f)!r}" for f in self.fields]
        return f"step {self.step}: " + "; ".join(parts)


def first_divergence(
    recorded: Sequence[Mapping[str, Any]],
    replayed: Sequence[Mapping[str, Any]],
    fields: Sequence[str] = FINGERPRINT_FIELDS,
) -> Divergence | None:
    """The first step whose fingerprints differ between two histories, or None.

    Rows are matched by their ``step`` key; only steps present in both are compared,
    in ascending order. A field present in one row and absent in the other differs.

    Example:
        >>> first_divergence([{"step": 1, "loss_bits": "0x1"}], [{"step": 1, "loss_bits": "0x2"}], ["loss_bits"])
        Divergence(step=1, fields=('loss_bits',), expected={'step': 1, 'loss_bits': '0x1'}, actual={'step': 1, 'loss_bits': '0x2'})
    """
    by_step = {r["step"]: r for r in replayed}
    for row in sorted(recorded, key=lambda r: r["step"]):
        other = by_step.get(row["step"])
        if other is None:
            continue
        bad = tuple(f for f in fields if (f in row or f in other) and not _same(row.get(f), other.get(f)))
        if bad:
            return Divergence(row["step"], bad, row, other)
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b
