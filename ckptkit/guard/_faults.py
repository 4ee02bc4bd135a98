"""Fault injection for the spike guard: a spike made on purpose, to see a rollback happen.

:class:`GradSpike` is a testing aid, not training code: the reference trainer's
``--spike-at`` and the examples use it to show a rollback; ``ckptkit.testing``
re-exports it for other trainers' CI. torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..format._checks import check_int, is_int

__all__ = ["GradSpike"]


class GradSpike:
    """TESTING AID: multiply every gradient of ``modules`` by ``factor`` on the first
    ``repeat`` executions of step ``at``, as a data x state spike would.

    Given to :class:`ckptkit.SpikeGuard` (``inject=``), which arms it around the
    step function: the step itself carries no testing code. The gradient is
    multiplied in a tensor hook during ``backward()``, so the grad norm the step
    returns is the spiked one. The arrival count is run state (the guard registers
    it as ``values.spike_injection``), so a resumed run fires exactly as the
    uninterrupted one. ``repeat=2`` (the default) is the execution and its re-run:
    a confirmed spike, one rollback; ``repeat=1`` is a transient fault; a large
    ``repeat`` makes every arrival spike (the "unstable" scenario).

    Args:
        modules: the modules whose parameters' gradients are multiplied.
        at: the step (0-based).
        repeat: how many arrivals at ``at`` spike, >= 1.
        factor: the multiplier (default 10, the PRD's synthetic spike).
    """

    def __init__(self, modules: Sequence[Any], *, at: int, repeat: int = 2, factor: float = 10.0) -> None:
        check_int("at", at)
        check_int("repeat", repeat, least=1)
        self.modules, self.at, self.repeat, self.factor = list(modules), at, repeat, factor
        self.arrivals = 0
        self._handles: list[Any] = []

    def arm(self, step: int) -> None:
        """Called before step ``step`` runs: hooks the gradients when this arrival spikes."""
        if step != self.at:
            return
        self.arrivals += 1
        if self.arrivals <= self.repeat:
            factor = self.factor
            self._handles = [
                p.register_hook(lambda g: g * factor) for m in self.modules for p in m.parameters() if p.requires_grad
            ]

    def disarm(self) -> None:
        """Called after the step: the hooks go."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def state(self) -> int:
        return self.arrivals

    def load(self, arrivals: Any) -> None:
        """Restore the arrival count (``values.spike_injection``).

        Raises:
            MalformedIndex: the stored count is not an int >= 0.
        """
        if not is_int(arrivals):
            from ..errors import MalformedIndex

            raise MalformedIndex(f"must be an int >= 0 (got {arrivals!r})", field="values.spike_injection")
        self.arrivals = arrivals
