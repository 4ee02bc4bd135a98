"""Where two runs part: the one difference type every comparison returns.

A replay against its recording, the trainer's two-run audit, an outside loop's
command audit and :func:`ckptkit.audit.first_divergence_in_files` all answer the same
question (the first step at which two runs are not the same run, and in what), so
they answer it with one type: :class:`Difference`. Reports (``ckptkit replay``,
``ckptkit audit``) print it; ``--json`` writes :meth:`Difference.to_json`
(spec/replay.md R-P09). It lives on the run floor, under the audit that searches for it
(:func:`ckptkit.audit.first_row_difference`); nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Difference", "FieldDiff", "Rerun", "TensorReport", "show"]


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
