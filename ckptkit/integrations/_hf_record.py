"""A Hugging Face ``Trainer`` run recorded as ``RunState.record`` records a loop (spec/transformers.md R-HF07..R-HF09).

:class:`Recording` sits between :class:`~ckptkit.integrations.transformers.TrainerMixin` and
``transformers.Trainer``: it adds :class:`Recorder`, a ``TrainerCallback``, and two of
Trainer's private hooks that see what no callback is shown (each micro-batch's loss, the
step's gradient norm). The recorder writes ``OUTPUT_DIR/history.jsonl`` through the run's
one :class:`~ckptkit.run.History` and ``OUTPUT_DIR/environment.json`` when a run starts, so
``ckptkit audit``, ``ckptkit replay``, ``ckptkit plot`` and the self-checking resume serve a
Trainer script as they serve a ``RunState`` loop; and it honours the audit's stop request
(``CKPTKIT_STOP_AT``): the checkpoint at that step is committed, then the process exits 75.
In a multi-process run (R-HF11) rank 0 writes both files, with rank 0's loss and batches; every
rank answers the stop request, at the same step.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from typing import Any

from ..errors import RunStopped
from ..format._checkpoint import Checkpoint
from ..run import History
from ..run._environment import Fact, capture, check_environment
from ..run._fingerprint import checkpoint_digests
from ..run._group import group_of
from ..run._history import digests_row, step_row
from ..run._preemption import StopRequests
from ..run._resume_check import ResumeCheck, check_mode, replay_command
from ._extra import missing_extra
from ._run_record import check_cadence, data_field, open_history, small_state

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ModuleNotFoundError as e:  # imported first by the public face, named in the message
    raise missing_extra(e, "ckptkit.integrations.transformers", "transformers", "transformers") from None

__all__ = ["Recorder", "Recording", "environment"]

logger = logging.getLogger(__name__)


class Recording:
    """The recording half of the Trainer integration: ``history.jsonl`` rows per optimizer step.

    Args:
        record: write the run's history (default True; False writes nothing and ignores the
            audit's stop request).
        digests_every: a ``digests`` row every this many optimizer steps; None (the default):
            after every step while the registered state is at most ``_run_record.SMALL_STATE`` bytes,
            else at each checkpoint (R-HF08).
        resume_check: what a resumed run does when the steps it re-runs differ from the rows
            the interrupted process recorded (``"error"``, ``"warn"``, ``"off"``; default
            ``$CKPTKIT_RESUME_CHECK``, else ``"error"``: spec/determinism.md R-D24).
        *args, **kwargs: the Trainer's own arguments.

    Raises:
        UnsupportedOption: ``digests_every`` is not None or an int >= 1, or ``resume_check`` is
            not one of the three.
    """

    def __init__(
        self,
        *args: Any,
        record: bool = True,
        digests_every: int | None = None,
        resume_check: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_cadence(digests_every, "R-HF08")
        mode = check_mode(resume_check)
        super().__init__(*args, **kwargs)
        self._ckptkit_recorder = Recorder(self, digests_every, mode) if record else None
        if self._ckptkit_recorder is not None:
            trainer: Any = self
            trainer.add_callback(self._ckptkit_recorder)

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Trainer's micro-batch step; its loss (what Trainer adds to its running loss) and its
        inputs are the step row's ``loss`` and ``data``."""
        loss = super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]
        if self._ckptkit_recorder is not None:
            self._ckptkit_recorder.micro_batch(loss, inputs)
        return loss

    def _get_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's gradient norm of the step (before clipping): the step row's ``grad_norm``."""
        norm = super()._get_grad_norm(*args, **kwargs)  # type: ignore[misc]
        if self._ckptkit_recorder is not None:
            self._ckptkit_recorder.grad_norm = norm
        return norm


class Recorder(transformers.TrainerCallback):
    """Writes a ``step`` row after every optimizer step and a ``digests`` row at the cadence;
    opens the history where ``train()`` begins (fresh, or set aside after the resumed step and
    compared, R-D20); answers the stop request after the checkpoint it asks for. On a rank other
    than 0 it writes nothing and only answers the stop request (R-HF11)."""

    def __init__(self, trainer: Any, every: int | None, mode: str) -> None:
        self.trainer, self.every, self.mode = trainer, every, mode
        self.history: History | None = None
        self.stops = StopRequests()
        self.stopping: str | None = None
        self.said_data = False
        self._clear()

    def _clear(self) -> None:
        self.loss: Any = None
        self.grad_norm: Any = None
        self.lr: Any = None
        self.inputs: list[Any] = []

    def micro_batch(self, loss: Any, inputs: Any) -> None:
        self.loss = loss if self.loss is None else self.loss + loss  # as Trainer sums them, from zero
        self.inputs.append(inputs)

    # ------------------------------------------------------------------ Trainer's events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Make the history this run's: a fresh one (and ``environment.json``) when ``train()``
        starts, else the resumed step's, the rows after it set aside and compared (R-D20)."""
        out = str(args.output_dir)
        self.stopping = None
        self._clear()
        if group_of(None).rank != 0:
            return  # the run's history is rank 0's
        resumed = getattr(self.trainer, "resumed_from", None)
        check = None if resumed is None else ResumeCheck(self.mode, out, replay_command(out), self._not_comparable())
        self.history, notes = open_history(out, logger, environment(), check, state.global_step)
        for note in notes:
            logger.info("resume %s: %s", resumed, note)

    def _not_comparable(self) -> str | None:
        """Why the resumed process cannot be compared with the interrupted one: it accepted
        another environment (``allow_env_change``), as ``RunState.resume`` says (R-D20)."""
        ckpt = getattr(self.trainer, "_ckptkit_resume", None)
        if ckpt is None:
            return None
        diffs = check_environment(ckpt.monitor["environment"], environment(), allow=True)
        return "the resume accepted another environment (" + "; ".join(map(str, diffs)) + ")" if diffs else None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.lr = self.trainer._get_learning_rate()  # what Trainer logs: read where Trainer reads it

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The step's rows (rank 0); a stop requested at this step count saves it and ends training (every rank)."""
        self.stopping = self.stops.reason(state.global_step)
        if self.stopping is not None:
            control.should_save = True
            control.should_training_stop = True
        if self.history is not None:
            self._write_rows(state.global_step, control)
        self._clear()

    def _write_rows(self, steps_done: int, control: Any) -> None:
        """Step ``steps_done - 1``'s row, then its digests row at the cadence; synced before a checkpoint."""
        assert self.history is not None, "on_train_begin opens the history on rank 0"
        scalars = {"loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr}
        row = step_row(steps_done - 1, {k: v for k, v in scalars.items() if v is not None})
        if self.inputs:
            self._add_data(row)
        self.history.append(row)
        if self._digest_now(steps_done, control):
            self.history.append(digests_row(steps_done, checkpoint_digests(self._state(steps_done))))
        if control.should_save:
            self.history.sync()  # every row of the steps before a checkpoint is on disk before it

    def _add_data(self, row: dict[str, Any]) -> None:
        """The step's batches as the row's ``data`` digest; a batch holding what has no digest
        (a collator's own objects) leaves the field out, said once, and training goes on."""
        self.said_data = data_field(row, self.inputs, self.said_data, logger, "R-HF07")

    def _digest_now(self, steps_done: int, control: Any) -> bool:
        """R-HF08: every ``every`` steps; by default every step while the state is small, else at each checkpoint."""
        if self.every is None:  # decided once, at the first step
            self.every = 1 if small_state(self._state(steps_done)) else 0
        if self.every == 0:
            return bool(control.should_save)
        return steps_done % self.every == 0

    def _state(self, steps_done: int) -> Checkpoint:
        """The registered state after ``steps_done`` steps, named as the commit names it: the
        weights (``model:model.*``), the optimizer, scheduler and scaler (``optim:*``)."""
        t = self.trainer
        optim: dict[str, Any] = {"optimizers": {"optimizer": t.optimizer.state_dict()}}
        optim["schedulers"] = {"lr_scheduler": t.lr_scheduler.state_dict()}
        scaler = getattr(t.accelerator, "scaler", None)
        optim["scalers"] = {} if scaler is None else {"scaler": scaler.state_dict()}
        return Checkpoint(step=steps_done, model={"model": t.model.state_dict()}, optim=optim)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After the checkpoint a stop asked for is committed: close the history and end the process (75);
        every rank ends, rank 0 says so."""
        if self.stopping is None:
            return
        folder = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if self.history is not None:
            self.history.close()
            argv = [sys.executable, *sys.argv] if sys.argv and sys.argv[0].endswith(".py") else sys.argv
            print(
                f"ckptkit: stopped at step {state.global_step} ({self.stopping}): saved {folder}; "
                f"resume with: {shlex.join(argv)}",
                file=sys.stderr,
                flush=True,
            )
        raise RunStopped(state.global_step, folder, self.stopping)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the history: a resume's verdict not yet written goes in (R-D23)."""
        if self.history is not None:
            self.history.close()


def environment() -> dict[str, Fact]:
    """The run's environment facts (what ``environment.json`` records) plus the transformers and accelerate versions."""
    from importlib.metadata import version

    return dict(
        sorted({**capture(), "transformers": transformers.__version__, "accelerate": version("accelerate")}.items())
    )
