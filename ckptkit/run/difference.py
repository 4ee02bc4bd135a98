"""Where two runs part: the one difference type every comparison returns.

A replay against its recording, the trainer's two-run audit, an outside loop's
command audit and :func:`ckptkit.fingerprint.first_divergence` all answer the same
question (the first step at which two runs are not the same run, and in what), so
they answer it with one type: :class:`Difference`. Reports (``ckptkit replay``,
``ckptkit audit``) print it; ``--json`` writes :meth:`Difference.to_json`
(spec/replay.md R-P09). It lives on the run floor because the fingerprints'
:func:`~ckptkit.fingerprint.first_divergence` returns it; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Difference", "FieldDiff", "Rerun", "TensorReport"]


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


def _field_json(f: FieldDiff, a: str, b: str) -> dict[str, Any]:
    return {"field": f.field, a: f.recorded, b: f.replayed}
