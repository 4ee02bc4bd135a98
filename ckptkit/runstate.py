"""What a training run consists of, and how it is saved and resumed as one thing.

A :class:`RunState` is told, once, every piece of state a run has — modules,
optimizers, schedulers, scalers, the EMA teacher, data positions, monitors, flag
bits, small values, sidecars and the config — and then does ``save(step)`` and
``resume()`` with every check the design record asks for:

* the config snapshot is diffed key by key (:func:`ckptkit.drift.check_resume`);
* the environment (torch version, threads, ...) is compared with the recording;
* the newest checkpoint that verifies, *with* consistent sidecars, is chosen, and
  every fallback is said out loud;
* a data position that disagrees with the step is refused;
* a legacy checkpoint is refused unless allowed, with what it lacks named;
* anything registered that the container cannot carry is refused at registration.

Files in the run directory (``spec/runstate.md``)::

    environment.json                    facts recorded when the run started
    step-00000120.ckpt                  the container (written last: it marks a complete save)
    step-00000120.ckpt.config.json      the config snapshot
    step-00000120.ckpt.<kind>           one sidecar per registered kind (e.g. .ngram)

Example::

    rs = RunState("run", config=cfg, keep=3)
    rs.add_model("model", net)
    rs.add_optimizer("adamw", opt)
    rs.add_data_position("train", get=lambda: data.offset, set=data.seek)
    step = rs.resume().step if args.resume else rs.start()
    for step in range(step, cfg.steps):
        ...
        if (step + 1) % cfg.ckpt_every == 0:
            rs.save(step + 1)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ._distributed_run import DistributedRun, is_distributed, refuse_in_one_process
from ._registry import Entry, Registry, has_state_dict
from ._run_files import (
    CKPT_SUFFIX,
    DCP_SUFFIX,
    checkpoint_name,
    fallback_notes,
    list_checkpoints,
    newest_consistent,
    read_environment,
    refuse_existing,
    retain,
    write_companions,
)
from .asyncsave import AsyncSaver
from .atomic import clean_stale_temps, write_bytes_atomic
from .checkpoint import Checkpoint, load, save
from .companions import (
    COMPANIONS_KEY,
    ENVIRONMENT_FILE,
    UNBOUND_NOTE,
    check_companions,
    record_of,
)
from .container import FLAG_NAMES, SECTIONS
from .drift import DEFAULT_EXEMPT, KeyDiff, check_resume
from .environment import EnvDiff, capture, check_environment
from .errors import (
    CheckpointNotFound,
    FormatError,
    LegacyCheckpoint,
    UnsupportedValue,
)
from .preemption import DEFAULT_SIGNALS, RunStopped, StopRequests
from .section import check_plain
from .sidecar import read_sidecar, sidecar_path
from .snapshot import encode_snapshot, read_snapshot, snapshot_path

__all__ = [
    "CKPT_SUFFIX",
    "DCP_SUFFIX",
    "ENVIRONMENT_FILE",
    "ResumeInfo",
    "RunState",
    "checkpoint_name",
    "list_checkpoints",
    "read_environment",
]


@dataclass(frozen=True)
class ResumeInfo:
    """What :meth:`RunState.resume` did.

    Attributes:
        step: the step training continues from.
        path: the checkpoint it came from.
        notes: human lines worth logging (fallbacks, exempt changes, overrides).
        skipped: ``(path, reason)`` for each newer checkpoint that was passed over.
        exempt_changes: config differences that were allowed (``steps`` extended...).
        env_overrides: environment differences accepted with ``allow_env_change``.
        legacy_missing: for a v1 checkpoint loaded with ``allow_legacy``, what it lacked.
        resharded: a distributed run resumed with ``reshard=True`` at another world size
            or layout than it was saved at; ``notes`` say the run is no longer bit-comparable
            to its past (record that in the run's history).
    """

    step: int
    path: str
    notes: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    exempt_changes: tuple[KeyDiff, ...] = ()
    env_overrides: tuple[EnvDiff, ...] = ()
    legacy_missing: tuple[str, ...] = ()
    resharded: bool = False


class RunState:
    """A run's state, registered once, saved and resumed as a whole.

    Args:
        run_dir: the run directory (created on the first save).
        config: the run's resolved config, a (nested) dataclass instance; snapshot
            next to every checkpoint and diffed on resume. A config the snapshot
            cannot hold raises :class:`~ckptkit.errors.UnsupportedValue` here.
        keep: how many newest checkpoints to keep (older ones, with their
            companions, are deleted after each successful save).
        exempt: config keys allowed to change across a resume (default: the
            progress/cadence keys, see :data:`ckptkit.drift.DEFAULT_EXEMPT`).
        compression: container codec per :func:`ckptkit.save`.
        log: called with each human-readable note (default: ignore; notes are also
            returned in :class:`ResumeInfo`).
        async_save: ``save()`` snapshots the state into a reusable buffer and
            returns; the files are written in the background
            (:class:`ckptkit.asyncsave.AsyncSaver`, same bytes as a synchronous
            save). A failed background write is raised by the next ``save()``,
            ``wait()``, ``resume()`` or ``close()``. Costs one copy of the
            checkpoint's tensors in host memory.
        process_group: a ``torch.distributed`` group makes the run state distributed
            (the default group when ``torch.distributed`` is initialised): every rank
            constructs it, registers the same things and calls ``save``/``resume``
            together; checkpoints are ``ckptkit.distributed`` directories
            (spec/runstate.md "Distributed run state"). In one process, a run
            directory a distributed run saved into makes it distributed at world
            size 1: ``resume(reshard=True)`` continues the run there.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        config: Any,
        keep: int = 3,
        exempt: Iterable[str] = DEFAULT_EXEMPT,
        compression: str = "raw",
        log: Callable[[str], None] | None = None,
        async_save: bool = False,
        process_group: Any = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep!r})")
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save must be True or False (got {async_save!r})")
        encode_snapshot(config)  # a config the snapshot cannot hold is refused now, not at the first save
        self.run_dir = os.fspath(run_dir)
        self.config = config
        self.keep = keep
        self.exempt = frozenset(exempt)
        self.compression = compression
        self._log = log or (lambda _msg: None)
        self._reg = Registry()
        self._after_restore: list[Callable[[], None]] = []
        self._saver: AsyncSaver | None = AsyncSaver(compression=compression) if async_save else None
        self._stops = StopRequests()
        self._resume_hint: str | None = None
        self._recording = False  # record() has opened history.jsonl in this process
        self._dist: DistributedRun | None = None
        if is_distributed(process_group, self.run_dir):
            if compression != "raw":
                raise ValueError(f"compression must be 'raw' in a distributed run (got {compression!r})")
            self._saver = None
            self._dist = DistributedRun(self, process_group, async_save)

    @property
    def rank(self) -> int:
        """This process's rank in the run's process group (0 in one process)."""
        return 0 if self._dist is None else self._dist.rank

    @property
    def world_size(self) -> int:
        """How many processes the run has (1 in one process)."""
        return 1 if self._dist is None else self._dist.world

    # ------------------------------------------------------------------ registration

    def _name(self, kind: str, name: str, taken: dict[str, Any]) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{kind} name must be a non-empty string (got {name!r})")
        if name in taken:
            raise ValueError(f"{kind} {name!r} is already registered")

    def _probe(self, where: str, value: Any) -> None:
        """Refuse at registration what the container could not carry at save."""
        from .codec import encode_tree

        encode_tree(value, where)

    def _stateful(self, kind: str, name: str, obj: Any, taken: dict[str, Any]) -> None:
        self._name(kind, name, taken)
        if not has_state_dict(obj):
            raise UnsupportedValue(f"{kind} {name!r}: a {type(obj).__name__} has no state_dict()/load_state_dict()")
        if self._dist is None:
            self._probe(f"{kind} {name!r}", obj.state_dict())
        elif kind in ("scheduler", "scaler"):  # replicated plain state; modules and optimizers go through DCP
            try:
                check_plain(obj.state_dict(), f"{kind} {name!r}")
            except UnsupportedValue as e:
                raise UnsupportedValue(f"{e}; a distributed run saves schedulers and scalers as plain values") from None
        taken[name] = obj

    def add_model(self, name: str, module: Any) -> None:
        """Register a module; its ``state_dict()`` goes in the model section."""
        self._stateful("model", name, module, self._reg.models)

    def add_optimizer(self, name: str, optimizer: Any, *, model: str | None = None) -> None:
        """Register an optimizer (moments, step counters, param groups).

        Args:
            model: the registered model it optimizes; a distributed run saves the
                optimizer's state by that model's parameter names. May be omitted
                when exactly one model is registered.
        """
        if model is None and len(self._reg.models) == 1:
            model = next(iter(self._reg.models))
        if model is not None and model not in self._reg.models:
            raise ValueError(f"optimizer {name!r}: model {model!r} is not registered (add_model it first)")
        if model is None and self._dist is not None:
            raise ValueError(f"optimizer {name!r}: name its model (model=...): {len(self._reg.models)} are registered")
        self._stateful("optimizer", name, optimizer, self._reg.optimizers)
        if model is not None:
            self._reg.optimizer_models[name] = self._reg.models[model]

    def add_scheduler(self, name: str, scheduler: Any) -> None:
        """Register an LR scheduler (or anything with ``state_dict``) in the optim section."""
        self._stateful("scheduler", name, scheduler, self._reg.schedulers)

    def add_scaler(self, name: str, scaler: Any) -> None:
        """Register a gradient scaler (``torch.amp.GradScaler``) in the optim section."""
        self._stateful("scaler", name, scaler, self._reg.scalers)

    def add_teacher(self, module: Any) -> None:
        """Register the EMA teacher: saved as the run left it, restored frozen.

        The teacher is never rebuilt from the student on resume (design record item 1).
        """
        if self._reg.teacher is not None:
            raise ValueError("a teacher is already registered")
        self._stateful("teacher", "teacher", module, {})
        self._reg.teacher = module

    def add_monitor(self, name: str, monitor: Any) -> None:
        """Register a monitor (e.g. :class:`ckptkit.monitor.SpikeMonitor`); plain-value state only."""
        self._name("monitor", name, self._reg.monitors)
        if not has_state_dict(monitor):
            raise UnsupportedValue(
                f"monitor {name!r}: a {type(monitor).__name__} has no state_dict()/load_state_dict()"
            )
        check_plain(monitor.state_dict(), f"monitor {name!r}")
        self._reg.monitors[name] = monitor

    def add_data_position(
        self,
        name: str,
        *,
        get: Callable[[], int],
        set: Callable[[int], None],  # noqa: A002 - mirrors property naming
        expected: Callable[[int, Mapping[str, Any]], int] | None = None,
    ) -> None:
        """Register a data-stream position (e.g. a byte offset).

        Args:
            get / set: read and restore the position.
            expected: the offset rule, ``expected(step, values)``: the position the
                run must be at after ``step`` steps. Resume refuses a checkpoint whose
                stored position differs (:class:`~ckptkit.errors.StreamOffsetMismatch`,
                design record item 6). ``values`` are the checkpoint's stored
                :meth:`add_value` values by name (``{}`` for a legacy checkpoint), read
                before anything is restored, for a rule that depends on run state:
                e.g. a trainer that skips batches after a spike rollback stores the
                count with ``add_value`` and its rule adds it. A plain rule ignores
                them: ``expected=lambda step, _values: step * batch * seq_len``.
        """
        self._name("data position", name, self._reg.data)
        pos = get()
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
            raise UnsupportedValue(f"data position {name!r} must be a non-negative int (got {pos!r})")
        self._reg.data[name] = Entry(get, set, expected)

    def add_value(
        self,
        name: str,
        *,
        get: Callable[[], Any],
        set: Callable[[Any], None],  # noqa: A002
        per_rank: bool = False,
    ) -> None:
        """Register small run state (msgpack-able plain values: numbers, str, lists, dicts).

        Args:
            per_rank: each rank of a distributed run holds its own value (saved under
                its rank); otherwise the value is replicated, and a save refuses ranks
                whose copies differ. No effect in one process.
        """
        self._name("value", name, self._reg.values)
        check_plain(get(), f"value {name!r}")
        self._reg.values[name] = Entry(get, set, per_rank=per_rank)

    def add_stateful(self, name: str, obj: Any) -> None:
        """Register any object with ``state_dict()`` / ``load_state_dict()`` whose state is
        plain values: torchdata's ``StatefulDataLoader``, a resumable sampler, a counter.
        It is stored like :meth:`add_value` (``values.<name>`` in the monitor section) and
        restored with ``load_state_dict``.

        Raises:
            UnsupportedValue: the object has no ``state_dict``/``load_state_dict``, or its
                state holds something other than plain values (tensors: register the
                object with :meth:`add_scheduler`, whose section carries tensors).
        """
        if not has_state_dict(obj):
            raise UnsupportedValue(f"stateful {name!r}: a {type(obj).__name__} has no state_dict()/load_state_dict()")
        self.add_value(name, get=obj.state_dict, set=obj.load_state_dict)

    def add_flag(self, name: str, *, get: Callable[[], bool], set: Callable[[bool], None]) -> None:  # noqa: A002
        """Register a container flag bit by name (``fp32_fallback`` = bit 0)."""
        if name not in FLAG_NAMES.values():
            raise UnsupportedValue(
                f"flag {name!r} has no bit in this container version "
                f"(known: {', '.join(FLAG_NAMES.values())}); store it with add_value"
            )
        self._name("flag", name, self._reg.flags)
        self._reg.flags[name] = Entry(get, set)

    def add_sidecar(
        self,
        kind: str,
        *,
        get: Callable[[], tuple[int, Any]],
        set: Callable[[int, Any], None],  # noqa: A002
    ) -> None:
        """Register a sidecar written next to every checkpoint as ``<ckpt>.<kind>``.

        Args:
            get: returns ``(table_step, tree)``.
            set: receives ``(table_step, tree)`` on restore.
        """
        sidecar_path("x", kind)  # validates the kind
        self._name("sidecar", kind, self._reg.sidecars)
        _table_step, tree = get()
        self._probe(f"sidecar {kind!r}", tree)
        self._reg.sidecars[kind] = Entry(get, lambda v: set(*v))

    def after_restore(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every restore: re-apply compute settings (quant format,
        latched fallbacks) that ``load_state_dict`` does not carry (design record item 2)."""
        self._after_restore.append(fn)

    def sidecar_contents(self) -> dict[str, tuple[int, Any]]:
        """``kind -> (table_step, tree)`` of every registered sidecar, as :meth:`restore` takes them
        (the live trees: copy them to keep this state while training goes on)."""
        return {kind: entry.get() for kind, entry in self._reg.sidecars.items()}

    # ------------------------------------------------------------------ save

    def checkpoint(self, step: int) -> Checkpoint:
        """The container contents for ``step``, built from the registered state.

        The tensors are the live ones (``state_dict()`` references): copy them to keep
        this state while training goes on (e.g. for :meth:`restore`).
        """
        return self._reg.contents(step)

    def checkpoint_path(self, step: int) -> str:
        """The path :meth:`save` of ``step`` writes: ``<run_dir>/step-00000120.ckpt``, or the
        directory ``<run_dir>/step-00000120.dcp`` in a distributed run (to name it before it exists)."""
        return os.path.join(self.run_dir, checkpoint_name(step, DCP_SUFFIX if self._dist is not None else CKPT_SUFFIX))

    def load_checkpoint(self, step: int) -> tuple[Checkpoint, dict[str, tuple[int, Any]]]:
        """The saved checkpoint at ``step`` as :meth:`checkpoint` builds contents (in a
        distributed run: this rank's, loaded collectively), in copies: the registered
        objects are untouched. With its sidecars, ``kind -> (table_step, tree)``, the form
        :meth:`restore` takes. The spike guard rebuilds its ring from it.

        Raises:
            CheckpointNotFound: no committed checkpoint at ``step``.
            FormatError: it (or a sidecar) is damaged.
            StateMismatch: it does not fit the registered modules and optimizers.
        """
        if self._dist is not None:
            return self._dist.load_checkpoint(step)
        path = self.checkpoint_path(step)
        ckpt = load(path)
        sidecars = {kind: read_sidecar(sidecar_path(path, kind), expect_step=step) for kind in self._reg.sidecars}
        return ckpt, {kind: (sc.table_step, sc.tree) for kind, sc in sidecars.items()}

    def save(self, step: int) -> str:
        """Save everything at ``step``: snapshot, sidecars, then the container.

        The container is written last, so its presence marks a complete save; each
        file is atomic. Older checkpoints beyond ``keep`` are then deleted.

        With ``async_save``, the state is snapshot and the same files are written,
        in the same order, by a background thread; the returned path exists once
        :meth:`wait` returns.

        Returns:
            The checkpoint path.

        Raises:
            SaveFailed: a write failed (with ``async_save``: the previous save's
                write); earlier checkpoints are intact.
            UnsupportedValue: state that cannot be stored (named by path).
        """
        if self._dist is not None:
            return self._dist.save(step)
        os.makedirs(self.run_dir, exist_ok=True)
        path = os.path.join(self.run_dir, checkpoint_name(step))
        ckpt = self.checkpoint(step)
        if self._saver is not None:
            self._save_async(path, ckpt)
            return path
        record = write_companions(path, step, encode_snapshot(self.config), self.sidecar_contents())
        save(path, _bind(ckpt, record), compression=self.compression)
        self._retain()
        return path

    def _save_async(self, path: str, ckpt: Checkpoint) -> None:
        assert self._saver is not None
        config = encode_snapshot(self.config)  # refuses a bad config now, not in the background
        stamps, trees = {}, {name: getattr(ckpt, name) for name in SECTIONS}
        for kind, entry in self._reg.sidecars.items():
            stamps[kind], trees[f"sidecar:{kind}"] = entry.get()

        def write(snap: dict[str, Any]) -> None:
            sidecars = {kind: (table_step, snap[f"sidecar:{kind}"]) for kind, table_step in stamps.items()}
            record = write_companions(path, ckpt.step, config, sidecars)
            taken = dataclasses.replace(ckpt, **{name: snap[name] for name in SECTIONS})
            save(path, _bind(taken, record), compression=self.compression)
            self._retain()

        self._saver.submit(trees, write)

    def wait(self) -> None:
        """Block until a background save (``async_save``) is committed; a no-op otherwise.

        Raises:
            SaveFailed: the background write failed; earlier checkpoints are intact.
        """
        if self._dist is not None:
            self._dist.wait()
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        """Finish a background save and free its snapshot buffer.

        Raises:
            SaveFailed: the background write failed.
        """
        if self._dist is not None:
            self._dist.close()
        if self._saver is not None:
            self._saver.close()

    def _companions(self, path: str) -> list[str]:
        return [snapshot_path(path)] + [sidecar_path(path, k) for k in self._reg.sidecars]

    def _delete(self, path: str) -> None:
        # Container first: a crash mid-delete leaves orphan companions (swept by
        # _retain), never a container without its companions.
        for p in [path, *self._companions(path)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def _retain(self) -> None:
        retain(self.run_dir, self.keep, self._delete, self._log)

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of the run directory's checkpoints, oldest first, once a
        background save in flight has committed: the newest is the newest this run saved.

        Raises:
            SaveFailed: the background write failed; earlier checkpoints are intact.
        """
        if self._dist is not None:
            return self._dist.checkpoints()
        self.wait()
        return list_checkpoints(self.run_dir)

    def discard_after(self, step: int) -> list[str]:
        """Delete checkpoints newer than ``step`` (after a rollback they belong to an
        abandoned timeline and must never be resumed). Returns the paths deleted."""
        if self._dist is not None:
            return self._dist.discard_after(step)
        gone = [p for s, p in self.checkpoints() if s > step]
        for p in gone:
            self._delete(p)
        return gone

    # ------------------------------------------------------------------ start / resume

    def start(self) -> int:
        """Begin a fresh run: refuse a directory that already holds checkpoints.

        Records the environment (``environment.json``) and returns step 0.

        Raises:
            ResumeRefused: the run directory already holds checkpoints (nothing is
                overwritten; resume it, or use another directory).
        """
        if self._dist is not None:
            return self._dist.start()
        refuse_in_one_process(self.run_dir)
        refuse_existing(self.run_dir, list_checkpoints(self.run_dir))
        os.makedirs(self.run_dir, exist_ok=True)
        clean_stale_temps(self.run_dir)
        facts = capture()
        write_bytes_atomic(
            os.path.join(self.run_dir, ENVIRONMENT_FILE), (json.dumps(facts, sort_keys=True, indent=2) + "\n").encode()
        )
        return 0

    def resume(
        self, *, allow_legacy: bool = False, allow_env_change: bool = False, reshard: bool = False
    ) -> ResumeInfo:
        """Restore the newest consistent checkpoint, after every check passes.

        Candidates are tried newest first; one that fails to verify, lacks its
        snapshot, or has a missing or mismatched sidecar is skipped, and the
        skip is reported. Nothing is restored until every check has passed.

        Args:
            allow_legacy: accept a v1 checkpoint (which lacks teacher, flags,
                monitor and digests); the run continues loudly.
            allow_env_change: accept a different environment; the differences are
                returned for the caller to record.
            reshard: a distributed run may resume at another world size or layout:
                DCP reshards, data positions come from their offset rules, and
                ``ResumeInfo.resharded`` says the run is no longer bit-comparable.

        Returns:
            A :class:`ResumeInfo`.

        Raises:
            CheckpointNotFound: no usable checkpoint in the run directory.
            ConfigDrift: the config differs from the snapshot in strict keys (all listed).
            EnvironmentDrift: the environment differs (all facts listed).
            LegacyCheckpoint: a v1 checkpoint without ``allow_legacy``.
            StreamOffsetMismatch: a stored data position disagrees with the step.
            StateMismatch: the checkpoint's contents do not fit what is registered
                (a registration either side lacks, a module's keys, shapes or dtypes).
            WorldSizeChanged: the run was saved at another world size or layout
                (one process vs a process group included) and ``reshard`` is False.
        """
        if self._dist is not None:
            return self._dist.resume(reshard=reshard, allow_env_change=allow_env_change)
        refuse_in_one_process(self.run_dir)
        self.wait()
        removed = clean_stale_temps(self.run_dir)
        notes = [f"removed {len(removed)} temporary file(s) left by an interrupted save"] if removed else []
        (ckpt, snapshot, sidecars), path, skipped = newest_consistent(
            self.run_dir, list_checkpoints(self.run_dir), self._consistent
        )
        notes += fallback_notes(skipped, path, ckpt.step)
        if record_of(ckpt.monitor) is None:
            notes.append(f"{os.path.basename(path)} {UNBOUND_NOTE}")
        exempt = check_resume(snapshot, self.config, exempt=self.exempt)
        notes += [d.describe() for d in exempt]
        env = self._check_environment(allow_env_change)
        notes += [f"environment override: {d}" for d in env]
        legacy_missing = self._check_legacy(ckpt, path, allow_legacy)
        if legacy_missing:
            notes.append(f"LEGACY checkpoint {os.path.basename(path)}: proceeding without {', '.join(legacy_missing)}")
        self._reg.check_contents(ckpt, path)
        self.restore(ckpt, sidecars={k: (sc.table_step, sc.tree) for k, sc in sidecars.items()})
        for n in notes:
            self._log(n)
        return ResumeInfo(ckpt.step, path, tuple(notes), tuple(skipped), tuple(exempt), tuple(env), legacy_missing)

    def resume_or_start(
        self, *, allow_legacy: bool = False, allow_env_change: bool = False, reshard: bool = False
    ) -> int:
        """Resume the newest consistent checkpoint if the run directory holds one, else start
        fresh; returns the step to continue from. The same command line then starts the run
        and continues it after a preemption (``ckptkit audit`` relies on that).

        Raises:
            As :meth:`resume` (never :class:`CheckpointNotFound` for an empty directory).
        """
        if self._dist is not None:
            has = self._dist.has_checkpoints()
        else:
            has = bool(list_checkpoints(self.run_dir) or list_checkpoints(self.run_dir, DCP_SUFFIX))
        if has:
            return self.resume(allow_legacy=allow_legacy, allow_env_change=allow_env_change, reshard=reshard).step
        return self.start()

    def record(self, step: int, **scalars: Any) -> None:
        """Record step ``step`` (0-based, just finished) in ``history.jsonl``: a ``step`` row
        with the loop's scalars (floats also as exact bits) and a ``digests`` row with the
        digest of every tensor and value registered, after the step (spec/replay.md "Any
        loop"). ``ckptkit audit -- CMD`` and ``ckptkit replay RUN --from S -- CMD`` compare
        these rows and name the first step and tensor that differ.

        The first call in a process at step ``S`` makes the file the run's history up to
        ``S``: a fresh one at step 0, else the rows an interrupted run wrote from ``S`` on
        (in the timeline of the restored rollback record, if a SpikeGuard registered one)
        are dropped.

        Example::

            state.record(step, loss=loss.item(), grad_norm=gn.item(), lr=sched.get_last_lr()[0])

        Raises:
            TypeError: a scalar that is not a number, string or one-element tensor.
        """
        from ._ring import localized
        from .compare import checkpoint_state
        from .history import HISTORY_FILE, History, append_rows
        from .recording import digests_row, step_row

        if self.rank != 0:
            return  # a distributed run's history is rank 0's
        row = step_row(step, scalars)
        if not self._recording:
            os.makedirs(self.run_dir, exist_ok=True)
            history = History(self.run_dir)
            if step == 0:
                history.start_fresh()
            else:
                rollback = self._reg.values.get("rollback")
                history.resume_at(step, rollback.get()["count"] if rollback is not None else 0)
            history.close()
            self._recording = True
        append_rows(
            os.path.join(self.run_dir, HISTORY_FILE),
            [row, digests_row(step + 1, checkpoint_state(localized(self.checkpoint(step + 1))))],
        )

    # ------------------------------------------------------------------ stopping (spec/runstate.md "Stopping")

    def preemptible(
        self, signals: Iterable[int] = DEFAULT_SIGNALS, *, resume_hint: str | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Opt in to preemption while the returned context is open: the first SIGTERM or
        SIGINT requests a stop (the loop finishes its step, :meth:`step_done` saves it and
        exits with ``EXIT_STOPPED``, 75); a second aborts at once, leaving every checkpoint
        on disk intact.

        Args:
            signals: the signals that request a stop.
            resume_hint: the command the stop line tells the user to run (default: this
                process's command line, which resumes by itself through :meth:`resume_or_start`).

        Example::

            with state.preemptible():
                for step in range(state.resume_or_start(), steps):
                    train_step(step)
                    state.step_done(step + 1)
        """
        self._resume_hint = resume_hint
        return self._stops.installed(signals)

    def stop_requested(self, steps_done: int) -> str | None:
        """What asks the run to stop after ``steps_done`` steps (a signal caught by
        :meth:`preemptible`, or ``CKPTKIT_STOP_AT``), or None. For a loop that saves
        its own way; :meth:`step_done` is this plus the save and the exit.

        Raises:
            CheckpointError: ``CKPTKIT_STOP_AT`` is not a step count.
        """
        return self._stops.reason(steps_done)

    def step_done(self, steps_done: int) -> None:
        """Call once after every step with the number of steps done: when a stop was
        requested, saves that step, prints how to resume and raises :class:`RunStopped`
        (a ``SystemExit`` with code 75: uncaught, the process ends there).

        Raises:
            RunStopped: a stop was requested; the checkpoint at ``steps_done`` is committed.
            SaveFailed: the save failed (earlier checkpoints are intact).
        """
        why = self._stops.reason(steps_done)
        if why is None:
            return
        path = self.save(steps_done)
        self.wait()
        hint = self._resume_hint or shlex.join(
            [sys.executable, *sys.argv] if sys.argv and sys.argv[0].endswith(".py") else sys.argv
        )
        print(
            f"ckptkit: stopped at step {steps_done} ({why}): saved {path}; resume with: {hint}",
            file=sys.stderr,
            flush=True,
        )
        raise RunStopped(steps_done, path, why)

    def _consistent(self, named_step: int, path: str) -> tuple[Checkpoint, Any, dict[str, Any]]:
        """The checkpoint at ``path`` with its snapshot and sidecars, if it is consistent
        (RS-2 step 2); a FormatError or CheckpointNotFound says why not."""
        ckpt = load(path)
        if ckpt.step != named_step:
            raise FormatError(
                "header step does not match the file name",
                path=path,
                offset=8,
                field="step",
                expected=named_step,
                actual=ckpt.step,
                hint="a checkpoint renamed or copied over another; resume from another",
            )
        if not os.path.exists(snapshot_path(path)):
            raise CheckpointNotFound(f"{snapshot_path(path)}: config snapshot is missing")
        sidecars = {kind: read_sidecar(sidecar_path(path, kind), expect_step=ckpt.step) for kind in self._reg.sidecars}
        # A damaged or swapped companion is damage, like a damaged container
        # (spec/companions.md): it is skipped, never reported as drift.
        check_companions(path, record_of(ckpt.monitor, path), sidecars=self._reg.sidecars)
        return ckpt, read_snapshot(snapshot_path(path)), sidecars

    def _check_environment(self, allow: bool) -> list[EnvDiff]:
        return check_environment(read_environment(self.run_dir), capture(), allow=allow)

    def _check_legacy(self, ckpt: Checkpoint, path: str, allow: bool) -> tuple[str, ...]:
        if not ckpt.legacy:
            return ()
        needed = [m for m in ckpt.missing if m != "flags" or self._reg.flags]
        needed = [m for m in needed if m != "teacher" or self._reg.teacher is not None]
        needed = [m for m in needed if m != "monitor" or self._reg.monitor_registered()]
        missing = tuple(needed)
        if not allow:
            raise LegacyCheckpoint(
                f"{path}: is a legacy v1 checkpoint; it cannot carry: {', '.join(ckpt.missing)}"
                f"{' (this run needs ' + ', '.join(missing) + ')' if missing else ''}; "
                "pass --allow-legacy (allow_legacy=True) to continue without them",
                ckpt.missing,
            )
        return ckpt.missing

    def restore(
        self,
        ckpt: Checkpoint,
        *,
        sidecars: Mapping[str, tuple[int, Any]] | None = None,
        skip: Iterable[str] = (),
    ) -> None:
        """Put a checkpoint's contents into the registered objects, unchecked.

        :meth:`resume` is this plus every check; call it directly to go back to a
        state the run itself kept with :meth:`checkpoint` (an in-memory rollback),
        so that what the rollback restores is exactly what is registered. The
        teacher comes back frozen; the ``after_restore`` hooks run last.

        Args:
            ckpt: the contents, e.g. a :meth:`checkpoint` taken earlier and copied
                then (its tensors are the live ones). ``load_state_dict`` may keep
                references to the tensors given (an optimizer does): pass a copy
                that nothing else will use.
            sidecars: ``kind -> (table_step, tree)`` for every registered sidecar
                not skipped.
            skip: registrations to leave as they are, named ``"<kind>:<name>"``
                with kind ``model``, ``optimizer``, ``scheduler``, ``scaler``,
                ``teacher`` (name ``teacher``), ``monitor``, ``data``, ``value``,
                ``flag`` or ``sidecar``: e.g. ``"data:train"`` to keep the stream
                where it is.

        Raises:
            ValueError: a ``skip`` name that is not registered, or a registered
                sidecar missing from ``sidecars``.
        """
        self._reg.restore(ckpt, sidecars=sidecars, skip=skip)
        for fn in self._after_restore:
            fn()


def _bind(ckpt: Checkpoint, record: dict[str, Any]) -> Checkpoint:
    """``ckpt`` with the companion record (spec/companions.md): the digests of the
    snapshot, sidecars and environment record just written, so that none of them
    can be edited or swapped without the checkpoint noticing."""
    return dataclasses.replace(ckpt, monitor={**(ckpt.monitor or {}), COMPANIONS_KEY: record})
