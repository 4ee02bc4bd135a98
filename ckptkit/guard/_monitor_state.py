"""The spike monitor's stored state, validated whole before any of it is used (R-M09..R-M12).

Private: :mod:`ckptkit.guard._monitor` reads a ``state_dict`` through these frozen
dataclasses. Each part checks its keys and types in ``from_dict`` and its
invariants in ``__post_init__``, so a monitor never holds a half-loaded state.
A malformed state raises :class:`~ckptkit.errors.MalformedIndex` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ..errors import MalformedIndex
from ..format._checks import is_int

__all__ = ["SPIKE_REASONS", "DetectorState", "ReportState", "exact_keys", "typed"]

#: The verdict reasons that are spikes (the last three of ``monitor.REASONS``).
SPIKE_REASONS = ("grad_norm", "non_finite_grad_norm", "non_finite_loss")
_REPORT_KEYS = frozenset(
    {
        "observed",
        "spikes",
        "recent_spikes",
        "refused",
        "refused_count",
        "finite_count",
        "non_finite_count",
        "sum",
        "min",
        "max",
        "recent",
    }
)
_SPIKE_RECORD_KEYS = frozenset({"step", "reason", "grad_norm", "loss", "median"})


@dataclasses.dataclass(frozen=True)
class DetectorState:
    """The detector's part: the window in arrival order and the last observed step."""

    window: tuple[float, ...]
    last_step: int | None

    def __post_init__(self) -> None:
        for x in self.window:
            if not (math.isfinite(x) and x >= 0.0):
                raise MalformedIndex(
                    f"window holds {x!r}; window values must be finite and >= 0", field="monitor.detector.window"
                )
        if self.window and self.last_step is None:
            raise MalformedIndex("window is not empty but last_step is None", field="monitor.detector")

    @classmethod
    def from_dict(cls, det: Mapping[str, Any], *, window: int) -> DetectorState:
        exact_keys(det, {"window", "last_step"}, "monitor.detector")
        values = _float_list(det, "window", "monitor.detector", window)
        return cls(tuple(values), _opt_int(det, "last_step", "monitor.detector"))


@dataclasses.dataclass(frozen=True)
class ReportState:
    """The report's part: counters, bounded lists and running grad-norm statistics."""

    observed: int
    spikes: dict[str, int]
    recent_spikes: tuple[dict[str, Any], ...]
    refused: tuple[int, ...]
    refused_count: int
    finite_count: int
    non_finite_count: int
    sum: float
    min: float | None
    max: float | None
    recent: tuple[float, ...]

    @classmethod
    def from_dict(cls, rep: Mapping[str, Any], *, history: int) -> ReportState:
        where = "monitor.report"
        exact_keys(rep, set(_REPORT_KEYS), where)
        counts = {
            key: _int(rep, key, where) for key in ("observed", "refused_count", "finite_count", "non_finite_count")
        }
        spikes = typed(rep, "spikes", dict, where)
        exact_keys(spikes, set(SPIKE_REASONS), f"{where}.spikes")
        by_reason = {reason: _int(spikes, reason, f"{where}.spikes") for reason in SPIKE_REASONS}
        recent_spikes = _spike_records(typed(rep, "recent_spikes", list, where), history)
        refused = _refused(typed(rep, "refused", list, where), history)
        return cls(
            observed=counts["observed"],
            spikes=by_reason,
            recent_spikes=recent_spikes,
            refused=refused,
            refused_count=counts["refused_count"],
            finite_count=counts["finite_count"],
            non_finite_count=counts["non_finite_count"],
            sum=_float(rep, "sum", where),
            min=_opt_float(rep, "min", where),
            max=_opt_float(rep, "max", where),
            recent=tuple(_float_list(rep, "recent", where, history)),
        )


def _spike_records(records: list[Any], history: int) -> tuple[dict[str, Any], ...]:
    where = "monitor.report"
    _at_most(records, history, "recent_spikes")
    for i, rec in enumerate(records):
        at = f"{where}.recent_spikes[{i}]"
        if not isinstance(rec, Mapping):
            raise MalformedIndex(f"must be a dict (got {type(rec).__name__})", field=at)
        exact_keys(rec, set(_SPIKE_RECORD_KEYS), at)
        _int(rec, "step", at)
        if rec["reason"] not in SPIKE_REASONS:
            raise MalformedIndex(f"reason {rec['reason']!r} is not a spike reason", field=at)
        _float(rec, "grad_norm", at)
        _float(rec, "loss", at)
        _opt_float(rec, "median", at)
    return tuple(dict(rec) for rec in records)


def _refused(steps: list[Any], history: int) -> tuple[int, ...]:
    where = "monitor.report"
    _at_most(steps, history, "refused")
    for i, s in enumerate(steps):
        if not is_int(s):
            raise MalformedIndex(f"must be an int >= 0 (got {s!r})", field=f"{where}.refused[{i}]")
    return tuple(steps)


# ---------------------------------------------------------------------- key and type checks


def _at_most(values: list[Any], history: int, key: str) -> None:
    if len(values) > history:
        raise MalformedIndex(
            f"{key} is longer than history",
            field=f"monitor.report.{key}",
            expected=f"<= {history}",
            actual=len(values),
        )


def exact_keys(d: Mapping[str, Any], keys: set[str], where: str) -> None:
    missing = sorted(keys - set(d))
    unknown = sorted(str(k) for k in set(d) - keys)
    if missing:
        raise MalformedIndex(f"missing key(s) {', '.join(missing)}", field=where)
    if unknown:
        raise MalformedIndex(f"unknown key(s) {', '.join(unknown)}", field=where)


def typed(d: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    """``d[key]``, which must be present and of ``kind`` (any mapping for ``dict``)."""
    if key not in d:
        raise MalformedIndex(f"missing key {key}", field=where)
    value = d[key]
    ok = isinstance(value, Mapping) if kind is dict else isinstance(value, kind)
    if not ok:
        raise MalformedIndex(f"must be a {kind.__name__} (got {type(value).__name__})", field=f"{where}.{key}")
    return value


def _int(d: Mapping[str, Any], key: str, where: str) -> int:
    v = d[key]
    if not is_int(v):
        raise MalformedIndex(f"must be an int >= 0 (got {v!r})", field=f"{where}.{key}")
    return v


def _opt_int(d: Mapping[str, Any], key: str, where: str) -> int | None:
    return None if d[key] is None else _int(d, key, where)


def _float(d: Mapping[str, Any], key: str, where: str) -> float:
    v = d[key]
    if not isinstance(v, float):
        raise MalformedIndex(f"must be a float (got {type(v).__name__})", field=f"{where}.{key}")
    return v


def _opt_float(d: Mapping[str, Any], key: str, where: str) -> float | None:
    return None if d[key] is None else _float(d, key, where)


def _float_list(d: Mapping[str, Any], key: str, where: str, limit: int) -> list[float]:
    values: list[float] = typed(d, key, list, where)  # each checked below
    if len(values) > limit:
        raise MalformedIndex(
            f"{key} holds more values than the config allows",
            field=f"{where}.{key}",
            expected=f"<= {limit}",
            actual=len(values),
        )
    for i, v in enumerate(values):
        if not isinstance(v, float):
            raise MalformedIndex(f"must be a float (got {type(v).__name__})", field=f"{where}.{key}[{i}]")
    return values
