"""The trainer's recording: a run's ``history.jsonl`` indexed by step, for replay.

A replay compares its re-run with the surviving row of each kind at each step: the
``step`` rows' fingerprints, the per-step ``digests`` and the ``checkpoint`` rows
(spec/replay.md R-P02, R-P03). Any loop's recording (``RunState.record``) is read by
:class:`ckptkit.audit.recording.RunRecording` instead; the trainer's also names the steps
it re-ran or rolled back and the environment it continued under.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointNotFound, FormatError
from ..run.history import HISTORY_FILE, read_rows

__all__ = ["Recording", "load_recording"]


@dataclass(frozen=True)
class Recording:
    """A run's ``history.jsonl``, indexed: the surviving row per step of each kind.

    After a spike rollback step numbers repeat; the later row replaces the earlier
    one (the abandoned timeline is kept in the file as a record, not replayed).
    """

    steps: Mapping[int, Mapping[str, Any]]
    digests: Mapping[int, Mapping[str, int]]
    checkpoints: Mapping[int, Mapping[str, int]]
    rollbacks: tuple[int, ...]  # steps the loop re-ran or rolled back (spike rows with an action, rollback rows)
    env_overrides: tuple[tuple[int, tuple[str, ...]], ...]
    rows: tuple[Mapping[str, Any], ...] = ()  # every row, in file order (compared in order through rollbacks)

    @property
    def last(self) -> int:
        """Steps done at the end of the recording."""
        return max(self.steps) + 1 if self.steps else 0


def load_recording(run_dir: str | os.PathLike[str]) -> Recording:
    """Read and index ``RUN/history.jsonl``.

    Raises:
        CheckpointNotFound: the run has no history.
        FormatError: a line is not a history row.
    """
    path = os.path.join(os.fspath(run_dir), HISTORY_FILE)
    if not os.path.isfile(path):
        raise CheckpointNotFound(f"{path}: no history; replay compares a re-run with the run's history.jsonl")
    rows, _torn = read_rows(path)
    steps: dict[int, Mapping[str, Any]] = {}
    digests: dict[int, Mapping[str, int]] = {}
    ckpts: dict[int, Mapping[str, int]] = {}
    rollbacks, overrides = [], []
    for r in rows:
        kind, step = r["kind"], r["step"]
        if kind == "step":
            steps[step] = r
        elif kind in ("digests", "checkpoint"):
            tensors = r.get("tensors")
            if not isinstance(tensors, dict):
                raise FormatError(f"a {kind} row at step {step} has no tensors map", path=path, field="history")
            (digests if kind == "digests" else ckpts)[step] = tensors
        elif kind == "rollback" or (kind == "spike" and r.get("action") not in (None, "warn")):
            rollbacks.append(step)  # the loop re-ran or rolled back here (spec/rollback.md): not a plain step
        elif kind == "resume" and r.get("env_overrides"):
            overrides.append((step, tuple(r["env_overrides"])))
    return Recording(steps, digests, ckpts, tuple(rollbacks), tuple(overrides), tuple(rows))
