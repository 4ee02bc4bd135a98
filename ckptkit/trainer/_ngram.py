"""The bigram table: byte-pair counts updated outside autograd, used as a logit bias.

Each step the trainer adds the step's ``(input byte, target byte)`` pairs to a
256 x 256 count table under ``torch.no_grad()``, *after* the forward, so a step
never sees its own targets. The next forward adds ``ngram_weight * log p(next |
prev)`` (add-one smoothed) to the logits.

The table is not a parameter and not in the model's ``state_dict``: it is saved
as the ``<ckpt>.ngram`` sidecar, stamped by :mod:`ckptkit.format._sidecar` with the
training step of its checkpoint and refused on resume if the stamp differs
(design record item 7). ``table_step`` is the table's own counter: the number
of updates applied. In this trainer it equals the training step, which the
restore checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import SidecarMismatch

__all__ = ["BigramTable"]

_V = 256


def _local(counts: torch.Tensor) -> torch.Tensor:
    return counts


class BigramTable:
    """Counts of byte pairs ``(prev, next)``; state: ``counts`` and ``table_step``."""

    def __init__(self) -> None:
        self.counts = torch.zeros(_V, _V, dtype=torch.int64)
        self.table_step = 0  # updates applied

    @torch.no_grad()
    def update(
        self, inputs: torch.Tensor, targets: torch.Tensor, total: Callable[[torch.Tensor], torch.Tensor] = _local
    ) -> None:
        """Add every ``(inputs[b, t], targets[b, t])`` pair; one update = one table step.

        ``total`` turns this process's counts into the whole batch's: under torchrun each
        rank sees its rows only, and the counts are summed over the ranks, so every rank
        holds the same table.
        """
        pairs = inputs.reshape(-1) * _V + targets.reshape(-1)
        self.counts += total(torch.bincount(pairs, minlength=_V * _V)).view(_V, _V)
        self.table_step += 1

    @torch.no_grad()
    def logit_bias(self, weight: float) -> torch.Tensor:
        """``weight * log((c + 1) / (row_sum + 256))``: a ``(256, 256)`` float32 table,
        row = the input byte, column = the predicted byte."""
        c = self.counts.to(torch.float32) + 1.0
        return weight * (c.log() - c.sum(dim=1, keepdim=True).log())

    def sidecar(self) -> tuple[int, dict[str, Any]]:
        """``(table_step, tree)`` for :meth:`ckptkit.run.RunState.add_sidecar`."""
        return self.table_step, {"counts": self.counts}

    def load_sidecar(self, table_step: int, tree: Any, *, train_step: int | None = None) -> None:
        """Restore from a sidecar.

        Raises:
            SidecarMismatch: the tree is not this table's shape, or ``table_step``
                is not ``train_step`` (this trainer updates the table every step).
        """
        counts = tree.get("counts") if isinstance(tree, dict) else None
        if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 or tuple(counts.shape) != (_V, _V):
            raise SidecarMismatch("ngram sidecar does not hold a 256 x 256 int64 'counts' table", field="table")
        if train_step is not None and table_step != train_step:
            raise SidecarMismatch(
                "ngram table step differs from the training step (the table is updated once per step)",
                field="table_step",
                expected=train_step,
                actual=table_step,
            )
        self.counts = counts.clone()
        self.table_step = table_step
