"""What a replay found: where it parted from the recording, as text and as JSON.

The replayer (:mod:`ckptkit.trainer.replay`) and the two-run audit
(:mod:`ckptkit.trainer.audit`) build these; ``ckptkit replay`` prints
:meth:`ReplayReport.describe` or, with ``--json``, :meth:`ReplayReport.to_json`
(spec/replay.md R-P09). Tensors are listed in the order a step computes them
(gradients, parameters, optimizer state, teacher, monitor, header), so the first
one listed is where to look.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..audit.compare import TensorDiff
from ..errors import ReplayDivergence
from ..run.environment import EnvDiff
from ..run.fingerprint import FINGERPRINT_FIELDS, Divergence
from ..run.history import WALL_FIELDS

__all__ = [
    "FieldDiff",
    "ReplayReport",
    "Rerun",
    "StepDivergence",
    "TensorReport",
    "divergence_fields",
    "divergence_json",
    "named_reports",
    "row_fields",
    "step_fields",
    "tensor_reports",
]

JSON_SCHEMA_VERSION = 1

#: The order in which a step computes things: the first category that differs is where to look.
_ORDER = ("grad", "model", "optim", "teacher", "monitor", "header")


@dataclass(frozen=True)
class FieldDiff:
    """One fingerprint field of a step row that differs."""

    field: str
    recorded: Any
    replayed: Any


@dataclass(frozen=True)
class TensorReport:
    """One tensor (or value) that differs, with what is known about the difference.

    ``recorded_digest`` is the recording's digest; ``actual_digest`` the replay's (for a
    ``checkpoint`` divergence: the file's). ``max_abs_diff`` / ``n_diff`` are None when
    no verified copy of the other side's values exists (the recording keeps digests,
    not values); ``detail`` says so. Its fields are the ``--json`` keys (R-P09).
    """

    name: str
    detail: str
    recorded_digest: int | None = None
    actual_digest: int | None = None
    n_diff: int | None = None
    numel: int | None = None
    max_abs_diff: float | None = None


@dataclass(frozen=True)
class Rerun:
    """The diverging step run twice here from the same state (replay against replay)."""

    identical: bool
    fields: tuple[FieldDiff, ...] = ()
    tensors: tuple[TensorReport, ...] = ()


@dataclass(frozen=True)
class StepDivergence:
    """Where a replay parts from its recording.

    Attributes:
        kind: ``checkpoint`` (a checkpoint file differs from the digests recorded when
            it was written), ``step`` (a step row's fingerprints differ), ``state``
            (the state after ``step`` steps differs from the recorded ``checkpoint`` row),
            or, replaying through rollbacks (R-P15), ``spike`` / ``rollback`` /
            ``digests`` (that history row differs) or ``rows`` (the rows' kinds or
            count differ).
        step: for ``step``, the 0-based step index (the history row's ``step``); for
            ``checkpoint`` and ``state``, the number of steps done (the checkpoint's step).
        fields: the step row fields that differ (``step`` kind only).
        tensors: tensors that differ from the recording, in compute order (gradients,
            parameters, optimizer state, teacher, monitor, header).
        values: where the values behind ``max_abs_diff`` came from, or why there are none.
        rerun: the step re-run twice here (``step``/``state`` kinds), or None.
        file: the checkpoint file concerned (``checkpoint`` kind), else None.
    """

    kind: str
    step: int
    fields: tuple[FieldDiff, ...] = ()
    tensors: tuple[TensorReport, ...] = ()
    values: str = ""
    rerun: Rerun | None = None
    file: str | None = None
    hints: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReplayReport:
    """What :func:`replay` found; ``ok`` when every step matched bit for bit."""

    run_dir: str
    checkpoint: str
    start: int  # steps done at the checkpoint replay started from
    to: int  # steps done when the replay stops (when it does not diverge)
    replayed: int  # steps re-run
    overrides: tuple[FieldDiff, ...] = ()
    environment: tuple[EnvDiff, ...] = ()
    notes: tuple[str, ...] = ()
    divergence: StepDivergence | None = None
    guarded: bool = False  # replayed through rollbacks by the guarded loop (R-P15): executions, rows compared

    @property
    def ok(self) -> bool:
        """Every replayed step matched the recording bit for bit."""
        return self.divergence is None

    def raise_for_divergence(self) -> None:
        """Raise :class:`~ckptkit.errors.ReplayDivergence` (message: :meth:`describe`) unless ``ok``.

        Raises:
            ReplayDivergence: the replay diverged.
        """
        if self.divergence is not None:
            raise ReplayDivergence(self.describe())

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object (spec/replay.md R-P09)."""
        d = self.divergence
        return {
            "schema_version": JSON_SCHEMA_VERSION,
            "ok": self.ok,
            "run": self.run_dir,
            "checkpoint": self.checkpoint,
            "from": self.start,
            "to": self.to,
            "steps_replayed": self.replayed,
            "guarded": self.guarded,
            "overrides": [_field_json(f, "snapshot", "replay") for f in self.overrides],
            "environment": [
                {"key": e.key, "recorded": e.recorded, "current": e.current, "fatal": e.fatal} for e in self.environment
            ],
            "notes": list(self.notes),
            "divergence": None if d is None else divergence_json(d),
        }

    def describe(self, limit: int = 12) -> str:
        """The human report (what ``ckptkit replay`` prints on stdout)."""
        lines = [f"replay: {self.checkpoint} (step {self.start}) -> step {self.to}"]
        for o in self.overrides:
            lines.append(f"override: {o.field}: snapshot {_show(o.recorded)}, replay {_show(o.replayed)}")
        fatal = [e for e in self.environment if e.fatal]
        if fatal:
            lines.append(f"environment: differs from the recording in {len(fatal)} fact(s):")
            lines += [f"  {e}" for e in fatal]
        else:
            lines.append("environment: as recorded")
        lines += [f"note: {n}" for n in self.notes]
        d = self.divergence
        if d is None:
            span = f"steps {self.start}..{self.to - 1}" if self.replayed else "no steps"
            what = (
                "step execution(s) replayed through the recorded re-runs and rollbacks"
                if self.guarded
                else "step(s) replayed"
            )
            lines.append(f"IDENTICAL: {self.replayed} {what} ({span}), every fingerprint bit for bit")
            return "\n".join(lines)
        lines.append(self._divergence_headline(d))
        for f in d.fields:
            lines.append(f"  {f.field}: recorded {_show(f.recorded)}, replayed {_show(f.replayed)}")
        if d.tensors:
            lines.append(f"  tensors that differ from the recording ({len(d.tensors)}), first computed first:")
            lines += _tensor_lines(d.tensors, limit)
        if d.values:
            lines.append(f"  values: {d.values}")
        if d.rerun is not None:
            lines += _rerun_lines(d, d.rerun, limit)
        lines += [f"  hint: {h}" for h in d.hints]
        return "\n".join(lines)

    def _divergence_headline(self, d: StepDivergence) -> str:
        """The ``DIVERGED at step N`` line: what differed, as the divergence's kind and the replay's mode say."""
        if d.kind == "checkpoint" and self.guarded:
            return f"DIVERGED at step {d.step}: {d.file} differs from the file the replay wrote at that step"
        if d.kind == "checkpoint":
            return (
                f"DIVERGED at step {d.step}: {d.file} does not match the digests recorded when it was "
                "written (altered after the fact)"
            )
        if self.guarded:
            return (
                f"DIVERGED at step {d.step}: the recording's history row differs from the replay's "
                f"({d.kind}; the rows before it matched)"
            )
        if d.kind == "state":
            return (
                f"DIVERGED at step {d.step}: the state after {d.step} steps differs from the recorded "
                "checkpoint digests"
            )
        return f"DIVERGED at step {d.step} (history row step={d.step}; {self.replayed - 1} step(s) before it matched)"


def _rerun_lines(d: StepDivergence, rerun: Rerun, limit: int) -> list[str]:
    """The diverging step run twice here: identical, or what the two runs disagree on."""
    step = d.step if d.kind == "step" else d.step - 1  # a state/checkpoint divergence counts steps done
    if rerun.identical:
        return [f"  re-run of step {step} twice here: identical (deterministic in this process)"]
    lines = [f"  re-run of step {step} twice here: DIFFERS (nondeterministic in this process):"]
    for f in rerun.fields:
        lines.append(f"    {f.field}: first {_show(f.recorded)}, second {_show(f.replayed)}")
    return lines + ["  " + s for s in _tensor_lines(rerun.tensors, limit)]


def divergence_json(d: StepDivergence, a: str = "recorded", b: str = "replayed") -> dict[str, Any]:
    """A :class:`StepDivergence` as JSON; ``a``/``b`` label the two sides of each field."""
    return {
        "kind": d.kind,
        "step": d.step,
        "file": d.file,
        "fields": [_field_json(f, a, b) for f in d.fields],
        "tensors": [asdict(t) for t in d.tensors],
        "values": d.values,
        "rerun": None
        if d.rerun is None
        else {
            "identical": d.rerun.identical,
            "fields": [_field_json(f, "first", "second") for f in d.rerun.fields],
            "tensors": [asdict(t) for t in d.rerun.tensors],
        },
        "hints": list(d.hints),
    }


def _show(v: Any) -> str:
    return json.dumps(v, sort_keys=True) if not isinstance(v, str) else v


def _field_json(f: FieldDiff, a: str, b: str) -> dict[str, Any]:
    return {"field": f.field, a: f.recorded, b: f.replayed}


def _tensor_lines(tensors: Sequence[TensorReport], limit: int) -> list[str]:
    width = max((len(t.name) for t in tensors[:limit]), default=0)  # a re-run may differ in no tensor
    out = [f"    {t.name.ljust(width)}  {t.detail}" for t in tensors[:limit]]
    if len(tensors) > limit:
        out.append(f"    ... and {len(tensors) - limit} more (--json lists all)")
    return out


def _rank(name: str) -> tuple[int, str]:
    head = name.partition(":")[0]
    return (_ORDER.index(head) if head in _ORDER else len(_ORDER), name)


def step_fields(recorded: Mapping[str, Any]) -> list[str]:
    """A step row's compared fields: the fingerprints first, then the rest, sorted (not wall time)."""
    skip = WALL_FIELDS | {"kind", "step"}
    first = [f for f in FINGERPRINT_FIELDS if f in recorded]
    return first + sorted(k for k in recorded if k not in skip and k not in first)


def divergence_fields(d: Divergence) -> tuple[FieldDiff, ...]:
    """A :class:`~ckptkit.run.fingerprint.Divergence`'s differing fields, recorded against replayed."""
    return tuple(FieldDiff(f, d.expected.get(f), d.actual.get(f)) for f in d.fields)


def tensor_reports(
    diffs: Sequence[TensorDiff], digests: Mapping[str, tuple[int | None, int | None]]
) -> list[TensorReport]:
    """:func:`ckptkit.audit.compare.compare_states` differences as reports, in compute order."""
    out = []
    for t in diffs:
        rec, rep = digests.get(t.name, (None, None))
        out.append(
            TensorReport(
                t.name, t.detail, rec, rep, t.n_diff if t.kind == "changed" else None, t.numel or None, t.max_abs_diff
            )
        )
    return sorted(out, key=lambda t: _rank(t.name))


def named_reports(
    names: Sequence[str], recorded: Mapping[str, int], replayed: Mapping[str, int], why: str
) -> list[TensorReport]:
    """Tensors known only by digest (no values on one side), in compute order; ``why`` ends each detail."""
    out = []
    for n in names:
        rec, rep = recorded.get(n), replayed.get(n)
        detail = (
            "only in the recording"
            if rep is None
            else "not in the recording"
            if rec is None
            else f"digest differs; {why}"
        )
        out.append(TensorReport(n, detail, rec, rep))
    return sorted(out, key=lambda t: _rank(t.name))


def row_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[FieldDiff, ...]:
    """Every key whose value differs between two history rows, sorted (``a`` recorded, ``b`` replayed)."""
    return tuple(FieldDiff(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
