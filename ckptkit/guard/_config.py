"""The spike guard's knobs as one frozen value, checked whole when it is made.

:class:`~ckptkit.guard.SpikeGuard` takes them one by one (its documented
call) or as a :class:`RollbackConfig`; either way they are validated here, with
messages that name the knob as the user spells it (spec/rollback.md R-R01..R-R07).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..format._checks import check_int

__all__ = ["MODES", "RollbackConfig"]

MODES = ("off", "warn", "on")


@dataclass(frozen=True)
class RollbackConfig:
    """What the guard does with a spike.

    Attributes:
        mode: ``"off"`` (statistics only), ``"warn"`` (a ``spike`` row, the update is
            kept; the default) or ``"on"`` (re-run once, then roll back). An enum whose
            values are these names is accepted and stored as its value.
        k: roll back to K steps before the spike (int >= 0, default 10).
        lr_drop: multiply the LR by this at every rollback (float in (0, 1], default 0.5).
        skip_data: skip the data the steps N-K..N read (needs a registered data
            position); ``False`` replays the same data.
        data: the data position to skip (default: the only one registered).
        bound: the ``bound``-th consecutive spike stops the run (int >= 1, default 3).
        cap: a spike that would need rollback number ``cap + 1`` stops the run
            (int >= 0, default 10).

    Raises:
        ValueError: a knob out of its range, named as above.
    """

    mode: str = "warn"
    k: int = 10
    lr_drop: float = 0.5
    skip_data: bool = True
    data: str | None = None
    bound: int = 3
    cap: int = 10

    def __post_init__(self) -> None:
        mode: Any = getattr(self.mode, "value", self.mode)  # an enum whose values are the mode names
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
        object.__setattr__(self, "mode", mode)
        for name, value, least in (("k", self.k, 0), ("bound", self.bound, 1), ("cap", self.cap, 0)):
            check_int(name, value, least)
        lr_drop = self.lr_drop
        if not (isinstance(lr_drop, float) and math.isfinite(lr_drop) and 0.0 < lr_drop <= 1.0):
            raise ValueError(f"lr_drop must be a float, finite, > 0 and <= 1 (got {lr_drop!r})")

    @property
    def on(self) -> bool:
        """Rollback is armed (mode ``"on"``)."""
        return self.mode == "on"
