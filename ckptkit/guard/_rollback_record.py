"""The spike guard's record: what rollbacks did to a run, saved as run state.

A :class:`RollbackRecord` is a frozen value; the guard replaces it at every
transient spike and rollback and registers it with its RunState
(``add_value("rollback")``, mode ``on``), so it is in every checkpoint's monitor
section at ``values.rollback`` and a resume restores it. A rollback never rewinds
it: it is the record of the whole run, abandoned timelines included
(spec/rollback.md R-R08). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import MalformedIndex, UnsupportedVersion
from ..format._checks import is_int

__all__ = ["RECORD_VERSION", "VALUE_NAME", "RollbackEvent", "RollbackRecord", "skipped_batches"]

RECORD_VERSION = 2  # 2: the testing aid's arrival count moved out of the record (spec/rollback.md, Versions)
VALUE_NAME = "rollback"  # the record's add_value name: monitor section values.rollback


@dataclass(frozen=True)
class RollbackEvent:
    """One rollback (R-R08).

    Attributes:
        step: the spiking step N.
        to: the step T the state went back to.
        reason / grad_norm / median / ratio: the re-run's verdict.
        lr_before / lr_after: the LR of step T before and after the drop.
        lr_scale: the run's LR scale after the drop.
        skipped: ``{"start", "end", "batches"}``: the data positions skipped, or None.
    """

    step: int
    to: int
    reason: str
    grad_norm: float
    median: float | None
    ratio: float | None
    lr_before: float
    lr_after: float
    lr_scale: float
    skipped: dict[str, int] | None

    def row(self) -> dict[str, Any]:
        """The PRD's ``rollbacks`` entry: ``{step, to, reason, lr_after}``."""
        return {"step": self.step, "to": self.to, "reason": self.reason, "lr_after": self.lr_after}


_EVENT_KEYS = frozenset(f for f in RollbackEvent.__dataclass_fields__)


@dataclass(frozen=True)
class RollbackRecord:
    """The rollback record of a run (R-R08); the defaults are a run that never rolled back.

    Attributes:
        lr_scale: product of ``lr_drop`` over every rollback; multiplies the LR.
        count: rollbacks so far: the timeline index of the rows written now (R-R10).
        skipped_batches: steps whose data a rollback skipped (the offset rule's term, R-R05).
        consecutive: confirmed spikes in the current chain (R-R07).
        horizon: the chain ends once the run applies the update of this step.
        transient: spikes whose re-run was normal (R-R04).
        rollbacks: one event per rollback, oldest first.
    """

    lr_scale: float = 1.0
    count: int = 0
    skipped_batches: int = 0
    consecutive: int = 0
    horizon: int | None = None
    transient: int = 0
    rollbacks: tuple[RollbackEvent, ...] = field(default=())

    def state(self) -> dict[str, Any]:
        """Plain values for ``RunState.add_value`` (the layout of spec/rollback.md R-R08)."""
        out = asdict(self)
        out["rollbacks"] = [asdict(e) for e in self.rollbacks]
        out["version"] = RECORD_VERSION
        return out

    @classmethod
    def from_state(cls, state: Any, where: str = "values.rollback") -> RollbackRecord:
        """Validate a stored record, whole, before anything uses it.

        Raises:
            UnsupportedVersion: an unknown ``version``.
            MalformedIndex: a missing or unknown key, a wrong type, a negative count,
                an ``lr_scale`` outside (0, 1], a malformed event.
        """
        if not isinstance(state, Mapping):
            raise MalformedIndex(f"must be a dict (got {type(state).__name__})", field=where)
        version = state.get("version")
        if not is_int(version, least=None):
            raise MalformedIndex(f"version must be an int (got {type(version).__name__})", field=f"{where}.version")
        if version != RECORD_VERSION:
            raise UnsupportedVersion(
                "rollback record version not supported",
                field=f"{where}.version",
                expected=RECORD_VERSION,
                actual=version,
                hint="resume this run with the ckptkit version that wrote it",
            )
        keys = set(_TYPES) | {"version"}
        missing, unknown = sorted(keys - set(state)), sorted(map(str, set(state) - keys))
        if missing or unknown:
            raise MalformedIndex(
                f"{'missing' if missing else 'unknown'} key(s) {', '.join(missing or unknown)}", field=where
            )
        for key, types in _TYPES.items():
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, types):
                raise MalformedIndex(
                    f"must be {' or '.join(t.__name__ for t in types)} (got {value!r})", field=f"{where}.{key}"
                )
            if isinstance(value, int) and value < 0:
                raise MalformedIndex(f"must be >= 0 (got {value})", field=f"{where}.{key}")
        if not (math.isfinite(state["lr_scale"]) and 0.0 < state["lr_scale"] <= 1.0):
            raise MalformedIndex(f"must be finite, > 0 and <= 1 (got {state['lr_scale']!r})", field=f"{where}.lr_scale")
        events = []
        for i, event in enumerate(state["rollbacks"]):
            if not isinstance(event, Mapping) or set(event) != _EVENT_KEYS:
                raise MalformedIndex(
                    f"must be a dict with keys {', '.join(sorted(_EVENT_KEYS))}", field=f"{where}.rollbacks[{i}]"
                )
            events.append(RollbackEvent(**{k: event[k] for k in _EVENT_KEYS}))
        return cls(**{k: state[k] for k in _TYPES if k != "rollbacks"}, rollbacks=tuple(events))


_TYPES: dict[str, tuple[type, ...]] = {
    "lr_scale": (float,),
    "count": (int,),
    "skipped_batches": (int,),
    "consecutive": (int,),
    "horizon": (int, type(None)),
    "transient": (int,),
    "rollbacks": (list,),
}


def skipped_batches(values: Mapping[str, Any]) -> int:
    """The skipped-batch count stored with a checkpoint (0 without a rollback record).

    For a data position's ``expected`` rule (:meth:`RunState.add_data_position`),
    which is given the checkpoint's stored values: after a skip the position is
    no longer a function of the step alone, and this count makes the rule exact::

        state.add_data_position("train", get=..., set=...,
                                expected=lambda step, values: (step + skipped_batches(values)) * batch)

    Raises:
        MalformedIndex / UnsupportedVersion: the stored record is malformed.
    """
    if VALUE_NAME not in values:
        return 0
    return RollbackRecord.from_state(values[VALUE_NAME]).skipped_batches
