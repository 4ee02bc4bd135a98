"""A run's recording read back, and the first place two recorded runs differ (spec/replay.md).

Writing is the run's: every row goes through the run's one history
(:class:`ckptkit.run.History`; :meth:`RunState.record` adds ``step`` and
``digests`` rows, the guard its ``spike`` and ``rollback`` rows, the trainer its own).

Reading is here, once, for every comparison: :class:`RunRecording` is a run
directory's rows, indexed by step, and its checkpoints; :func:`first_row_difference` is
the one search for where two recordings part: it walks two runs' rows in order and returns
the first that differs (recorded values compared type-strictly: :func:`same_value`) as the
one :class:`~ckptkit.run._difference.Difference` type, or None. :func:`first_difference`
runs it on two recordings, then compares their checkpoints; ``ckptkit audit`` and
``ckptkit replay`` (of the trainer and of any loop's command) report it, the trainer's
re-run of a step compares its two rows with it, and :func:`first_divergence_in_files` runs
it on any two JSON Lines histories.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import CheckpointNotFound, FormatError
from ..format._companions import same_checkpoint
from ..run._difference import Difference, TensorReport, compute_order, first_row_difference, named_reports
from ..run._environment import EnvDiff
from ..run._files import run_checkpoints
from ..run._fingerprint import FINGERPRINT_FIELDS, step_rows
from ..run._history import HISTORY_FILE, WALL_FIELDS, compared_rows, read_rows
from ._compare import TensorDiff, compare_checkpoints, compare_states
from ._trainer_folder import folder_state, is_trainer_folder

__all__ = [
    "LAYOUT_ONLY",
    "RunRecording",
    "checkpoint_difference",
    "first_checkpoint_difference",
    "first_difference",
    "first_divergence_in_files",
    "rebuild_difference",
    "step_fields",
    "tensor_reports",
]

#: What a checkpoint difference is when the bytes differ and every tensor and value is equal.
LAYOUT_ONLY = (
    "the bytes differ, yet every tensor and value is equal (ckptkit diff --tensors finds nothing): "
    "the files lay out the same state differently, so a writer's order depended on the run's history, "
    "not on its state (spec/distributed.md R-DC13)"
)


class RunRecording:
    """A run directory as recorded: its rows, indexed by step, and its checkpoints.

    After a spike rollback step numbers repeat: in the indexes the later row replaces
    the earlier one (the abandoned timeline stays in :attr:`all_rows` as a record).

    Args:
        run_dir: the run directory.
        required: raise :class:`CheckpointNotFound` when the run has no history
            (a replay has nothing to compare with).

    Raises:
        CheckpointNotFound: ``required`` and no ``history.jsonl``.
        FormatError: a line is not a history row, or a ``digests``/``checkpoint`` row
            has no tensors map.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, required: bool = False) -> None:
        self.run_dir = os.fspath(run_dir)
        path = os.path.join(self.run_dir, HISTORY_FILE)
        if required and not os.path.isfile(path):
            raise CheckpointNotFound(f"{path}: no history; replay compares a re-run with the run's history.jsonl")
        self.all_rows: list[dict[str, Any]] = read_rows(path)[0]  # every row, in file order
        #: the rows two runs of the same loop must agree on, without wall time, in order
        self.rows = compared_rows(self.all_rows)
        self.checkpoints = run_checkpoints(self.run_dir)
        self.steps: dict[int, dict[str, Any]] = {}
        self.digests: dict[int, Mapping[str, int]] = {}  # the ``digests`` rows' tensors, by steps done
        self.checkpoint_digests: dict[int, Mapping[str, int]] = {}  # the ``checkpoint`` rows' tensors
        self.rollbacks: list[int] = []  # steps the loop re-ran or rolled back (spec/rollback.md)
        #: every ``resume`` row, in file order: (step, the environment its process ran under, by fact)
        self.resumes: list[tuple[int, tuple[EnvDiff, ...]]] = []
        for r in self.all_rows:
            self._index(path, r)

    def _index(self, path: str, r: dict[str, Any]) -> None:
        kind, step = r["kind"], r["step"]
        if kind == "step":
            self.steps[step] = r
        elif kind in ("digests", "checkpoint"):
            tensors = r.get("tensors")
            if not isinstance(tensors, dict):
                raise FormatError(f"a {kind} row at step {step} has no tensors map", path=path, field="history")
            (self.digests if kind == "digests" else self.checkpoint_digests)[step] = tensors
        elif kind == "rollback" or (kind == "spike" and r.get("action") not in (None, "warn")):
            self.rollbacks.append(step)
        elif kind == "resume":
            diffs = r.get("env_diffs", [])  # a row from before ckptkit recorded them: unknown, taken as none
            if not isinstance(diffs, list):
                raise FormatError(f"a resume row at step {step} has env_diffs that are not a list", path=path)
            self.resumes.append((step, tuple(EnvDiff.from_json(d, "history.resume.env_diffs") for d in diffs)))

    def facts_at(self, facts: Mapping[str, Any], step: int) -> dict[str, Any]:
        """The environment the run's step ``step`` ran under: ``facts`` (its ``environment.json``)
        as the newest ``resume`` row at or before ``step`` says that process differed (R-D12)."""
        now = [diffs for s, diffs in self.resumes if s <= step]
        out = dict(facts)
        for d in now[-1] if now else ():
            if d.current is None:
                out.pop(d.key, None)
            else:
                out[d.key] = d.current
        return out

    def stop_at(self, step: int) -> None:
        """Keep the recording until it first reaches ``step`` steps done (the state after it
        included): what a replay that stops there reproduces. A prefix, since after a rollback
        step numbers repeat; and a rollback past it saved its target step again, so from there
        on the run's checkpoint files are a later timeline's and are left out."""
        rows = self.rows
        cut = next(
            (i for i, r in enumerate(rows) if r["step"] > step or (r["step"] == step and r["kind"] != "digests")),
            len(rows),
        )
        later = min((r["to"] for r in rows[cut:] if r["kind"] == "rollback" and type(r.get("to")) is int), default=None)
        self.rows = rows[:cut]
        self.checkpoints = {s: p for s, p in self.checkpoints.items() if s <= step and (later is None or s < later)}

    @property
    def last(self) -> int:
        """Steps done at the end of the recording (by its step rows)."""
        return max(self.steps) + 1 if self.steps else 0

    @property
    def last_step(self) -> int | None:
        """The newest checkpoint's step (None without one)."""
        return max(self.checkpoints) if self.checkpoints else None


def first_difference(a: RunRecording, b: RunRecording, *, from_step: int = 0) -> Difference | None:
    """The first step at which two recordings differ: rows first (in order), then the
    checkpoints both runs saved at the same step (bytes, by the one rule of
    :func:`~ckptkit.format._companions.same_checkpoint`; tensors named by
    :func:`ckptkit.audit.compare_checkpoints`). Rows and checkpoints before
    ``from_step`` are not compared (a replay starts there).

    Raises:
        FormatError: a checkpoint that differs does not verify.
    """
    rows_a = [r for r in a.rows if r["step"] >= from_step]
    rows_b = [r for r in b.rows if r["step"] >= from_step]
    d = first_row_difference(rows_a, rows_b)
    if d is not None:
        return d
    both = [s for s in set(a.checkpoints) & set(b.checkpoints) if s >= from_step]
    return first_checkpoint_difference(a.checkpoints, b.checkpoints, both)


def first_divergence_in_files(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    fields: Sequence[str] = FINGERPRINT_FIELDS,
) -> Difference | None:
    """The first step whose fingerprints differ between two history files, or None.

    Works on any JSON Lines history whose step rows carry ``step`` and the
    fingerprint ``fields`` (no reference trainer needed; a row without ``kind`` is a
    step row): ``a`` is the recording, ``b`` the run compared with it. Rows are read
    as every history is (:func:`ckptkit.run.read_rows`: a torn last line is
    dropped) and taken as :func:`~ckptkit.run.step_rows` does; only steps
    both files hold are compared (:func:`first_row_difference`).

    Raises:
        CheckpointNotFound: a file does not exist.
        FormatError: a line is not a JSON object with an integer ``step``.

    Example::

        d = first_divergence_in_files("runs/a/history.jsonl", "runs/b/history.jsonl")
        print("identical" if d is None else d.describe())
    """
    rows = []
    for path in (os.fspath(path_a), os.fspath(path_b)):
        if not os.path.isfile(path):
            raise CheckpointNotFound(f"{path}: no such history file (compare two JSON Lines histories)")
        rows.append(step_rows(read_rows(path, any_kind=True)[0]))
    both = {r["step"] for r in rows[0]} & {r["step"] for r in rows[1]}
    a, b = ([r for r in side if r["step"] in both] for side in rows)
    return first_row_difference(a, b, fields)


def rebuild_difference(row: Mapping[str, Any]) -> Difference:
    """A ``rebuild`` row (a guarded loop's ring rebuild that missed, spec/rollback.md R-R12)
    as the difference it is: the state after its step, by tensor, recorded against rebuilt."""
    given = row.get("tensors")
    tensors: dict[str, Any] = given if isinstance(given, dict) else {}
    both = {n: v for n, v in tensors.items() if isinstance(v, dict)}
    recorded = {n: v["recorded"] for n, v in both.items() if isinstance(v.get("recorded"), int)}
    rebuilt = {n: v["rebuilt"] for n, v in both.items() if isinstance(v.get("rebuilt"), int)}
    hint = (
        f"the resumed run rebuilt its rollback ring by re-running steps {row.get('from')}..{row.get('to')} and "
        f"did not land on the state the run recorded after step {row['step']}: those steps are not a "
        "function of (seed, step) in a fresh process (a draw from the global generator, OS entropy, "
        "threads); the run stopped there, as a guarded run must (spec/rollback.md R-R12)"
    )
    return Difference(
        "rebuild",
        row["step"],
        tensors=tuple(named_reports(sorted(both), recorded, rebuilt, "the resumed run's rebuild, by digest")),
        values="the recording keeps digests, not values",
        hints=(hint,),
    )


def first_checkpoint_difference(a: Mapping[int, str], b: Mapping[int, str], steps: Iterable[int]) -> Difference | None:
    """The first of ``steps`` (each a step both runs hold a checkpoint at: ``a[s]``, ``b[s]``)
    whose two checkpoints are not the same checkpoint, as :func:`checkpoint_difference` says.

    Raises:
        FormatError: a checkpoint that differs does not verify.
    """
    return next((d for s in sorted(steps) if (d := checkpoint_difference(s, a[s], b[s])) is not None), None)


def checkpoint_difference(step: int, path_a: str, path_b: str) -> Difference | None:
    """Two runs' checkpoints at ``step`` by the one rule for "the same checkpoint"
    (:func:`~ckptkit.format._companions.same_checkpoint`), or how they differ: the tensors
    and values as ``ckptkit diff --tensors`` lists them (side a first) -- or, when every
    one is equal and only the bytes differ, that the layout differs (:data:`LAYOUT_ONLY`).

    Raises:
        FormatError: a checkpoint that differs does not verify.
    """
    if same_checkpoint(path_a, path_b):
        return None
    if is_trainer_folder(path_a) and is_trainer_folder(path_b):  # by the state it holds (transformers.md R-HF09)
        diffs = compare_states(folder_state(path_a), folder_state(path_b))
        if not diffs:
            return None
    else:
        if os.path.isdir(path_a):  # a distributed checkpoint: its logical tensors, whatever the world size
            from ..distributed._storage import logical_state

            diffs = compare_states(dict(logical_state(path_a)), dict(logical_state(path_b)))
        else:
            diffs = compare_checkpoints(path_a, path_b)
        if diffs:  # a value naming the run's own directory is compared relative to it (lightning.md R-L11)
            diffs = compare_states(_run_relative(path_a), _run_relative(path_b))
            if not diffs:
                return None
    name = os.path.basename(path_a)
    if not diffs:
        return Difference(
            "checkpoint",
            step,
            file=name,
            values=f"both runs' {name}: every tensor and value is bitwise equal, only the bytes differ",
            hints=(LAYOUT_ONLY,),
        )
    return Difference(
        "checkpoint",
        step,
        tensors=tuple(tensor_reports(diffs, {})),
        file=name,
        values=f"both runs' {name}, compared as ckptkit diff --tensors does",
    )


def _run_relative(path: str) -> dict[str, Any]:
    """The checkpoint's state (a distributed checkpoint's logical state), a string naming its run
    directory or a path under it written ``{run_dir}/...``, in nested values too (a
    ``ModelCheckpoint``'s ``dirpath``, ``best_model_path``; torchtitan's job config table, whose
    ``dump_folder`` may be the run directory: torchtitan.md R-TT13)."""
    from ..format._checkpoint import load
    from ..format._tree import checkpoint_state

    folder = os.path.dirname(os.path.abspath(path))
    names = {folder, os.path.realpath(folder)}

    def relative(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: relative(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(relative(v) for v in value)
        for run in names:
            if isinstance(value, str) and (value == run or value.startswith(run + os.sep)):
                return "{run_dir}" + value[len(run) :]
        return value

    if os.path.isdir(path):
        from ..distributed._storage import logical_state

        return {k: relative(v) for k, v in logical_state(path)}
    return {k: relative(v) for k, v in checkpoint_state(load(path)).items()}


def step_fields(recorded: Mapping[str, Any]) -> list[str]:
    """A step row's compared fields: the fingerprints first, then the rest, sorted (not wall time)."""
    skip = WALL_FIELDS | {"kind", "step"}
    first = [f for f in FINGERPRINT_FIELDS if f in recorded]
    return first + sorted(k for k in recorded if k not in skip and k not in first)


def tensor_reports(
    diffs: Sequence[TensorDiff], digests: Mapping[str, tuple[int | None, int | None]]
) -> list[TensorReport]:
    """:func:`ckptkit.audit.compare_states` differences as reports, in compute order."""
    out = []
    for t in diffs:
        rec, rep = digests.get(t.name, (None, None))
        out.append(
            TensorReport(
                t.name, t.detail, rec, rep, t.n_diff if t.kind == "changed" else None, t.numel or None, t.max_abs_diff
            )
        )
    return sorted(out, key=lambda t: compute_order(t.name))
