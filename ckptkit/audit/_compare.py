"""Comparing two states tensor by tensor, exactly.

``ckptkit diff --tensors`` and ``ckptkit replay`` both answer "which tensors
differ, and by how much?" with this module, so they always agree. Equality is
bitwise (NaN payloads and -0.0 included); for differing tensors the report gives
the number of differing elements and the largest absolute difference.

Names are ``<section>:<dotted path>``, e.g. ``model:model.blocks.0.attn.weight`` or
``optim:optimizers.adamw.state.3.exp_avg`` (see :func:`~ckptkit.format._tree.flatten`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..format._tree import checkpoint_state

__all__ = ["TensorDiff", "compare_checkpoints", "compare_states"]

_KINDS = ("changed", "only_old", "only_new")


@dataclass(frozen=True, kw_only=True)
class TensorDiff:
    """One difference between two states.

    Attributes:
        name: ``<section>:<dotted path>``.
        kind: ``changed``, ``only_old`` (in the first state only) or ``only_new``.
        n_diff: differing elements (``changed`` tensors of equal shape and dtype).
        numel: elements in the tensor.
        max_abs_diff: largest ``|a - b|`` over elements, as float64 (``nan`` if a
            NaN is involved, ``None`` if not comparable).
        detail: a short human description (dtype/shape change, value change...).
    """

    name: str
    kind: str
    detail: str
    n_diff: int = 0
    numel: int = 0
    max_abs_diff: float | None = None


def _int_view(t: Any) -> Any:
    import torch

    size = t.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}[size]
    flat = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return flat.view(torch.uint8)
    if size == 16:  # complex128: two int64 per element
        return flat.view(torch.int64).reshape(-1, 2)
    return flat.view(as_int)


def _tensor_diff(name: str, a: Any, b: Any) -> TensorDiff | None:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return TensorDiff(
            name=name, kind="changed", detail=f"{a.dtype}{list(a.shape)} -> {b.dtype}{list(b.shape)}", numel=a.numel()
        )
    if a.numel() == 0:
        return None
    ia, ib = _int_view(a), _int_view(b)
    neq = ia != ib
    if neq.dim() > 1:
        neq = neq.any(dim=-1)
    n = int(neq.sum())
    if n == 0:
        return None
    # Over the differing elements only: a NaN that is bitwise equal on both sides is no difference.
    fa, fb = a.detach().cpu().reshape(-1)[neq], b.detach().cpu().reshape(-1)[neq]
    if a.dtype == torch.bool:
        mad = 1.0
    elif a.is_complex():
        mad = float((fa.to(torch.complex128) - fb.to(torch.complex128)).abs().max())
    else:
        mad = float((fa.double() - fb.double()).abs().max())
    return TensorDiff(
        name=name,
        kind="changed",
        detail=f"{n}/{a.numel()} elements differ, max |diff| {mad:.6g}",
        n_diff=n,
        numel=a.numel(),
        max_abs_diff=mad,
    )


def _same_value(a: Any, b: Any) -> bool:
    """Same type and value; floats NaN-equal; numpy arrays by dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if type(a).__module__ == "numpy" and hasattr(a, "tobytes"):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    return bool(a == b)


def compare_states(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[TensorDiff]:
    """Differences between two flattened states (see :func:`~ckptkit.format._tree.flatten`), sorted by name.

    Tensors are compared bitwise; other leaves by type and value.
    """
    import torch

    out = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            out.append(TensorDiff(name=name, kind="only_old", detail="only in the first"))
        elif name not in old:
            out.append(TensorDiff(name=name, kind="only_new", detail="only in the second"))
        else:
            a, b = old[name], new[name]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                d = _tensor_diff(name, a, b)
                if d is not None:
                    out.append(d)
            elif not _same_value(a, b):
                out.append(TensorDiff(name=name, kind="changed", detail=f"{a!r} -> {b!r}"))
    return out


def compare_checkpoints(path_a: str | os.PathLike[str], path_b: str | os.PathLike[str]) -> list[TensorDiff]:
    """Load two checkpoints (verifying them) and compare every tensor and value.

    Returns:
        The differences, sorted by name; empty when the states are bitwise equal.

    Raises:
        CheckpointNotFound, FormatError: a file is missing or invalid.
    """
    from ..format._checkpoint import load

    return compare_states(checkpoint_state(load(path_a)), checkpoint_state(load(path_b)))
