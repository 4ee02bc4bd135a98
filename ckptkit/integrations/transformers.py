"""Hugging Face ``Trainer`` runs that resume as the same run, or refuse (spec/transformers.md).

    from ckptkit.integrations.transformers import Trainer     # instead of transformers.Trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.train()                                # checkpoint-N/: committed, every file digested
    trainer.train(resume_from_checkpoint=True)     # the newest intact one, verified and drift-checked

Install with ``pip install 'ckptkit[transformers]'``. ``Trainer`` is ``transformers.Trainer``
with :class:`TrainerMixin` first; put the mixin first in your own subclass of a Trainer
(``class MyTrainer(TrainerMixin, SFTTrainer)``) to get the same.

What changes (spec/transformers.md):

* ``checkpoint-N/`` keeps what Trainer writes (safetensors weights, model config,
  ``trainer_state.json``), drops the pickled ``training_args.bin`` for the config snapshot
  ``ckptkit.config.json``, and is committed by ``ckptkit-state.ckpt``, written last: a
  container holding the optimizer, scheduler, scaler and RNG states (Python, NumPy, torch,
  CUDA where present), the environment and the size and digest of every other file.
  No ``torch.save`` file is written; a resume unpickles nothing.
* ``train(resume_from_checkpoint=True)`` resumes the newest *intact* folder (a torn or
  damaged one is skipped, with a log line naming each problem); a path given explicitly
  must be intact. Then the resolved ``TrainingArguments`` and the model config are
  compared with the snapshot: a changed strict key is :class:`~ckptkit.errors.ConfigDrift`
  naming every one (:data:`EXEMPT` may change), and a changed environment is
  :class:`~ckptkit.errors.EnvironmentDrift` unless ``allow_env_change=True``.

Why a subclass and not a ``TrainerCallback``: a callback runs after ``_save_checkpoint``
has written its ``torch.save`` files and rotated old checkpoints, and on a resume after
Trainer has ``torch.load``-ed the optimizer, scheduler and RNG files; it can neither keep
those states out of pickle nor commit before rotation. The overrides are Trainer's own
save and load hooks (``_save_checkpoint``, ``_save_optimizer_and_scheduler``,
``_save_scaler``, ``_save_rng_state`` and their ``_load_*`` twins), private names tested
against the pinned release (``tests/integrations/test_transformers.py``).

The run is recorded (:class:`~ckptkit.integrations._hf_record.Recording`, R-HF07..R-HF09):
``OUTPUT_DIR/history.jsonl`` with a ``step`` row per optimizer step and ``digests`` rows, and
``environment.json``, so ``ckptkit audit -- CMD``, ``ckptkit replay`` and ``ckptkit plot`` serve a
Trainer script, and a resume compares the steps it re-runs with the interrupted process's rows.

Several processes (R-HF11): DDP under ``torchrun`` or ``accelerate launch`` (on CPU with
``ddp_backend="gloo"``). Rank 0 writes Trainer's files and the commit; every other rank writes
its RNG states to ``ckptkit-rng-<rank>.ckpt`` in the folder, and the commit is written only
after every rank's file is durable, so a kill of the job at any moment leaves the folder torn or
whole. A resume at another world size is refused (:class:`~ckptkit.errors.WorldSizeChanged`).

Known limits: FSDP and DeepSpeed are refused when the Trainer is built; ``TrainingArguments``
values the snapshot cannot carry (an object inside ``fsdp_config``) are refused, naming the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import math
import os
import random
import shutil
from typing import Any

from ..errors import CheckpointNotFound, LeaseLost, ResumeRefused, UnsupportedValue, WorldSizeChanged
from ..format._atomic import write_bytes_atomic
from ..format._checkpoint import Checkpoint, load, save
from ..format._snapshot import encode_snapshot, read_snapshot
from ..run._drift import check_resume
from ..run._environment import check_environment
from ..run._group import Group, group_of
from ..run._lease import launcher_pid
from ._extra import missing_extra
from ._hf_record import Recording, environment
from .hf_folder import CONFIG_FILE, CONFIG_TYPE, EXEMPT, LAYOUT, STATE_FILE, check_folder, file_record, newest_intact

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
except ModuleNotFoundError as e:  # tested in a process without transformers
    raise missing_extra(e, __name__, "transformers", "transformers") from None

__all__ = ["CONFIG_TYPE", "EXEMPT", "Trainer", "TrainerMixin", "capture_rng", "environment", "restore_rng"]

logger = logging.getLogger(__name__)

_TRAINING_ARGS_FILE = "training_args.bin"  # transformers' TRAINING_ARGS_NAME: the pickled TrainingArguments
_RANK_FILE = "ckptkit-rng-{rank}.ckpt"  # rank r >= 1's RNG states in a multi-process run (R-HF11)
_PLAIN = (type(None), bool, int, float, str, enum.Enum)


def capture_rng() -> dict[str, Any]:
    """The global RNG states Trainer's own ``rng_state.pth`` holds, as container values (no objects).

    Python's state is ``(version, 625 ints, gauss)``, NumPy's ``("MT19937", uint32[624], pos,
    has_gauss, cached_gaussian)``; their arrays are stored as int64 tensors, the rest as plain values.
    """
    import numpy as np
    import torch

    version, keys, gauss = random.getstate()
    np_state: Any = np.random.get_state()
    kind, mt, pos, has_gauss, cached = np_state
    out: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(mt.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_rng(states: dict[str, Any]) -> None:
    """Set the global RNGs to ``states`` (from :func:`capture_rng`), each as the exact object its setter takes."""
    import numpy as np
    import torch

    py, npy = states["python"], states["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.random.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def _config_table(config: Any) -> dict[str, Any]:
    """A model config as its ``config.json`` holds it (id2label's int keys become strings there too)."""
    return {} if config is None else dict(json.loads(config.to_json_string(use_diff=False)))


def _model_table(model: Any) -> dict[str, Any]:
    """The model's config as ``save_pretrained`` writes it (R-HF04): ``architectures`` and ``dtype`` are
    bookkeeping ``save_pretrained`` fills in from the model itself at every save, so they are filled in
    here the same way, and a snapshot taken before the first save agrees with one taken after it (or
    with a model ``from_pretrained`` read them back into)."""
    table = _config_table(getattr(model, "config", None))
    if table and isinstance(model, transformers.PreTrainedModel):
        table["architectures"] = [type(model).__name__.removeprefix("FSDP")]
        table["dtype"] = str(model.dtype).removeprefix("torch.")
    return table


def _defaults(args: Any, model: Any) -> dict[str, Any]:
    """The declared defaults of TrainingArguments and of the model's config class (R-S09): a key a newer
    transformers adds compares at its default."""
    out = {f"args.{f.name}": f.default for f in dataclasses.fields(args) if f.init and _plain(f.default)}
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in _config_table(type(config)()).items():
            out[f"model.{key}"] = value
    return out


def _plain(value: Any) -> bool:
    return math.isfinite(value) if isinstance(value, float) else isinstance(value, _PLAIN)


class TrainerMixin(Recording):
    """Trainer save and load hooks that commit each ``checkpoint-N/`` with ckptkit and resume only the same run.

    Args:
        allow_env_change: resume although the environment changed (the differences are logged).
        record, digests_every, resume_check: the run's ``history.jsonl`` (:class:`Recording`, R-HF07).
        *args, **kwargs: the Trainer's own arguments.

    Raises:
        UnsupportedValue: a setup this mixin does not cover (FSDP, DeepSpeed), or a
            ``TrainingArguments`` / model config value the snapshot cannot carry.
    """

    def __init__(self, *args: Any, allow_env_change: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_env_change = allow_env_change
        self._ckptkit_resume: Checkpoint | None = None
        self._ckptkit_rng: dict[str, Any] | None = None  # this rank's RNG states to restore
        self._ckptkit_launcher = launcher_pid()  # this rank's torchrun agent; None outside torchrun
        #: The ``checkpoint-N/`` folder the last ``train()`` resumed from (None: it started).
        self.resumed_from: str | None = None
        self._ckptkit_config = self.run_config()
        trainer: Any = self
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            raise UnsupportedValue(
                "ckptkit.integrations.transformers covers one process and DDP (torchrun or accelerate launch), "
                f"not {'FSDP' if trainer.is_fsdp_enabled else 'DeepSpeed'} (R-HF11): train without it, or save "
                "the run with ckptkit.RunState and a DCP store (ckptkit.distributed)"
            )
        encode_snapshot(self._ckptkit_config)  # a config the snapshot cannot carry is refused now, not at a save

    @property
    def _ckptkit_group(self) -> Group:
        """The run's processes: rank 0 decides and commits, every rank agrees (one process: plain calls)."""
        return group_of(None)

    def run_config(self) -> dict[str, Any]:
        """The run's config: ``{"args": TrainingArguments.to_dict(), "model": the model's config.json table}``."""
        trainer: Any = self
        return {"args": trainer.args.to_dict(), "model": _model_table(trainer.model)}

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming only an intact checkpoint of the same run.

        Args:
            resume_from_checkpoint: ``True`` for the newest intact ``checkpoint-N/`` of
                ``output_dir`` (damaged and torn ones are skipped and logged), a folder
                (which must be intact), or None/False to start.

        Raises:
            CheckpointNotFound: nothing intact to resume (every problem is in the message).
            ConfigDrift: a strict key of the config differs from the snapshot (all are named).
            EnvironmentDrift: the environment differs and ``allow_env_change`` is False.
            FormatError: the folder named is damaged (the first problem; ``ckptkit verify`` lists all).
        """
        # Taken once per train(): its saves write this table, whatever Trainer changes on the model after it.
        self._ckptkit_config = self.run_config()
        group = self._ckptkit_group
        folder = group.from_rank0(lambda: self._resume_folder(resume_from_checkpoint), "choosing the checkpoint")
        self._ckptkit_resume = None
        if folder is not None:
            self._ckptkit_resume = group.agree(lambda: self._check_resume(folder), f"checking {folder}")
        self.resumed_from = folder
        try:
            return super().train(folder, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._ckptkit_resume = self._ckptkit_rng = None

    def _resume_folder(self, wanted: str | bool | None) -> str | None:
        trainer: Any = self
        if wanted is None or wanted is False:
            return None
        if wanted is True:
            output_dir = str(trainer.args.output_dir)
            folder, skipped = newest_intact(output_dir) if os.path.isdir(output_dir) else (None, [])
            for check in skipped:
                for problem in check.problems:
                    logger.warning("skipping %s: %s", check.path, problem)
            if folder is None:
                lines = [f"{output_dir}: no intact checkpoint-N folder to resume from"]
                lines += [f"  {p}" for c in skipped for p in c.problems]
                raise CheckpointNotFound("\n".join(lines))
            return folder
        path = os.fspath(wanted)
        if not os.path.isdir(path):  # transformers' words too: scripts and its own tests match them
            raise CheckpointNotFound(
                f'{path}: no such checkpoint folder (transformers: "Can\'t find a valid checkpoint at {path}"); '
                "name an existing checkpoint-N folder, or pass resume_from_checkpoint=True to resume the newest "
                "intact one in output_dir"
            )
        check = check_folder(path)
        if check.problems:
            raise check.problems[0]
        return check.path

    def _check_resume(self, folder: str) -> Checkpoint:
        """Load the commit (and this rank's RNG file) and refuse another world, run config or environment."""
        trainer: Any = self
        state = load(os.path.join(folder, STATE_FILE))
        self._ckptkit_rng = self._rank_rng(folder, state)
        if state.optim is None:
            raise ResumeRefused(
                f"{folder}: saved with save_only_model=True: it holds no optimizer, scheduler or RNG state, so "
                "a resume would not continue the same run; start a new run from its weights instead"
            )
        snapshot = read_snapshot(os.path.join(folder, CONFIG_FILE))
        for d in check_resume(
            snapshot, self.run_config(), exempt=EXEMPT, defaults=_defaults(trainer.args, trainer.model)
        ):
            logger.info("resume %s: %s", folder, d.describe())
        for e in check_environment(state.monitor["environment"], environment(), allow=self.allow_env_change):
            logger.warning("resume %s: environment: %s", folder, e)
        return state

    def _rank_rng(self, folder: str, state: Checkpoint) -> dict[str, Any]:
        """This rank's RNG states in ``folder``: rank 0's are the commit's, rank r's its file's (R-HF11)."""
        group = self._ckptkit_group
        saved = state.monitor.get("world_size")
        if saved != group.world:
            raise WorldSizeChanged(
                f"{folder}: saved by {saved} process(es), resumed by {group.world}; each rank's RNG states and its "
                f"share of the data continue the same run only at the world size it was saved at: start the job "
                f"with {saved} process(es) (torchrun --nproc-per-node {saved}), or begin a new run (R-HF11)",
                {"world_size": saved},
                {"world_size": group.world},
            )
        if group.rank == 0:
            return dict(state.monitor["rng"])
        # Rank 0 checked the folder: this file's size and digest are the commit's record of it (R-HF03).
        return dict(load(os.path.join(folder, _RANK_FILE.format(rank=group.rank))).monitor["rng"])

    # ------------------------------------------------------------------ save: Trainer's hooks

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's save, every rank's RNG file, then (rank 0) the snapshot and the commit, then rotation
        (after the commit, not before). Each step is agreed: no rank goes on before every rank did it (R-HF11)."""
        trainer: Any = self
        group = self._ckptkit_group
        run_dir = trainer._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
        group.agree(lambda: self._may_write(folder), f"discarding what {folder} held")
        limit, trainer.args.save_total_limit = trainer.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            trainer.args.save_total_limit = limit
        group.agree(lambda: self._save_rank_rng(folder), f"writing each rank's RNG states to {folder}")
        group.on_rank0(lambda: self._finish(folder, run_dir, limit), f"committing {folder}")

    def _may_write(self, folder: str) -> None:
        """Before anything is written: this rank's launcher lives (a job whose torchrun agent was killed
        stops, so a job started again on ``output_dir`` is its one writer), and rank 0 removes what a torn
        save left at this step."""
        rank = self._ckptkit_group.rank
        if self._ckptkit_launcher is not None and os.getppid() != self._ckptkit_launcher:
            raise LeaseLost(
                f"{folder}: this rank's launcher (pid {self._ckptkit_launcher}) is gone: rank {rank} "
                "stops before saving, without writing (R-HF11)"
            )
        if rank == 0:
            _discard(folder)

    def _save_rank_rng(self, folder: str) -> None:
        """Rank r >= 1 writes its RNG states to ``ckptkit-rng-<r>.ckpt``, durably (rank 0's go into the commit)."""
        trainer: Any = self
        rank = self._ckptkit_group.rank
        if rank == 0:
            return
        os.makedirs(folder, exist_ok=True)
        monitor = {"layout": LAYOUT, "rank": rank, "rng": capture_rng()}
        ckpt = Checkpoint(step=trainer.state.global_step, monitor=monitor)
        save(os.path.join(folder, _RANK_FILE.format(rank=rank)), ckpt)

    def _finish(self, folder: str, run_dir: str, limit: int | None) -> None:
        """Rank 0, once every rank's files are written: the snapshot, the commit, then rotation."""
        trainer: Any = self
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, _TRAINING_ARGS_FILE))  # a pickle; the snapshot says the same
        write_bytes_atomic(os.path.join(folder, CONFIG_FILE), encode_snapshot(self._ckptkit_config, CONFIG_TYPE))
        self._commit(folder)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
            use_mtime=True,
        )

    def _commit(self, folder: str) -> None:
        """Write ``ckptkit-state.ckpt`` last: the states, the environment and every file's digest (R-HF02)."""
        trainer: Any = self
        optim = None
        if not trainer.args.save_only_model:
            optim = {"optimizers": {"optimizer": trainer.optimizer.state_dict()}}
            optim["schedulers"] = {"lr_scheduler": trainer.lr_scheduler.state_dict()}
            scaler = getattr(trainer.accelerator, "scaler", None)
            optim["scalers"] = {} if scaler is None else {"scaler": scaler.state_dict()}
        monitor = {
            "layout": LAYOUT,
            "files": file_record(folder, durable=True),
            "rng": capture_rng(),
            "environment": environment(),
            "world_size": self._ckptkit_group.world,
        }
        save(os.path.join(folder, STATE_FILE), Checkpoint(step=trainer.state.global_step, optim=optim, monitor=monitor))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Nothing here: the optimizer and scheduler go into the commit, not into ``torch.save`` files."""

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing here: the scaler goes into the commit."""

    def _save_rng_state(self, output_dir: str) -> None:
        """Nothing here: the RNG states go into the commit."""

    # ------------------------------------------------------------------ load: Trainer's hooks

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Restore the optimizer and scheduler from the verified commit (no ``torch.load``)."""
        trainer: Any = self
        if checkpoint is None or self._ckptkit_resume is None:
            return
        optim = self._ckptkit_resume.optim
        trainer.optimizer.load_state_dict(optim["optimizers"]["optimizer"])
        trainer.lr_scheduler.load_state_dict(optim["schedulers"]["lr_scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Restore the gradient scaler, when the run has one."""
        trainer: Any = self
        scaler = getattr(trainer.accelerator, "scaler", None)
        if checkpoint is None or self._ckptkit_resume is None or scaler is None:
            return
        scaler.load_state_dict(self._ckptkit_resume.optim["scalers"]["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Restore this rank's global RNGs where Trainer restores them (after skipping a resumed epoch's batches)."""
        if checkpoint is not None and self._ckptkit_rng is not None:
            restore_rng(self._ckptkit_rng)


def _discard(folder: str) -> None:
    """Remove a folder left at this step by a torn save or an abandoned branch: uncommit it first, so a crash
    half-way through the removal leaves a torn folder, never a committed one with other files."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, STATE_FILE))
    shutil.rmtree(folder, ignore_errors=True)


class Trainer(TrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints ckptkit commits, verifies and drift-checks (:class:`TrainerMixin`).

    Example::

        trainer = Trainer(model=model, args=TrainingArguments("out", seed=1, full_determinism=True), train_dataset=ds)
        trainer.train(resume_from_checkpoint=True)
    """
