"""A Lightning run recorded as ``RunState.record`` records a loop (spec/lightning.md R-L09, R-L10).

The plug-in's callback role calls :class:`Recorder` from Lightning's hooks. It writes
``RUN_DIR/history.jsonl`` through the run's one :class:`~ckptkit.run.History` and
``RUN_DIR/environment.json`` when a fresh ``fit`` starts, ``RUN_DIR`` being the folder the
``ModelCheckpoint`` writes to, so ``ckptkit audit``, ``ckptkit replay``, ``ckptkit plot`` and the
self-checking resume serve a Lightning script as they serve a ``RunState`` loop. The audit
stops such a script as a crash would (spec/replay.md R-P18): this recorder takes no stop request.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..format._checkpoint import Checkpoint
from ..run import History
from ..run._environment import Fact, capture
from ..run._fingerprint import checkpoint_digests
from ..run._history import digests_row, step_row
from ..run._resume_check import ResumeCheck, check_mode, replay_command
from ._run_record import check_cadence, data_field, open_history, small_state

__all__ = ["Recorder", "environment", "run_dir"]

logger = logging.getLogger(__name__)


def run_dir(trainer: Any) -> str:
    """The run's directory: where its ``ModelCheckpoint`` writes (resolved by Lightning at setup),
    else the trainer's ``default_root_dir``."""
    callback = getattr(trainer, "checkpoint_callback", None)
    folder = getattr(callback, "dirpath", None)
    return str(os.fspath(folder) if folder else os.fspath(trainer.default_root_dir))


class Recorder:
    """Writes a ``step`` row after every optimizer step and a ``digests`` row at the cadence;
    opens the history where training starts (fresh, or set aside after the resumed step and
    compared, R-D20)."""

    def __init__(self, every: int | None, resume_check: str | None) -> None:
        check_cadence(every, "spec/lightning.md R-L10")
        self.every, self.mode = every, check_mode(resume_check)
        self.history: History | None = None
        self.said_data = False
        self._steps = 0
        self._clear()

    def _clear(self) -> None:
        self.loss: Any = None
        self.lr: Any = None
        self.batches: list[Any] = []

    def start(self, trainer: Any) -> None:
        """Make the history this run's: a fresh one (and ``environment.json``) when ``fit`` starts
        from nothing, else the resumed step's, the rows after it set aside and compared (R-D20)."""
        out = run_dir(trainer)
        self._steps = int(trainer.global_step)
        self._clear()
        check = None if trainer.ckpt_path is None else ResumeCheck(self.mode, out, replay_command(out), None)
        self.history, notes = open_history(out, logger, environment(), check, self._steps)
        for note in notes:
            logger.info("resume %s: %s", trainer.ckpt_path, note)

    def before_optimizer_step(self, optimizer: Any) -> None:
        """The learning rate the step uses (the first parameter group's), before a scheduler moves it."""
        self.lr = optimizer.param_groups[0]["lr"]

    def batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any) -> None:
        """Sum the batch's loss; once the optimizer has stepped, the step's rows."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            loss = loss.detach()
            self.loss = loss if self.loss is None else self.loss + loss
        self.batches.append(batch)
        if self.history is None or int(trainer.global_step) == self._steps:
            return  # gradient accumulation: the optimizer has not stepped yet
        self._steps = int(trainer.global_step)
        scalars = {"loss": self.loss, "lr": self.lr}
        row = step_row(self._steps - 1, {k: v for k, v in scalars.items() if v is not None})
        self._add_data(row)
        self.history.append(row)
        if self._digest_now(trainer, pl_module):
            self.history.append(digests_row(self._steps, checkpoint_digests(state(trainer, pl_module, self._steps))))
        self._clear()

    def _add_data(self, row: dict[str, Any]) -> None:
        """The step's batches as the row's ``data`` digest; a batch holding what has no digest
        leaves the field out, said once, and training goes on."""
        self.said_data = data_field(row, self.batches, self.said_data, logger, "spec/lightning.md R-L09")

    def _digest_now(self, trainer: Any, pl_module: Any) -> bool:
        """R-L10: every ``every`` steps; by default every step while the state is small, else at
        each checkpoint (:meth:`saving`)."""
        if self.every is None:  # decided once, at the first step
            self.every = 1 if small_state(state(trainer, pl_module, self._steps)) else 0
        return self.every != 0 and self._steps % self.every == 0

    def saving(self, trainer: Any, pl_module: Any) -> None:
        """A checkpoint is being built: under the checkpoint cadence, its state's ``digests`` row;
        every row before it on disk before the checkpoint is."""
        if self.history is None:
            return
        if self.every == 0:
            steps = int(trainer.global_step)
            self.history.append(digests_row(steps, checkpoint_digests(state(trainer, pl_module, steps))))
        self.history.sync()

    def close(self) -> None:
        """Close the history: a resume's verdict not yet written goes in (R-D23)."""
        if self.history is not None:
            self.history.close()
            self.history = None


def state(trainer: Any, pl_module: Any, steps_done: int) -> Checkpoint:
    """The state a resume restores after ``steps_done`` steps, named as the plug-in's container
    names it: the weights ``model:state_dict.*``, the optimizers and schedulers ``optim:*``."""
    optim: dict[str, Any] = {"optimizer_states": [opt.state_dict() for opt in trainer.optimizers]}
    schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
    if schedulers:
        optim["lr_schedulers"] = schedulers
    return Checkpoint(step=steps_done, model={"state_dict": pl_module.state_dict()}, optim=optim)


def environment() -> dict[str, Fact]:
    """The run's environment facts (what ``environment.json`` records) plus Lightning's version."""
    import lightning

    return dict(sorted({**capture(), "lightning": lightning.__version__}.items()))
