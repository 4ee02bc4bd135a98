"""Where two runs part: the one difference type every comparison returns, and the one search for it.

A replay against its recording, the trainer's two-run audit, an outside loop's
command audit and :func:`ckptkit.audit.first_divergence_in_files` all answer the same
question (the first step at which two runs are not the same run, and in what), so
they answer it with one type: :class:`Difference`. Reports (``ckptkit replay``,
``ckptkit audit``) print it; ``--json`` writes :meth:`Difference.to_json`
(spec/replay.md R-P09). The search over two runs' rows, :func:`first_row_difference`, lives
here too, on the run floor: the audit runs it on two recordings, and a resume runs it on the
steps it re-runs against the rows the interrupted process recorded (spec/determinism.md
R-D20). Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "Difference",
    "FieldDiff",
    "Rerun",
    "TensorReport",
    "compute_order",
    "differing_names",
    "first_row_difference",
    "named_reports",
    "same_value",
    "show",
]


@dataclass(frozen=True)
class FieldDiff:
    """One field (of a history row, or a count) that differs: ``recorded`` is side a's value."""

    field: str
    recorded: Any
    replayed: Any


@dataclass(frozen=True)
class TensorReport:
    """One tensor (or value) that differs, with what is known about the difference.

    ``recorded_digest`` is side a's digest; ``actual_digest`` side b's (for a
    ``checkpoint`` difference of a replay: the file's). ``max_abs_diff`` / ``n_diff`` are
    None when no verified copy of both sides' values exists (a recording keeps digests,
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
    """The differing step run twice in one process from the same state (replay against replay)."""

    identical: bool
    fields: tuple[FieldDiff, ...] = ()
    tensors: tuple[TensorReport, ...] = ()


@dataclass(frozen=True)
class Difference:
    """Where two runs first part.

    Attributes:
        kind: the history row kind that differs (``step``, ``digests``, ``spike``,
            ``rollback``, ``start``, ``probe``), ``rows`` (the rows' kinds or count differ),
            ``state`` (the state after ``step`` steps differs from the recorded
            ``checkpoint`` row) or ``checkpoint`` (a checkpoint file's bytes differ).
        step: for a row, its ``step`` (0-based for ``step`` rows); for ``checkpoint`` and
            ``state``, the number of steps done (the checkpoint's step).
        fields: the row fields (or counts) that differ.
        tensors: the tensors and values that differ, where to look first first.
        values: where the values behind ``max_abs_diff`` came from, or why there are none.
        rerun: the step re-run twice here, or None when it was not.
        file: the checkpoint file concerned (``checkpoint`` kind), else None.
        hints: likely causes, most likely first.
    """

    kind: str
    step: int
    fields: tuple[FieldDiff, ...] = ()
    tensors: tuple[TensorReport, ...] = ()
    values: str = ""
    rerun: Rerun | None = None
    file: str | None = None
    hints: tuple[str, ...] = ()

    @property
    def layout_only(self) -> bool:
        """A checkpoint whose bytes differ while every tensor and value is equal."""
        return self.kind == "checkpoint" and not self.tensors

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.field for f in self.fields)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def describe(self) -> str:
        """One line: the step and each field, side a against side b.

        Example:
            >>> Difference("step", 4, (FieldDiff("params_digest", 4, 99),)).describe()
            'step 4: params_digest: recorded 4, replayed 99'
        """
        parts = [f"{f.field}: recorded {f.recorded!r}, replayed {f.replayed!r}" for f in self.fields]
        names = ", ".join(self.tensor_names)
        return (
            f"step {self.step}: " + ("; ".join(parts) or f"the {self.kind} differs") + (f" ({names})" if names else "")
        )

    def lines(self, a: str = "recorded", b: str = "replayed", *, against: str = "", limit: int = 12) -> list[str]:
        """What every report prints under its headline: each field (side ``a`` against side
        ``b``), the tensors that differ ``against`` what (first computed first), where the
        values came from, the step re-run twice, the hints."""
        out = [f"  {f.field}: {a} {show(f.recorded)}, {b} {show(f.replayed)}" for f in self.fields]
        if self.tensors:
            out.append(f"  tensors that differ{against} ({len(self.tensors)}), first computed first:")
            out += _tensor_lines(self.tensors, limit)
        if self.values:
            out.append(f"  values: {self.values}")
        if self.rerun is not None:
            out += self._rerun_lines(limit)
        return out + [f"  hint: {h}" for h in self.hints]

    def _rerun_lines(self, limit: int) -> list[str]:
        assert self.rerun is not None
        step = self.step if self.kind == "step" else self.step - 1  # a state/checkpoint difference counts steps done
        if self.rerun.identical:
            return [f"  re-run of step {step} twice here: identical (deterministic in this process)"]
        out = [f"  re-run of step {step} twice here: DIFFERS (nondeterministic in this process):"]
        out += [f"    {f.field}: first {show(f.recorded)}, second {show(f.replayed)}" for f in self.rerun.fields]
        return out + ["  " + s for s in _tensor_lines(self.rerun.tensors, limit)]

    def to_json(self, a: str = "recorded", b: str = "replayed") -> dict[str, Any]:
        """The ``--json`` object; ``a``/``b`` label the two sides of each field."""
        return {
            "kind": self.kind,
            "step": self.step,
            "file": self.file,
            "fields": [_field_json(f, a, b) for f in self.fields],
            "tensors": [asdict(t) for t in self.tensors],
            "values": self.values,
            "rerun": None
            if self.rerun is None
            else {
                "identical": self.rerun.identical,
                "fields": [_field_json(f, "first", "second") for f in self.rerun.fields],
                "tensors": [asdict(t) for t in self.rerun.tensors],
            },
            "hints": list(self.hints),
        }


def differing_names(recorded: Mapping[str, Any], replayed: Mapping[str, Any]) -> list[str]:
    """Names whose digests differ, or that one side lacks, sorted.

    Example:
        >>> differing_names({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4})
        ['b', 'c']
    """
    return sorted(n for n in set(recorded) | set(replayed) if recorded.get(n) != replayed.get(n))


def show(v: Any) -> str:
    """A field's value as a report prints it: a string as is, anything else as JSON; a long
    one (a whole row, a digests map) cut at 120 characters (``--json`` has it whole)."""
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def _tensor_lines(tensors: Sequence[TensorReport], limit: int) -> list[str]:
    width = max((len(t.name) for t in tensors[:limit]), default=0)  # a re-run may differ in no tensor
    out = [f"    {t.name.ljust(width)}  {t.detail}" for t in tensors[:limit]]
    if len(tensors) > limit:
        out.append(f"    ... and {len(tensors) - limit} more (--json lists all)")
    return out


def _field_json(f: FieldDiff, a: str, b: str) -> dict[str, Any]:
    return {"field": f.field, a: f.recorded, b: f.replayed}


#: The order in which a step computes things: the first category that differs is where to look.
_ORDER = ("grad", "model", "optim", "teacher", "monitor", "header")


def first_row_difference(
    rows_a: Sequence[Mapping[str, Any]], rows_b: Sequence[Mapping[str, Any]], fields: Sequence[str] | None = None
) -> Difference | None:
    """Where two runs' rows part: the first row, in order, that differs from its counterpart, or a
    different number of rows; None when they agree. Two rows differ when their ``kind`` (a row
    without one is a step row) or ``step`` does, or any of ``fields`` (default: every key) is in
    one row only or differs by :func:`same_value`. ``rows_a`` is the recording.

    Example:
        >>> first_row_difference([{"step": 1, "x": "0x1"}], [{"step": 1, "x": "0x2"}], ["x"]).describe()
        "step 1: x: recorded '0x1', replayed '0x2'"
    """
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b, strict=False)):
        if not _same_row(ra, rb) or _row_fields(ra, rb, fields):
            return _row_difference(rows_a, rows_b, i, fields)
    if len(rows_a) != len(rows_b):
        last = (rows_a or rows_b)[min(len(rows_a), len(rows_b)) - 1]["step"] if min(len(rows_a), len(rows_b)) else 0
        return Difference("rows", last, fields=(FieldDiff("rows", len(rows_a), len(rows_b)),))
    return None


def same_value(a: Any, b: Any) -> bool:
    """Recorded values compared as the bits they stand for: of one type (``1``, ``1.0`` and
    ``True`` differ), NaN equal to NaN, tables and lists entry by entry."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _same_row(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """The same row: of one kind, at one step."""
    return same_value(a.get("kind", "step"), b.get("kind", "step")) and same_value(a.get("step"), b.get("step"))


def _row_difference(
    rows_a: Sequence[Mapping[str, Any]], rows_b: Sequence[Mapping[str, Any]], i: int, fields: Sequence[str] | None
) -> Difference:
    """The difference at row ``i`` (which differs), with the tensors named by the next
    ``digests`` rows of both runs (the state after that step), when both have one."""
    ra, rb = rows_a[i], rows_b[i]
    kind = ra.get("kind", "step")
    if not _same_row(ra, rb):  # not the same row: every field differs
        return Difference("rows", min(ra["step"], rb["step"]), _row_fields(ra, rb))
    if kind == "digests" and (fields is None or "tensors" in fields):
        bad = differing_names(ra["tensors"], rb["tensors"])
        return Difference(
            "digests", ra["step"], tensors=tuple(named_reports(bad, ra["tensors"], rb["tensors"], "values unavailable"))
        )
    da = next((r for r in rows_a[i:] if r.get("kind") == "digests"), None)
    db = next((r for r in rows_b[i:] if r.get("kind") == "digests"), None)
    tensors: list[TensorReport] = []
    values = "the recording keeps digests, not values"
    if da is not None and db is not None and da["step"] == db["step"]:
        bad = differing_names(da["tensors"], db["tensors"])
        tensors = named_reports(bad, da["tensors"], db["tensors"], "values unavailable")
        values += f"; tensors named from the digests after {da['step']} steps"
    return Difference(kind, ra["step"], _row_fields(ra, rb, fields), tuple(tensors), values)


def compute_order(name: str) -> tuple[int, str]:
    """Where a tensor comes in a step's computation (grads, then the model, ...): the first that
    differs is where to look."""
    head = name.partition(":")[0]
    return (_ORDER.index(head) if head in _ORDER else len(_ORDER), name)


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
    return sorted(out, key=lambda t: compute_order(t.name))


def _row_fields(
    a: Mapping[str, Any], b: Mapping[str, Any], fields: Sequence[str] | None = None
) -> tuple[FieldDiff, ...]:
    """Each of ``fields`` (default: every key, sorted) in one row only or differing by
    :func:`same_value` between two history rows (``a`` recorded, ``b`` replayed)."""
    keys = sorted(set(a) | set(b), key=lambda k: (k != "data", k)) if fields is None else fields  # what fed it, first
    return tuple(
        FieldDiff(k, a.get(k), b.get(k)) for k in keys if (k in a) != (k in b) or not same_value(a.get(k), b.get(k))
    )
