"""A torchtitan checkpoint manager whose checkpoints are ckptkit's: no pickle, all ranks commit or none,
every byte verified, and a resume that is the same run or a hard error (spec/torchtitan.md).

Select it in the job config (``pip install 'ckptkit[torchtitan]'``)::

    from ckptkit.integrations.torchtitan import CheckpointManager

    config = llama3_debugmodel()                       # any Trainer.Config
    config.checkpoint = CheckpointManager.Config(enable=True, interval=500, async_mode="async")

torchtitan's ``Trainer`` builds it through that nested ``Config`` (``config.checkpoint.build(...)``);
nothing in torchtitan is patched. It is torchtitan's ``CheckpointManager`` with four hooks replaced:

* ``dcp_save`` writes through :class:`ckptkit.distributed.Writer` -- synchronously, or with
  ``async_mode="async"`` in the background on the manager's own gloo group (R-TT01, R-TT02);
  ``async_with_pinned_mem`` is refused when the config is made (R-TT03);
* ``dcp_load`` first compares the job config with the checkpoint's snapshot (R-TT06), then
  reads through :class:`ckptkit.distributed.Reader` (every key, shape and dtype checked first);
* ``_find_load_step`` finds ckptkit checkpoints (``step-N/metadata.ckdcp``), skips an
  uncommitted one, and refuses a folder whose newest checkpoint is DCP's pickled format,
  so ``load()`` never starts from step 0 beside a checkpoint it did not see (R-TT04);
* the dataloader's state is stored as a plain tree, not the ``pickle.dumps`` bytes torchtitan's
  ``ParallelAwareDataloader`` keeps, and restored without ``pickle.loads`` (R-TT08).

And it records the run where torchtitan calls it (R-TT11..R-TT13): ``load()`` opens the run's
``history.jsonl`` in the checkpoint folder (fresh, with ``environment.json``, or the resumed
step's, compared as the steps are re-run), ``save(step)`` writes the step's row -- with what the
loop handed to :meth:`CheckpointManager.record_step` -- and the state's digests, and a save at
the audit's stop request (``CKPTKIT_STOP_AT``) ends the process with exit 75 once committed.

The job config is ``Trainer.Config`` itself: the manager reads it from the ``train_state`` the
trainer registers (the trainer, whose ``.config`` it is), or from ``job_config=`` for a loop of
your own. Its table (``_torchtitan_config.job_table``) is stored in every checkpoint under
:data:`SNAPSHOT_KEY` (R-TT05).

Known limits: local folders only (``checkpoint.folder`` as a URL is refused when the manager is
built, R-TT10: its resume lists a local folder, and would read a URL's as empty);
``initial_load_path`` must be a ckptkit checkpoint or, with ``initial_load_in_hf``, Hugging Face
safetensors (a DCP default-backend checkpoint is refused: it is pickle); a final
``last_save_in_hf`` export is torchtitan's own safetensors writer, never a resume point.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..distributed._format import METADATA_NAME, read_metadata
from ..distributed._save_load import load as ckd_load
from ..distributed._save_load import save as ckd_save
from ..distributed._save_load import translate
from ..distributed._storage import Writer
from ..errors import MalformedIndex, ResumeRefused, RunStopped, StateMismatch, UnsupportedOption, UnsupportedValue
from ..format._checkpoint import Checkpoint
from ..format._place import local_only
from ..format._section import check_plain
from ..run._preemption import StopRequests
from ..run._resume_check import check_mode
from ._extra import missing_extra
from ._run_record import check_cadence
from ._torchtitan_config import EXEMPT_KEYS, EXEMPT_TABLES, STRICT_KEYS, check_job, job_table
from ._torchtitan_record import Recorder

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtitan.components.checkpoint import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, TRAIN_STATE, AsyncMode
    from torchtitan.components.checkpoint import CheckpointManager as _TorchtitanManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.tools.logging import logger
except ModuleNotFoundError as e:  # tested in a process without torchtitan
    raise missing_extra(e, __name__, "torchtitan", "torchtitan") from None

__all__ = [
    "EXEMPT_KEYS",
    "EXEMPT_TABLES",
    "SNAPSHOT_KEY",
    "STRICT_KEYS",
    "CheckpointManager",
    "DataLoaderState",
    "find_load_step",
]

#: The DCP key under which every checkpoint stores the job config's snapshot table (R-TT05).
SNAPSHOT_KEY = "ckptkit_job_config"
_STEP = re.compile(r"step-(\d+)")
_DCP_DEFAULT = ".metadata"  # DCP's FileSystemWriter: pickled metadata
#: Set by torchrun in the ranks it starts. torchrun reports a rank's exit 75 as a failure (exit 1),
#: so under it the stop request is not taken: the audit stops the job as a crash would (R-TT13).
_TORCHRUN = "TORCHELASTIC_RUN_ID"
_HF_INDEX = "model.safetensors.index.json"


def find_load_step(folder: str, log: Callable[[str], None] = print) -> int:
    """The newest committed ckptkit checkpoint ``step-N`` in ``folder``, or -1 when it has none (R-TT04).

    A ``step-N`` directory without ``metadata.ckdcp`` did not commit (a save was killed) and is
    skipped, said through ``log``; so is a final Hugging Face export.

    Raises:
        ResumeRefused: the newest checkpoint in ``folder`` is one torchtitan's default manager
            wrote (DCP's pickled format, which ckptkit never reads).
        UnsupportedOption: ``folder`` is a URL (R-TT10).
    """
    _local(folder)
    if not os.path.isdir(folder):
        return -1
    ours: list[int] = []
    foreign: list[int] = []
    skipped: list[str] = []
    for name in sorted(os.listdir(folder)):
        m = _STEP.fullmatch(name)
        if not m:
            continue
        path = os.path.join(folder, name)
        if os.path.isfile(os.path.join(path, METADATA_NAME)):
            ours.append(int(m.group(1)))
        elif os.path.isfile(os.path.join(path, _DCP_DEFAULT)):
            foreign.append(int(m.group(1)))
        elif not os.path.isfile(os.path.join(path, _HF_INDEX)):
            skipped.append(name)
    newest = max(ours, default=-1)
    if foreign and max(foreign) > newest:
        raise ResumeRefused(
            f"{os.path.join(folder, f'step-{max(foreign)}')}: a checkpoint in DCP's default (pickled) format, newer "
            f"than any ckptkit checkpoint in {folder}; ckptkit's torchtitan manager never reads pickle and will not "
            "silently resume from an older step or from step 0: resume it with torchtitan's own CheckpointManager, "
            "or move it out of the folder (R-TT04)"
        )
    for name in skipped:
        log(f"ckptkit: {os.path.join(folder, name)} did not commit (no {METADATA_NAME}); not a resume point (R-TT04)")
    return newest


def _local(folder: str) -> None:
    """Refuse a checkpoint folder on a URL, which the listing above would read as empty (R-TT10)."""
    local_only(
        folder,
        "ckptkit's torchtitan CheckpointManager",
        option="checkpoint.folder ",
        why=": it finds the step to resume by listing a local folder, so this one would read as empty and the "
        "run would start again at step 0 (R-TT10); use a local (or mounted) directory, or torchtitan's own "
        "CheckpointManager for fsspec storage",
    )


class CheckpointManager(_TorchtitanManager):
    """torchtitan's ``CheckpointManager``, storing through ckptkit (the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TorchtitanManager.Config):
        """torchtitan's checkpoint options, each meaning what it means there (R-TT03 refuses one value),
        and the run's recording (R-TT11, R-TT12)."""

        record: bool = True
        """Write the run's ``history.jsonl`` and ``environment.json`` in the checkpoint folder (R-TT11)."""
        digests_every: int | None = None
        """A ``digests`` row every this many steps; None: every step while the state is at most 64 MiB,
        else at each checkpoint (R-TT12)."""
        resume_check: str | None = None
        """A resume's check of the steps it re-runs: ``error``, ``warn`` or ``off``; None:
        ``$CKPTKIT_RESUME_CHECK``, else ``error`` (spec/determinism.md R-D24)."""

        def __post_init__(self) -> None:
            _TorchtitanManager.Config.__post_init__(self)
            check_cadence(self.digests_every, "spec/torchtitan.md R-TT12")
            check_mode(self.resume_check)
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
                raise UnsupportedOption(
                    "checkpoint.async_mode='async_with_pinned_mem': DCP runs that save in another process, which "
                    "ckptkit's writer does not serve (R-TT03); use async_mode='async' (a background thread on the "
                    "manager's own gloo group) or 'disabled'"
                )

    def __init__(self, config: Config, *, job_config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        _local(self.folder)  # when the run starts, not at its first save
        job = job_config if job_config is not None else getattr(self.states.get(TRAIN_STATE), "config", None)
        if job is None:
            raise UnsupportedOption(
                "ckptkit's torchtitan CheckpointManager needs the job config, to store it with every checkpoint and "
                "compare it on resume (R-TT05): torchtitan's Trainer passes itself as states['train_state'] (its "
                ".config is the job config); a loop of your own passes job_config= to config.checkpoint.build(...)"
            )
        self.job_table = job_table(job)  # refused here, before step 1, when it cannot be stored
        if self.states.get(DATALOADER) is not None:
            self.states[DATALOADER] = DataLoaderState(self.states[DATALOADER])
        self._resumed: int | None = None  # the step load() resumed from this folder
        self._stops, self._stopping = StopRequests(), ""
        rank = dist.get_rank() if dist.is_initialized() else 0
        mode = check_mode(config.resume_check)
        self._recorder = (
            Recorder(os.path.normpath(self.folder), rank, config.digests_every, mode, self._state)
            if config.record
            else None
        )

    def record_step(self, *, data: Any = None, **scalars: Any) -> None:
        """The scalars (``loss``, ``grad_norm``, ...: numbers, strings, bools or one-element
        tensors) and, optionally, the batch of the step the next ``save(step)`` ends: its
        ``step`` row holds them, floats with their exact bits (R-TT11). Call it on every rank
        (rank 0's are recorded) before ``save``; a step without it is recorded without scalars.

        Raises:
            TypeError: at ``save``, a scalar no row can hold, or one named ``kind``, ``step``,
                ``rerun`` or ``*_bits``.
        """
        if self._recorder is not None:
            self._recorder.scalars, self._recorder.data = scalars, data

    def load(self, step: int = -1) -> bool:
        """torchtitan's ``load``; then the run's history opens: the resumed step's when a
        checkpoint of this folder was loaded, else a fresh one (R-TT11)."""
        self._resumed = None
        loaded = bool(super().load(step))
        if self.enable and self._recorder is not None:
            self._recorder.start(self._resumed if loaded else None)
        return loaded

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        """torchtitan's ``save``, after step ``curr_step``'s rows (R-TT11); at the audit's stop
        request (``CKPTKIT_STOP_AT=curr_step``; not under torchrun) the checkpoint is saved and
        committed, then the process ends with exit 75 (:class:`~ckptkit.RunStopped`, R-TT13)."""
        if not self.enable:
            return False
        taken = not self.load_only and _TORCHRUN not in os.environ  # a load-only manager never saves
        self._stopping = (self._stops.reason(curr_step) if taken else None) or ""
        if self._recorder is not None:
            self._recorder.step(curr_step, self._should_save(curr_step, last_step))
        saved = bool(super().save(curr_step, last_step))
        if self._stopping:
            self._stop(curr_step)
        return saved

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return bool(super()._should_save(curr_step, last_step)) or bool(self._stopping)

    def _stop(self, curr_step: int) -> None:
        """The stop request's checkpoint has committed: close the history and end the process."""
        self.maybe_wait_for_saving()
        if self._recorder is not None:
            self._recorder.close()
        folder = os.path.join(self.folder, f"step-{curr_step}")
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(f"ckptkit: stopped at step {curr_step} ({self._stopping}): saved {folder}")
        raise RunStopped(curr_step, folder, self._stopping)

    def _state(self, steps_done: int) -> Checkpoint:
        """The state a checkpoint after ``steps_done`` steps holds, as the digests name it: the
        weights ``model:<fqn>``, the optimizer and LR schedule ``optim:optimizer.*``,
        ``optim:lr_scheduler.*``, every other state (the dataloader, ``train_state``) ``monitor:<key>.*``."""
        own = (MODEL, OPTIMIZER, LR_SCHEDULER)
        model = self.states[MODEL].state_dict() if MODEL in self.states else {}
        optim = {k: self.states[k].state_dict() for k in own[1:] if self.states.get(k) is not None}
        monitor = {k: v.state_dict() for k, v in self.states.items() if k not in own and hasattr(v, "state_dict")}
        return Checkpoint(step=steps_done, model=model, optim=optim, monitor=monitor)

    def close(self) -> None:
        """torchtitan's ``close``; the run's history is closed too."""
        recorder = getattr(self, "_recorder", None)
        if recorder is not None:
            recorder.close()
        super().close()

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | None:
        """Save ``state_dict`` and the job config's table into the ckptkit checkpoint ``checkpoint_id``.

        Returns:
            For ``async_mode="async"``, the future of the background save (its failure is the
            ckptkit error of the failing rank); else None, once every rank committed.

        Raises:
            CheckpointError: as :func:`ckptkit.distributed.save` (synchronous saves and staging).
        """
        if to_hf:  # the final model-only safetensors export: torchtitan's writer, no pickle either
            exported: Future[Any] | None = super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
            return exported
        state = {**state_dict, SNAPSHOT_KEY: (self.job_table,)}  # a tuple: one plain value, never flattened
        result: Future[Any] | None = None
        if async_mode == AsyncMode.ASYNC:
            result = self._async_save(state, checkpoint_id)
        else:
            ckd_save(state, checkpoint_id, overwrite=True)
        if enable_garbage_collection:
            from torchtitan.tools.utils import GarbageCollection

            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def _async_save(self, state: dict[str, Any], checkpoint_id: str) -> Future[Any]:
        writer = Writer(checkpoint_id, overwrite=True)
        try:
            pending = dcp.async_save(state, storage_writer=writer, process_group=self.pg)
        except CheckpointException as e:
            raise translate(e, writer) from None
        assert isinstance(pending, Future), "dcp.async_save without a stager returns a Future"
        done: Future[Any] = Future()

        def settle(f: Future[Any]) -> None:
            e = f.exception()
            if e is None:
                done.set_result(f.result())
            else:
                done.set_exception(translate(e, writer) if isinstance(e, CheckpointException) else e)

        pending.add_done_callback(settle)
        return done

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load the ckptkit checkpoint ``checkpoint_id`` into ``state_dict``; a resume from this
        run's folder first compares the job config with the checkpoint's (R-TT06).

        Raises:
            ConfigDrift: a strict key differs (every one listed); nothing was loaded.
            MalformedIndex: a checkpoint in this run's folder without a job config snapshot.
            CheckpointError: as :func:`ckptkit.distributed.load`.
        """
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        if os.path.normpath(os.path.dirname(os.path.normpath(checkpoint_id))) == os.path.normpath(self.folder):
            self._check_job(checkpoint_id)
            m = _STEP.fullmatch(os.path.basename(os.path.normpath(checkpoint_id)))
            self._resumed = int(m.group(1)) if m else None
        ckd_load(state_dict, checkpoint_id)
        if MODEL in self.states:  # torchtitan flattens the model's keys into the state dict
            self.states[MODEL].load_state_dict(state_dict)

    def _check_job(self, checkpoint_id: str) -> None:
        stored = read_metadata(checkpoint_id).values.get(SNAPSHOT_KEY)
        if not (isinstance(stored, tuple) and len(stored) == 1 and isinstance(stored[0], dict)):
            raise MalformedIndex(
                "no job config snapshot",
                path=checkpoint_id,
                field=SNAPSHOT_KEY,
                hint="not saved by ckptkit's torchtitan CheckpointManager; resume it as it was saved, or move it "
                "out of the checkpoint folder (R-TT05)",
            )
        for d in check_job(stored[0], self.job_table, checkpoint_id):
            logger.info(f"ckptkit: resuming {checkpoint_id} with {d.describe()}")

    def _find_load_step(self, folder: str = "") -> int:
        return find_load_step(folder or self.folder, logger.warning)


def _native(dl: Any) -> bool:
    """torchtitan's own ParallelAwareDataloader (its pickling state_dict and load_state_dict unchanged)."""
    t = type(dl)
    return (
        isinstance(dl, ParallelAwareDataloader)
        and t.state_dict is ParallelAwareDataloader.state_dict
        and t.load_state_dict is ParallelAwareDataloader.load_state_dict
    )


class DataLoaderState(Stateful):
    """The dataloader's state as a plain tree (R-TT08).

    For torchtitan's ``ParallelAwareDataloader``: ``{"dp_rank_<r>": (tree,), "world_size": n}``, where
    ``tree`` is ``StatefulDataLoader.state_dict()`` itself -- what torchtitan would ``pickle.dumps`` --
    and it is restored through ``StatefulDataLoader.load_state_dict``, never ``pickle.loads``. Any other
    dataloader's ``state_dict()`` is stored as ``{"rank_<global rank>": (state,)}``, when it is plain
    data and holds no pickle.
    """

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def state_dict(self) -> dict[str, Any]:
        """The dataloader's state as plain data.

        Raises:
            UnsupportedValue: a value no checkpoint can carry, or pickle bytes (named by key path).
        """
        dl = self.dataloader
        if _native(dl):
            state = {dl._rank_id: (StatefulDataLoader.state_dict(dl),), "world_size": dl.dp_world_size}
        else:  # one plain value under a key of this rank's: DCP keeps one copy of a key all ranks share
            state = {_own_key(): (dl.state_dict(),)}
            _refuse_pickle(state, "dataloader")
        try:
            check_plain(state, "dataloader")
        except UnsupportedValue as e:
            raise UnsupportedValue(
                f"{e}; the dataloader's state_dict() must be plain data to be stored without pickle (R-TT08)"
            ) from None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the dataloader's position from :meth:`state_dict`'s tree, unpickling nothing.

        Raises:
            StateMismatch: the state was saved at another data-parallel degree.
        """
        dl = self.dataloader
        if not _native(dl):
            dl.load_state_dict(state_dict[_own_key()][0])
            return
        if not state_dict:
            return
        saved = state_dict.get("world_size")
        if saved != dl.dp_world_size or dl._rank_id not in state_dict:
            raise StateMismatch(
                f"dataloader: saved at data-parallel degree {saved}, resumed at {dl.dp_world_size}; torchtitan's "
                "dataloader cannot reshard its position, resume at the degree it was saved at (R-TT08)",
                [f"dataloader.world_size: {saved} -> {dl.dp_world_size}"],
            )
        StatefulDataLoader.load_state_dict(dl, state_dict[dl._rank_id][0])


def _own_key() -> str:
    import torch.distributed as dist

    return f"rank_{dist.get_rank() if dist.is_available() and dist.is_initialized() else 0}"


def _refuse_pickle(tree: Any, where: str) -> None:
    """Raises UnsupportedValue at the first bytes value that is a pickle (protocol 2 or later)."""
    if isinstance(tree, (bytes, bytearray)) and tree[:1] == b"\x80":
        raise UnsupportedValue(
            f"{where}: pickle bytes ({len(tree)} bytes); restoring them would run pickle.loads on resume, which "
            "ckptkit never does: make this dataloader's state_dict() return its state as plain data (the tree it "
            "pickles), and its load_state_dict() take that tree (R-TT08)"
        )
    if isinstance(tree, dict):
        for k, v in tree.items():
            _refuse_pickle(v, f"{where}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _refuse_pickle(v, f"{where}[{i}]")
