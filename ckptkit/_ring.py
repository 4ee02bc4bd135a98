"""The spike guard's memory: private copies of the state before each of the last K+1 steps.

A kept state is :meth:`RunState.checkpoint` with every tensor cloned, plus the
registered sidecars, cloned. It shares no memory with the run (an optimizer keeps
the tensors ``load_state_dict`` is given, so a restore always loads a fresh clone),
and its per-part digests, taken on first use, let every restore be checked
(spec/rollback.md R-R02, R-R03). torch is imported lazily: ``import ckptkit`` stays
torch-free.
"""

from __future__ import annotations

import copy
import dataclasses
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .checkpoint import Checkpoint
from .container import SECTIONS
from .section import sort_key

__all__ = ["Kept", "Ring", "clone", "digests", "local", "localized", "tensors", "tree_digest"]

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
        return {k: _map(v, leaf) for k, v in tree.items()}
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

    from .codec import dtype_name, tensor_bytes

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
    else:  # RunState.checkpoint only holds the above (add_* probes refuse the rest)
        raise TypeError(f"{path}: cannot digest a {type(value).__name__}")


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


@dataclass
class Kept:
    """One state before step ``step``, as the ring keeps it (a private copy).

    Attributes:
        step: the steps done (the state before step ``step`` runs).
        ckpt: :meth:`RunState.checkpoint` at ``step``, every tensor cloned.
        sidecars: ``kind -> (table_step, tree)``, cloned.
        leave_out: digest parts never compared for this state (see :func:`digests`).
    """

    step: int
    ckpt: Checkpoint
    sidecars: dict[str, tuple[int, Any]]
    leave_out: frozenset[str] = frozenset()
    _digests: dict[str, int] | None = field(default=None, repr=False, compare=False)

    @property
    def digests(self) -> dict[str, int]:
        """Part name -> digest, computed on first use: the copy is private and never
        written, so its digest is the kept state's whenever it is taken, and a state
        that is never restored is never hashed."""
        if self._digests is None:
            self._digests = digests(self.ckpt, self.sidecars, leave_out=self.leave_out)
        return self._digests

    @property
    def nbytes(self) -> int:
        """Tensor bytes held (what the ring costs in memory)."""
        trees = (self.ckpt.model, self.ckpt.optim, self.ckpt.teacher, list(self.sidecars.values()))
        return sum(local(t).numel() * t.element_size() for t in tensors(trees))


class Ring:
    """The states before the last ``k + 1`` steps, by step (spec/rollback.md R-R02).

    Keeping step ``s`` drops every state after ``s`` (after a rollback they belong
    to the abandoned timeline) and every state before ``s - k``.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self._by_step: dict[int, Kept] = {}

    def put(self, kept: Kept) -> None:
        s = kept.step
        self._by_step = {t: v for t, v in self._by_step.items() if s - self.k <= t < s}
        self._by_step[s] = kept

    def get(self, step: int) -> Kept | None:
        return self._by_step.get(step)

    def steps(self) -> list[int]:
        return sorted(self._by_step)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._by_step.values())
