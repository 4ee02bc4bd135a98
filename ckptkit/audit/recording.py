"""A loop's recording, and the first place two recorded runs differ (spec/replay.md "Any loop").

Writing is the run's: :meth:`RunState.record` (one call per step) appends to the
run's ``history.jsonl`` a ``step`` row and a ``digests`` row
(:func:`ckptkit.run.history.step_row`, :func:`~ckptkit.run.history.digests_row`).

Reading: :class:`RunRecording` is a run directory's rows and checkpoints;
:func:`first_difference` walks two of them in order and returns the first step at
which they differ, with the fields and tensors that differ, or None. ``ckptkit
audit -- CMD`` and ``ckptkit replay RUN --from S -- CMD`` report it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..format.companions import same_checkpoint
from ..run.files import checkpoint_name, list_checkpoints
from ..run.fingerprint import differing_names
from ..run.history import HISTORY_FILE, WALL_FIELDS, read_rows

__all__ = ["LAYOUT_ONLY", "Difference", "RunRecording", "first_difference"]

#: What a checkpoint difference is when the bytes differ and every tensor and value is equal.
LAYOUT_ONLY = (
    "the bytes differ, yet every tensor and value is equal (ckptkit diff --tensors finds nothing): "
    "the files lay out the same state differently, so a writer's order depended on the run's history, "
    "not on its state (spec/distributed.md R-DC13)"
)

#: The rows two runs of the same loop must agree on (``resume`` and wall time may differ).
COMPARED = frozenset({"step", "digests", "spike", "rollback"})


@dataclass(frozen=True)
class Difference:
    """Where two recorded runs first differ.

    Attributes:
        step: for a row, its ``step``; for a checkpoint, the steps done.
        kind: the row kind (``step``, ``digests``, ...), ``rows`` (one run has more
            rows), or ``checkpoint``.
        fields: the row fields that differ (``loss_bits``, ...).
        tensors: the tensors and values whose digests or contents differ, by name.
        file: the checkpoint's file name, for ``checkpoint``.
    """

    step: int
    kind: str
    fields: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()
    file: str | None = None
    details: tuple[str, ...] = field(default=(), compare=False)

    @property
    def layout_only(self) -> bool:
        """A checkpoint whose bytes differ while every tensor and value is equal."""
        return self.kind == "checkpoint" and not self.tensors

    def describe(self, a: str = "a", b: str = "b", limit: int = 12) -> list[str]:
        if self.layout_only:
            head = f"DIFFERS at step {self.step}: {self.file} differs between {a} and {b} in bytes only: {LAYOUT_ONLY}"
        elif self.kind == "checkpoint":
            head = f"DIFFERS at step {self.step}: {self.file} differs between {a} and {b} (every recorded row matched)"
        elif self.kind == "rows":
            head = f"DIFFERS after step {self.step}: {a} and {b} recorded a different number of rows"
        else:
            head = f"DIFFERS at step {self.step}: the {self.kind} row"
        lines = [head]
        if self.fields:
            lines.append(f"  fields: {', '.join(self.fields)}")
        if self.tensors:
            lines.append(
                f"  tensors that differ ({len(self.tensors)}): "
                + ", ".join(self.tensors[:limit])
                + (" ..." if len(self.tensors) > limit else "")
            )
        lines += [f"  {d}" for d in self.details[:limit]]
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "fields": list(self.fields),
            "tensors": list(self.tensors),
            "file": self.file,
        }


class RunRecording:
    """A run directory as recorded: its compared rows and its checkpoints.

    Args:
        run_dir: the run directory.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = os.fspath(run_dir)
        rows, _torn = read_rows(os.path.join(self.run_dir, HISTORY_FILE))
        self.rows = [{k: v for k, v in r.items() if k not in WALL_FIELDS} for r in rows if r["kind"] in COMPARED]
        self.checkpoints = dict(list_checkpoints(self.run_dir))

    @property
    def last_step(self) -> int | None:
        """The newest checkpoint's step (None without one)."""
        return max(self.checkpoints) if self.checkpoints else None


def first_difference(a: RunRecording, b: RunRecording, *, from_step: int = 0) -> Difference | None:
    """The first step at which two recordings differ: rows first (in order), then the
    checkpoints both runs saved at the same step (bytes; tensors named by
    :func:`ckptkit.audit.compare.compare_checkpoints`). Rows and checkpoints before
    ``from_step`` are not compared (a replay starts there).

    Raises:
        FormatError: a checkpoint that differs does not verify.
    """
    rows_a = [r for r in a.rows if r["step"] >= from_step]
    rows_b = [r for r in b.rows if r["step"] >= from_step]
    for ra, rb in zip(rows_a, rows_b, strict=False):
        if ra == rb:
            continue
        if ra["kind"] != rb["kind"] or ra["step"] != rb["step"]:
            return Difference(
                min(ra["step"], rb["step"]),
                "rows",
                details=(f"a: {ra['kind']} row of step {ra['step']}, b: {rb['kind']} row of step {rb['step']}",),
            )
        if ra["kind"] == "digests":
            return Difference(ra["step"], "digests", tensors=tuple(differing_names(ra["tensors"], rb["tensors"])))
        fields = tuple(sorted(k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)))
        tensors: tuple[str, ...] = ()
        nxt = _next_digests(rows_a, rows_b, ra)  # the state after this step, by tensor
        if nxt is not None:
            tensors = tuple(differing_names(*nxt))
        return Difference(ra["step"], ra["kind"], fields=fields, tensors=tensors)
    if len(rows_a) != len(rows_b):
        last = (rows_a or rows_b)[min(len(rows_a), len(rows_b)) - 1]["step"] if min(len(rows_a), len(rows_b)) else 0
        return Difference(last, "rows", details=(f"a: {len(rows_a)} rows, b: {len(rows_b)} rows",))
    return _first_checkpoint_difference(a, b, from_step)


def _next_digests(
    rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], row: dict[str, Any]
) -> tuple[dict[str, int], dict[str, int]] | None:
    i = rows_a.index(row)
    for j in range(i + 1, min(len(rows_a), len(rows_b))):
        if rows_a[j]["kind"] == "digests" and rows_b[j]["kind"] == "digests":
            return rows_a[j]["tensors"], rows_b[j]["tensors"]
        if rows_a[j]["kind"] == "step":
            return None
    return None


def _first_checkpoint_difference(a: RunRecording, b: RunRecording, from_step: int) -> Difference | None:
    from .compare import compare_checkpoints

    for step in sorted(set(a.checkpoints) & set(b.checkpoints)):
        if step < from_step:
            continue
        pa, pb = a.checkpoints[step], b.checkpoints[step]
        if same_checkpoint(pa, pb):  # the one rule (its companion record set aside)
            continue
        diffs = compare_checkpoints(pa, pb)
        return Difference(
            step,
            "checkpoint",
            tensors=tuple(d.name for d in diffs),
            file=checkpoint_name(step),
            details=tuple(f"{d.name}: {d.detail}" for d in diffs),
        )
    return None
