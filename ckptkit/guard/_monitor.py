"""Spike / stability monitor: a rolling-median grad-norm detector and its report.

Concept: :class:`SpikeMonitor` watches the pre-clip global grad norm (and the
loss) of every step and says whether the step is a spike. A spike is a
non-finite grad norm or loss (always, even while warming up), or a grad norm
above ``multiplier`` times the rolling median of the last ``window`` accepted
grad norms, once ``min_history`` values are in the window and only above
``floor``. A spike never enters the window. Alongside the detector the monitor
keeps the run's stability report: spike counts, recent spikes, refused steps
and grad-norm statistics. The two are separate parts (:class:`_Detector`,
:class:`_Report`) behind the one :class:`SpikeMonitor`; a rollback rewinds the
detector only. The stored form is validated whole by ``_monitor_state``.

Invariants (spec/rollback.md, rules R-M01..R-M12):

- A verdict is a function of the monitor's state and the observation only;
  the state is plain data, so ``state_dict`` -> ``load_state_dict`` continues
  with identical verdicts and reports (floats compared bit for bit).
- Memory is bounded: ``window`` floats for the detector, ``history`` floats,
  spike records and refused steps for the report, plus a few counters.
- ``state_dict`` returns fresh lists and dicts (a snapshot, never a view), and
  holds only msgpack-able builtins: int, float, str, bool, None, list, dict.
- This module imports no torch (``float(x)`` accepts a 0-d tensor anyway).

Example::

    monitor = SpikeMonitor(SpikeConfig(window=50, multiplier=3.0))
    verdict = monitor.observe(step, grad_norm=total_norm, loss=loss.item())
    if verdict.is_spike:
        monitor.refuse(step)          # the trainer skips or rolls back the update
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, SupportsFloat

from ..errors import ConfigDrift, MalformedIndex, UnsupportedVersion
from ..format._checks import as_int, is_int, is_number
from ._monitor_state import SPIKE_REASONS, DetectorState, ReportState, exact_keys, typed

__all__ = ["REASONS", "STATE_VERSION", "SpikeConfig", "SpikeMonitor", "Verdict"]

_NO_HISTORY = DetectorState((), None)  # a fresh detector (frozen: safe to share as a default)

STATE_VERSION = 1  # the "version" key of state_dict(); R-M09
# Every reason a verdict can carry; the spike reasons are the last three.
REASONS = ("ok", "warming_up", *SPIKE_REASONS)


@dataclasses.dataclass(frozen=True)
class SpikeConfig:
    """How the monitor decides a spike. Part of the run config: changing it is drift."""

    window: int = 50  # accepted grad norms in the rolling median, >= 1 (steps)
    multiplier: float = 3.0  # spike iff grad_norm > multiplier * median; finite, > 0
    min_history: int = 10  # accepted values before a grad-norm spike can trigger; 1..window
    # Absolute grad-norm floor (same units as the grad norm), finite, >= 0: a value
    # <= floor is never a grad-norm spike. Default 0.0 (off): grad-norm scale spans
    # orders of magnitude across models, losses and reductions, so any non-zero
    # default would silently blind some run to real spikes, while a floor that is
    # too low only costs a loud false alarm. Set it when the run's scale is known.
    floor: float = 0.0
    history: int = 1000  # recent grad norms / spike records / refused steps kept for report(), >= 0

    def __post_init__(self) -> None:
        for name in ("window", "min_history", "history"):
            value = getattr(self, name)
            if not is_int(value, least=None):
                raise TypeError(f"{name} must be an int (got {type(value).__name__})")
        for name in ("multiplier", "floor"):
            value = getattr(self, name)
            if not is_number(value):
                raise TypeError(f"{name} must be a number (got {type(value).__name__})")
            object.__setattr__(self, name, float(value))  # one type in state_dict
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (got {self.window})")
        if not (math.isfinite(self.multiplier) and self.multiplier > 0.0):
            raise ValueError(f"multiplier must be finite and > 0 (got {self.multiplier})")
        if self.min_history < 1:
            raise ValueError(f"min_history must be >= 1 (got {self.min_history})")
        if self.min_history > self.window:
            raise ValueError(
                f"min_history must be <= window (got min_history={self.min_history}, window={self.window})"
            )
        if not (math.isfinite(self.floor) and self.floor >= 0.0):
            raise ValueError(f"floor must be finite and >= 0 (got {self.floor})")
        if self.history < 0:
            raise ValueError(f"history must be >= 0 (got {self.history})")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain values (the ``config`` entry of ``state_dict``)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the monitor concluded about one step.

    Attributes:
        step: the step observed.
        grad_norm / loss: the values observed, as floats.
        median: the window's (lower) median before this observation; None if empty.
        ratio: ``grad_norm / median``; None when there is no median or it is 0.
        is_spike: True for the reasons ``grad_norm``, ``non_finite_grad_norm``,
            ``non_finite_loss``.
        reason: one of :data:`REASONS`.
    """

    step: int
    grad_norm: float
    loss: float
    median: float | None
    ratio: float | None
    is_spike: bool
    reason: str


def _lower_median(ordered: list[float]) -> float | None:
    # The lower median is always an observed value: exact, no rounding (R-M03).
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def _nearest_rank(ordered: list[float], q: float) -> float | None:
    # Nearest-rank quantile: the smallest value with at least q of the data at or below it.
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class _Detector:
    """The rolling-median detector: the last ``window`` accepted grad norms (rewound on rollback, R-M07)."""

    def __init__(self, config: SpikeConfig, state: DetectorState = _NO_HISTORY) -> None:
        self.config = config
        self.window: collections.deque[float] = collections.deque(state.window, maxlen=config.window)
        self.sorted = sorted(self.window)  # the window's values, ascending
        self.last_step = state.last_step

    @property
    def median(self) -> float | None:
        return _lower_median(self.sorted)

    def judge(self, step: int, g: float, loss: float) -> Verdict:
        """The verdict on one step; a non-spike enters the window."""
        median = self.median
        ratio = g / median if median else None  # None for no median and for median == 0
        cfg = self.config
        if not math.isfinite(g):
            reason = "non_finite_grad_norm"
        elif not math.isfinite(loss):
            reason = "non_finite_loss"
        elif len(self.window) < cfg.min_history:
            reason = "warming_up"
        elif median is not None and g > cfg.floor and g > cfg.multiplier * median:
            reason = "grad_norm"
        else:
            reason = "ok"
        is_spike = reason in SPIKE_REASONS
        self.last_step = step
        if not is_spike:
            if len(self.window) == self.window.maxlen:
                del self.sorted[bisect.bisect_left(self.sorted, self.window[0])]
            self.window.append(g)
            bisect.insort(self.sorted, g)
        return Verdict(step, g, loss, median, ratio, is_spike, reason)

    def state_dict(self) -> dict[str, Any]:
        return {"window": list(self.window), "last_step": self.last_step}


class _Report:
    """The run's stability record (never rewound: it describes the whole run, discarded branches too)."""

    def __init__(self, history: int, state: ReportState | None = None) -> None:
        s = state or ReportState(0, dict.fromkeys(SPIKE_REASONS, 0), (), (), 0, 0, 0, 0.0, None, None, ())
        self.observed = s.observed
        self.spikes = dict(s.spikes)
        self.recent_spikes: collections.deque[dict[str, Any]] = collections.deque(
            (dict(r) for r in s.recent_spikes), maxlen=history
        )
        self.refused: collections.deque[int] = collections.deque(s.refused, maxlen=history)
        self.refused_count = s.refused_count
        self.finite_count = s.finite_count
        self.non_finite_count = s.non_finite_count
        self.sum = s.sum
        self.min = s.min
        self.max = s.max
        self.recent: collections.deque[float] = collections.deque(s.recent, maxlen=history)

    def record(self, v: Verdict) -> None:
        self.observed += 1
        if math.isfinite(v.grad_norm):
            self.finite_count += 1
            self.sum += v.grad_norm
            self.min = v.grad_norm if self.min is None else min(self.min, v.grad_norm)
            self.max = v.grad_norm if self.max is None else max(self.max, v.grad_norm)
            self.recent.append(v.grad_norm)
        else:
            self.non_finite_count += 1
        if v.is_spike:
            self.spikes[v.reason] += 1
            self.recent_spikes.append(
                {"step": v.step, "reason": v.reason, "grad_norm": v.grad_norm, "loss": v.loss, "median": v.median}
            )

    def refuse(self, step: int) -> None:
        self.refused.append(step)
        self.refused_count += 1

    def summary(self, detector: _Detector) -> dict[str, Any]:
        """What :meth:`SpikeMonitor.report` returns."""
        recent = sorted(self.recent)
        return {
            "observed": self.observed,
            "last_step": detector.last_step,
            "spikes": sum(self.spikes.values()),
            "spikes_by_reason": dict(self.spikes),
            "recent_spikes": [dict(s) for s in self.recent_spikes],
            "refused": list(self.refused),
            "refused_count": self.refused_count,
            "window": {"size": len(detector.window), "median": detector.median},
            "grad_norm": {
                "count": self.finite_count,
                "non_finite": self.non_finite_count,
                "min": self.min,
                "max": self.max,
                "mean": self.sum / self.finite_count if self.finite_count else None,
                "recent": len(recent),
                "p50": _nearest_rank(recent, 0.5),
                "p99": _nearest_rank(recent, 0.99),
                "p999": _nearest_rank(recent, 0.999),
            },
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "observed": self.observed,
            "spikes": dict(self.spikes),
            "recent_spikes": [dict(s) for s in self.recent_spikes],
            "refused": list(self.refused),
            "refused_count": self.refused_count,
            "finite_count": self.finite_count,
            "non_finite_count": self.non_finite_count,
            "sum": self.sum,
            "min": self.min,
            "max": self.max,
            "recent": list(self.recent),
        }


class SpikeMonitor:
    """Rolling-median spike detector plus the run's stability report (spec/rollback.md).

    Args:
        config: the detection parameters; ``SpikeConfig()`` if omitted.

    Example::

        m = SpikeMonitor(SpikeConfig(window=50, multiplier=3.0, min_history=10))
        for step, (g, loss) in enumerate(stream):
            v = m.observe(step, g, loss)
    """

    def __init__(self, config: SpikeConfig | None = None) -> None:
        self.config = SpikeConfig() if config is None else config
        if not isinstance(self.config, SpikeConfig):
            raise TypeError(f"config must be a SpikeConfig (got {type(self.config).__name__})")
        self._detector = _Detector(self.config)
        self._report = _Report(self.config.history)

    # ------------------------------------------------------------------ observe

    def observe(self, step: int, grad_norm: SupportsFloat, loss: SupportsFloat) -> Verdict:
        """Judge one step and record it.

        Args:
            step: the training step, an int >= 0 and greater than the last observed step.
            grad_norm: the pre-clip global grad norm: a float, or anything with ``__float__``
                (a 0-dim tensor, a numpy scalar).
            loss: the step's loss.

        Returns:
            The :class:`Verdict`. A non-finite grad norm or loss is always a spike;
            a grad-norm spike needs ``min_history`` accepted values, ``grad_norm >
            floor`` and ``grad_norm > multiplier * median``. Non-spikes enter the
            window; spikes never do.

        Raises:
            ValueError: ``step`` is negative or not after the last observed step,
                or ``grad_norm`` is negative.
            TypeError: ``step`` is not an int, or a value is not a number.
        """
        step = as_int("step", step)
        last = self._detector.last_step
        if last is not None and step <= last:
            raise ValueError(f"step must be > the last observed step {last} (got {step})")
        g = float(grad_norm)
        loss_f = float(loss)
        if g < 0.0:
            raise ValueError(f"grad_norm must be >= 0 (got {g})")
        verdict = self._detector.judge(step, g, loss_f)
        self._report.record(verdict)
        return verdict

    def refuse(self, step: int) -> None:
        """Record that the update of ``step`` was refused (skipped or rolled back).

        The trainer decides (``--auto-rollback``); the monitor only keeps the record.

        Args:
            step: the refused step, an int >= 0.

        Raises:
            ValueError / TypeError: ``step`` is not an int >= 0.
        """
        self._report.refuse(as_int("step", step))

    @property
    def last_step(self) -> int | None:
        """The last observed step, or None before the first observation."""
        return self._detector.last_step

    # ------------------------------------------------------------------ report

    def report(self) -> dict[str, Any]:
        """The stability report, as plain values (fresh objects on every call).

        Returns:
            ``observed``, ``last_step``, ``spikes`` (total), ``spikes_by_reason``,
            ``recent_spikes`` (last ``history``), ``refused`` (last ``history``
            steps), ``refused_count``, ``window`` (size, median) and
            ``grad_norm`` statistics: finite/non-finite counts, min, max, mean over
            every finite value, and nearest-rank p50/p99/p99.9 over the last
            ``history`` finite values (None when there are none).
        """
        return self._report.summary(self._detector)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the whole monitor as plain msgpack-able values (R-M09).

        The result shares nothing with the monitor: mutate it freely, keep it for a
        rollback. Layout (spec/rollback.md): ``version``, ``config``, ``detector``
        (``window`` in arrival order, ``last_step``) and ``report`` (counters,
        bounded lists, running statistics).

        Returns:
            A new dict.
        """
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "detector": self._detector.state_dict(),
            "report": self._report.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` exactly; the monitor's config must match it.

        Args:
            state: a dict from :meth:`state_dict` (possibly through msgpack).

        Raises:
            UnsupportedVersion: ``version`` is not one this reader knows.
            MalformedIndex: a key is missing or unknown, a value has the wrong type,
                or a list is longer than the config allows.
            ConfigDrift: the recorded config differs from ``self.config``; every
                differing field is named.
        """
        detector, report = self._parse(state)
        self._detector = _Detector(self.config, detector)
        self._report = _Report(self.config.history, report)

    def rewind(self, state: Mapping[str, Any]) -> None:
        """Roll the detector back to a snapshot, keeping the report (R-M07).

        A rollback restores the model to an earlier step; the window must go back
        with it so re-run steps are judged against the history they follow. The
        report is the run's record -- it keeps the spike that caused the rollback.

        Args:
            state: a :meth:`state_dict` taken at an earlier step.

        Raises:
            As :meth:`load_state_dict`, and ValueError if the snapshot's last step
            is after this monitor's last step.
        """
        detector, _ = self._parse(state)
        snap_last, last = detector.last_step, self._detector.last_step
        if snap_last is not None and (last is None or snap_last > last):
            raise ValueError(
                f"rewind snapshot is ahead of the monitor (snapshot last step {snap_last}, monitor last step {last})"
            )
        self._detector = _Detector(self.config, detector)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> SpikeMonitor:
        """A monitor built with the recorded config and restored from ``state``.

        For tools that read a checkpoint without the run config (inspect, report).

        Raises:
            As :meth:`load_state_dict` (never ConfigDrift).
        """
        config = _config_from(typed(state, "config", dict, "monitor"))
        monitor = cls(config)
        monitor.load_state_dict(state)
        return monitor

    def _parse(self, state: Any) -> tuple[DetectorState, ReportState]:
        """Check every key and type of a state dict (R-M09..R-M12); return its parts."""
        if not isinstance(state, Mapping):
            raise MalformedIndex(f"state must be a dict (got {type(state).__name__})", field="monitor")
        version = state.get("version")
        if not is_int(version, least=None):
            raise MalformedIndex(f"version must be an int (got {type(version).__name__})", field="monitor.version")
        if version != STATE_VERSION:
            raise UnsupportedVersion(
                "monitor state version not supported",
                field="monitor.version",
                expected=STATE_VERSION,
                actual=version,
                hint="upgrade ckptkit to read this checkpoint",
            )
        exact_keys(state, {"version", "config", "detector", "report"}, "monitor")
        _check_same_config(_config_from(state["config"]), self.config)
        detector = DetectorState.from_dict(typed(state, "detector", dict, "monitor"), window=self.config.window)
        report = ReportState.from_dict(typed(state, "report", dict, "monitor"), history=self.config.history)
        return detector, report


def _check_same_config(recorded: SpikeConfig, configured: SpikeConfig) -> None:
    if recorded == configured:
        return
    diffs = [
        f"{f.name}: recorded {getattr(recorded, f.name)!r}, configured {getattr(configured, f.name)!r}"
        for f in dataclasses.fields(SpikeConfig)
        if getattr(recorded, f.name) != getattr(configured, f.name)
    ]
    raise ConfigDrift(
        "monitor state was recorded with a different spike config: "
        + "; ".join(diffs)
        + " (the spike config is part of the run config; resume with the recorded values)",
        diffs,
    )


def _config_from(raw: Any) -> SpikeConfig:
    if not isinstance(raw, Mapping):
        raise MalformedIndex(f"must be a dict (got {type(raw).__name__})", field="monitor.config")
    exact_keys(raw, {f.name for f in dataclasses.fields(SpikeConfig)}, "monitor.config")
    try:
        return SpikeConfig(**{str(k): v for k, v in raw.items()})
    except (TypeError, ValueError) as e:
        raise MalformedIndex(f"invalid spike config: {e}", field="monitor.config") from None
