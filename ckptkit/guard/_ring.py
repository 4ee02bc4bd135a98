"""The spike guard's memory: private copies of the state before each of the last K+1 steps.

A kept state is :meth:`RunState.checkpoint` with every tensor cloned, plus the
registered sidecars, cloned. It shares no memory with the run (an optimizer keeps
the tensors ``load_state_dict`` is given, so a restore always loads a fresh clone),
and its per-part digests, taken on first use, let every restore be checked
(spec/rollback.md R-R02, R-R03). torch is imported lazily: ``import ckptkit`` stays
torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..format._checkpoint import Checkpoint
from ..format._tree import digests, local, tensors

__all__ = ["Kept", "Ring"]


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
