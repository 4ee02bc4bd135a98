"""One walk over state trees: what every tool that copies, digests or names a state uses.

A state tree is what a :class:`~ckptkit.format.Checkpoint` section holds:
mappings, lists and tuples of tensors and plain values. Here, once: its tensors
(:func:`tensors`), a copy sharing no memory (:func:`clone`), this rank's view of it
(:func:`localized`), its canonical digest (:func:`tree_digest`, :func:`digests`) and
its leaves by name (:func:`flatten`, :func:`checkpoint_state`), named as ``ckptkit
diff --tensors`` names them. The spike guard's ring, the distributed run's replica
check, recording and compare all walk through these, so they agree on what a state
is. torch is imported lazily: ``import ckptkit`` stays torch-free.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import struct
from collections.abc import Mapping
from typing import Any

import xxhash

from ._checkpoint import Checkpoint
from ._container import SECTIONS
from ._section import canonical_bytes, sort_key

__all__ = [
    "Sidecars",
    "checkpoint_state",
    "clone",
    "digests",
    "flatten",
    "local",
    "localized",
    "tensors",
    "tree_digest",
]

Sidecars = Mapping[str, tuple[int, Any]]


def tensors(tree: Any) -> list[Any]:
    """Every tensor in a state tree (mappings, lists, tuples)."""
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []


def local(t: Any) -> Any:
    """This rank's part of a tensor: an FSDP2 shard (DTensor) is its local shard, anything
    else itself. A distributed run's in-memory copies and digests are per rank."""
    import sys

    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def _map(tree: Any, leaf: Any) -> Any:
    """``tree`` rebuilt with ``leaf(t)`` for every tensor (a :class:`Checkpoint` section by
    section); other leaves are shallow copies."""
    import torch

    if isinstance(tree, torch.Tensor):
        return leaf(tree)
    if isinstance(tree, Mapping):
        out = {k: _map(v, leaf) for k, v in tree.items()}  # a state_dict (an OrderedDict) stays one
        return collections.OrderedDict(out) if isinstance(tree, collections.OrderedDict) else out
    if isinstance(tree, list):
        return [_map(v, leaf) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_map(v, leaf) for v in tree)
    if isinstance(tree, Checkpoint):
        sections = {name: _map(getattr(tree, name), leaf) for name in SECTIONS}
        return dataclasses.replace(tree, **sections)
    return copy.copy(tree)


def clone(tree: Any) -> Any:
    """A deep copy sharing no tensor memory (a :class:`Checkpoint` section by section)."""
    return _map(tree, lambda t: t.detach().clone())


def localized(tree: Any) -> Any:
    """``tree`` with every FSDP2 DTensor replaced by this rank's shard (no copy): what
    tools that read plain tensors (digests, comparisons) see of a rank's state."""
    return _map(tree, local)


def _feed(h: Any, value: Any, path: str) -> None:
    """Canonical bytes of a state tree into ``h``: tensors by exact bytes, floats by bits."""
    import torch

    from ._codec import dtype_name, tensor_bytes

    if isinstance(value, torch.Tensor):
        value = local(value)
        _held, raw = tensor_bytes(value)
        h.update(b"T" + dtype_name(value.dtype).encode() + struct.pack(f"<I{value.dim()}Q", value.dim(), *value.shape))
        h.update(raw)
    elif isinstance(value, Mapping):
        h.update(b"D" + struct.pack("<Q", len(value)))
        for k in sorted(value, key=sort_key):
            _feed(h, k, path)
            _feed(h, value[k], f"{path}.{k}")
    elif isinstance(value, (list, tuple)):  # a tuple comes back from msgpack as a list
        h.update(b"L" + struct.pack("<Q", len(value)))
        for i, v in enumerate(value):
            _feed(h, v, f"{path}[{i}]")
    elif value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"B1" if value else b"B0")
    elif isinstance(value, int):
        h.update(b"I" + str(value).encode() + b";")
    elif isinstance(value, float):
        h.update(b"F" + struct.pack("<d", value))
    elif isinstance(value, str):
        text = value.encode("utf-8")
        h.update(b"S" + struct.pack("<Q", len(text)) + text)
    elif isinstance(value, bytes):
        h.update(b"Y" + struct.pack("<Q", len(value)) + value)
    else:  # a typed value (numpy, set, torch dtype...): its canonical bytes; the rest is refused
        typed = canonical_bytes(value, path)
        h.update(b"X" + struct.pack("<Q", len(typed)) + typed)


def tree_digest(tree: Any, where: str) -> int:
    """xxh3-64 of a state tree's canonical bytes (tensors by exact bytes, floats by bits);
    ``where`` names it in the error for a value no state tree holds."""
    h = xxhash.xxh3_64()
    _feed(h, tree, where)
    return h.intdigest()


def digests(ckpt: Checkpoint, sidecars: Sidecars, *, leave_out: frozenset[str] = frozenset()) -> dict[str, int]:
    """Per-part digests of a state: ``model``, ``optim``, ``teacher``, ``flags``,
    ``monitors.<name>`` (the detector), ``monitors.<name>.report``, ``data.<name>``,
    ``values.<name>``, ``sidecars.<kind>``; parts named in ``leave_out`` are skipped
    (what a restore keeps on purpose: the costliest part, the report, is never hashed then)."""
    parts: dict[str, Any] = {"model": ckpt.model, "optim": ckpt.optim, "teacher": ckpt.teacher, "flags": ckpt.flags}
    mon = ckpt.monitor or {}
    for name, state in (mon.get("monitors") or {}).items():
        parts[f"monitors.{name}.report"] = state.get("report")
        parts[f"monitors.{name}"] = {k: v for k, v in state.items() if k != "report"}
    for group in ("data", "values"):
        for name, value in (mon.get(group) or {}).items():
            parts[f"{group}.{name}"] = value
    for kind, contents in sidecars.items():
        parts[f"sidecars.{kind}"] = list(contents)
    return {name: tree_digest(tree, name) for name, tree in parts.items() if name not in leave_out}


def flatten(tree: Any, prefix: str) -> dict[str, Any]:
    """Leaves of a state tree by dotted path (list/tuple items by index).

    Example:
        >>> flatten({"net": {"w": 1, "b": [2, 3]}}, "model")
        {'model:net.w': 1, 'model:net.b.0': 2, 'model:net.b.1': 3}
    """
    out: dict[str, Any] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{path}.{i}" if path else str(i))
        else:
            out[f"{prefix}:{path}"] = v

    if tree is not None:
        walk(tree, "")
    return out


def checkpoint_state(ckpt: Any) -> dict[str, Any]:
    """A loaded :class:`~ckptkit.Checkpoint` flattened: header fields and every section.

    The companion record (``monitor["companions"]``, spec/companions.md) is left out:
    it holds digests of the files beside the checkpoint, not state of the run.
    """
    from ..format._companions import COMPANIONS_KEY

    state: dict[str, Any] = {"header:step": ckpt.step, "header:flags": ckpt.flags}
    for section in SECTIONS:
        tree = getattr(ckpt, section)
        if section == "monitor" and isinstance(tree, dict):
            tree = {k: v for k, v in tree.items() if k != COMPANIONS_KEY}
        state.update(flatten(tree, section))
    return state
