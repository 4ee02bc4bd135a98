"""A torchtitan run recorded as ``RunState.record`` records a loop (spec/torchtitan.md R-TT11..R-TT13).

The loop is torchtitan's (``Trainer.train`` or one of its shape); ckptkit is present in it as
the ``CheckpointManager``, which torchtitan calls at ``load()`` and after every step
(``save(step)``). So the manager records there: :class:`Recorder` opens the run's history in
the checkpoint folder when ``load()`` returns (fresh, with ``environment.json``, or the
resumed step's, the rows after it set aside and compared, spec/determinism.md R-D20), and at
``save(step)`` writes the step's ``step`` row -- with the scalars the loop handed to
``CheckpointManager.record_step`` -- and, at the cadence, a ``digests`` row of the state the
manager holds. Rank 0 writes the history, as a distributed ``RunState`` does; every rank builds
the state dicts a digest reads, as every rank does for a save.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..format._checkpoint import Checkpoint
from ..format._tree import localized
from ..run import History
from ..run._environment import Fact, capture
from ..run._fingerprint import checkpoint_digests
from ..run._history import digests_row, step_row
from ..run._resume_check import ResumeCheck, replay_command
from ._run_record import data_field, open_history, small_state

__all__ = ["Recorder", "environment"]

logger = logging.getLogger(__name__)

#: The rule a row without its data digest names.
_RULE = "spec/torchtitan.md R-TT11"


class Recorder:
    """The run's ``history.jsonl`` rows, written from the manager's ``load()`` and ``save(step)``.

    Args:
        folder: the manager's checkpoint folder (the run directory).
        rank: this process's rank; only rank 0 writes.
        every: a ``digests`` row every this many steps; None: every step while the state is
            small, else at each checkpoint (R-TT12).
        mode: the resume check's mode (spec/determinism.md R-D24).
        state: the state a checkpoint of ``steps_done`` steps holds, named as the digests name it.
    """

    def __init__(
        self, folder: str, rank: int, every: int | None, mode: str, state: Callable[[int], Checkpoint]
    ) -> None:
        self.folder, self.rank, self.every, self.mode, self.state = folder, rank, every, mode, state
        self.history: History | None = None
        self.said_data = False
        self.scalars: dict[str, Any] = {}
        self.data: Any = None

    def start(self, resumed: int | None) -> None:
        """Make the history this run's: a fresh one when nothing of this folder was loaded, else
        the resumed step's (``resumed``), the rows after it set aside and compared."""
        if self.rank != 0:
            return
        check = None if resumed is None else ResumeCheck(self.mode, self.folder, replay_command(self.folder), None)
        self.history, notes = open_history(self.folder, logger, environment(), check, resumed or 0)
        for note in notes:
            logger.info("resume step-%s: %s", resumed, note)

    def step(self, steps_done: int, saving: bool) -> None:
        """Step ``steps_done - 1``'s row; its ``digests`` row at the cadence (a checkpoint's step
        under the checkpoint cadence); every row on disk before a checkpoint is written."""
        if self.history is None and self.rank == 0:
            self.start(None)  # a loop that never called load(): a fresh run
        if self.every is None:  # decided once, at the first step, alike on every rank
            self.every = 1 if small_state(self.state(steps_done)) else 0
        digest = saving if self.every == 0 else steps_done % self.every == 0
        state = self.state(steps_done) if digest else None  # on every rank: a state dict may be collective
        if self.history is not None:
            row = step_row(steps_done - 1, self.scalars)
            if self.data is not None:
                self.said_data = data_field(row, self.data, self.said_data, logger, _RULE)
            self.history.append(row)
            if state is not None:
                self.history.append(digests_row(steps_done, checkpoint_digests(localized(state))))
            if saving:
                self.history.sync()
        self.scalars, self.data = {}, None

    def close(self) -> None:
        """Close the history: a resume's verdict not yet written goes in (R-D23)."""
        if self.history is not None:
            self.history.close()
            self.history = None


def environment() -> dict[str, Fact]:
    """The run's environment facts (what ``environment.json`` records) plus torchtitan's version."""
    from importlib.metadata import version

    return dict(sorted({**capture(), "torchtitan": version("torchtitan")}.items()))
