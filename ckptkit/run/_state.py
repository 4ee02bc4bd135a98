"""What a training run consists of, and how it is saved and resumed as one thing.

A :class:`RunState` is told, once, every piece of state a run has — modules,
optimizers, schedulers, scalers, the EMA teacher, data positions, monitors, flag
bits, small values, sidecars and the config — and then does ``save(step)`` and
``resume()`` with every check the design record asks for:

* the config snapshot is diffed key by key (:func:`ckptkit.run.check_resume`);
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
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..errors import LeaseLost
from ..format._checkpoint import Checkpoint
from ..format._checks import is_int
from ..format._objectstore import SINGLE_WRITER_ENV
from ..format._place import place_for
from ..format._snapshot import encode_snapshot
from . import _resume as protocol
from ._dcp_store import DcpStore
from ._drift import DEFAULT_EXEMPT
from ._file_store import FileStore
from ._group import Alone, group_of
from ._history import HISTORY_FILE, History, read_rows
from ._lease import Lease, launcher_pid, lease_for, this_job
from ._preemption import Stopping, StopRequests
from ._registration import Registration
from ._registry import Registry
from ._resume import ResumeInfo
from ._resume_check import ResumeCheck, check_mode, replay_command
from ._store import Sidecars, Store

__all__ = ["GuardView", "ResumeInfo", "RunState"]


class RunState(Registration, Stopping):
    """A run's state, registered once, saved and resumed as a whole.

    Args:
        run_dir: the run directory (created on the first save).
        config: the run's resolved config, a (nested) dataclass instance; snapshot
            next to every checkpoint and diffed on resume. A config the snapshot
            cannot hold raises :class:`~ckptkit.errors.UnsupportedValue` here.
        keep: how many newest checkpoints to keep (older ones, with their
            companions, are deleted after each successful save).
        exempt: config keys allowed to change across a resume (default: the
            progress/cadence keys, see :data:`ckptkit.run.DEFAULT_EXEMPT`).
        compression: container codec per :func:`ckptkit.save`.
        log: called with each human-readable note (default: ignore; notes are also
            returned in :class:`ResumeInfo`).
        async_save: ``save()`` snapshots the state into a reusable buffer and
            returns; the files are written in the background
            (:class:`ckptkit.format.AsyncSaver`, same bytes as a synchronous
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
        lease: the run directory's lease (spec/lease.md): held from ``start()``/``resume()``
            (or the first ``save()``) to ``close()`` by rank 0, refreshed before every save;
            default :func:`~ckptkit.run.lease_for` ``(run_dir)``: ``lease.json`` in ``run_dir``, a file,
            or on an ``s3://`` run directory an object.
            A second job on the directory is refused with ``RunDirInUse`` and writes nothing,
            then or at its ``close()`` (R-LS16); a save after
            the lease was taken over, or after this rank's launcher died, raises
            ``LeaseLost`` and writes nothing.
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
        lease: Lease | None = None,
    ) -> None:
        if not is_int(keep, least=1):
            raise ValueError(f"keep must be >= 1 (got {keep!r})")
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save must be True or False (got {async_save!r})")
        encode_snapshot(config)  # a config the snapshot cannot hold is refused now, not at the first save
        self.run_dir = os.fspath(run_dir)  # an s3:// URL is object storage, never a local folder (R-O01)
        self.config = config
        self.keep = keep
        self.exempt = frozenset(exempt)
        self.compression = compression
        self._log = log or (lambda _msg: None)
        self._user_log = log is not None  # a resume's verdict line goes to it, else to stderr
        self._reg = Registry()
        self._after_restore: list[Callable[[], None]] = []
        self._stops = StopRequests()
        self._resume_hint: str | None = None
        self._began: int | None = None  # the step start() or resume() began this process at
        self._timeline: Callable[[], int] | None = None  # rollbacks the restored state lives after (the guard's)
        self._replaying: str | None = None  # inside replaying(): "replay" or "rerun"
        self._group = group_of(process_group)
        self._store = self._open_store(async_save)
        # The run's history.jsonl, opened by its first writer; a distributed run's is rank 0's.
        work = self._store.work_dir
        self._history = History(work, at=self._opening, log=self._log) if self.rank == 0 else _Silent(work)
        self._lease: Lease = lease if lease is not None else lease_for(self.run_dir)  # a file, or an object on s3://
        self._leased = False
        self._closed = False  # close() ran: a requested stop's, then the loop's own is a no-op
        self._launcher = launcher_pid()  # this rank's torchrun agent; None outside torchrun
        # The user vouched for the store instead of its conditional writes being checked (R-O49):
        # recorded in the history before this process's first save.
        self._unchecked_store = self._store.place.unchecked()

    def _open_store(self, async_save: bool) -> Store:
        """The DCP store when given a group, built in an initialised job, or on a run directory a
        distributed run saved into (which it may only resume with a reshard, RS-D7); else one
        file per step. Either over the run's place: a local directory or an ``s3://`` prefix
        (spec/objectstore.md R-O22, R-O35)."""
        place = place_for(self.run_dir)
        kw = {"keep": self.keep, "compression": self.compression, "async_save": async_save, "log": self._log}
        if not isinstance(self._group, Alone) or DcpStore.saved_into(place):
            return DcpStore(place, self._reg, self._group, **kw)  # type: ignore[arg-type]
        return FileStore(place, self._reg, **kw)  # type: ignore[arg-type]

    @property
    def work_dir(self) -> str:
        """Where the run's ``history.jsonl`` is written on this machine: the run directory, or for
        an ``s3://`` run a private working directory whose history comes down once the job holds the
        run's lease (``start()``, ``resume()``, the first save) and goes up with each checkpoint
        (spec/objectstore.md R-O23, spec/lease.md R-LS16); a :class:`~ckptkit.run.History` of the
        run is opened there."""
        return self._store.work_dir

    @property
    def rank(self) -> int:
        """This process's rank in the run's process group (0 in one process)."""
        return self._group.rank

    @property
    def world_size(self) -> int:
        """How many processes the run has (1 in one process)."""
        return self._group.world

    def guard_view(self) -> GuardView:
        """What a spike guard (:class:`~ckptkit.SpikeGuard`) asks of and does to the run beyond a
        loop's calls: data positions, the monitor's name, the LR, the history's timeline, replays."""
        return GuardView(self)

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
        return self._store.path(step)

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
        path = self.checkpoint_path(step)
        opened = self._store.open(path, reshard=False)
        return self._store.load(path, opened, copy=True), opened.sidecars

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
        self._store.wait()
        self._hold()
        self._group.agree(lambda: self._may_write(step), "checking the run directory's lease")
        self._record_unchecked_store(step)
        return self._store.save(step, self.checkpoint(step), encode_snapshot(self.config), self.sidecar_contents())

    def _record_unchecked_store(self, step: int) -> None:
        """Rank 0, before this process's first save: an ``unchecked_store`` row when the store's
        conditional writes were vouched for (``CKPTKIT_SINGLE_WRITER_STORE=1``), not checked (R-O49)."""
        if self._unchecked_store and self.rank == 0 and self._began is not None:
            row = {
                "kind": "unchecked_store",
                "step": step,
                "run_dir": self.run_dir,
                "vouched": f"{SINGLE_WRITER_ENV}=1",
            }
            self._history.append(row)
        self._unchecked_store = False

    def _hold(self) -> str | None:
        """Rank 0 acquires the run directory's lease for the job, once; a takeover is said (R-LS04)
        and its line returned (a resume's notes carry it into the history's ``resume`` row)."""
        if self._leased:
            return None
        lease, me = self._lease, this_job(self.world_size)
        note = self._group.from_rank0(lambda: lease.acquire(me), "acquiring the run directory's lease")
        self._leased, self._closed = True, False
        self._store.leased()  # only now may the store write, or read what it will write over (R-LS16)
        if note:
            self._log(note)
        return note

    def _may_write(self, step: int) -> None:
        """Before a save writes anything: this rank's launcher lives (R-LS07), and rank 0 still
        holds the lease, whose heartbeat it renews (R-LS06).

        Raises:
            LeaseLost: either is no longer so.
        """
        if self._launcher is not None and os.getppid() != self._launcher:
            raise LeaseLost(
                f"{self.run_dir}: this rank's launcher (pid {self._launcher}) is gone: rank {self.rank} stops "
                f"before saving step {step}, without writing, so a job started again on the directory is its "
                "one writer"
            )
        if self.rank == 0:
            self._lease.refresh()

    def wait(self) -> None:
        """Block until a background save (``async_save``) is committed; a no-op otherwise.

        Raises:
            SaveFailed: the background write failed; earlier checkpoints are intact.
        """
        self._store.wait()

    def close(self) -> None:
        """Finish a background save and free its snapshot buffer; close the run's history.

        Raises:
            SaveFailed: the background write failed.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._history.close()
            self._store.close()
        finally:
            self._release_lease()  # after the last save committed (or failed)

    def _release_lease(self) -> None:
        """Rank 0 gives the run directory's lease up (R-LS08): at ``close()``, and once a requested
        stop's checkpoint is committed (``step_done``), so a loop that ends there without reaching
        ``close()`` leaves no lease for its resume to take over."""
        if self._leased and self.rank == 0:
            self._lease.release()
        self._leased = False

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of the run directory's checkpoints, oldest first, once a
        background save in flight has committed: the newest is the newest this run saved.

        Raises:
            SaveFailed: the background write failed; earlier checkpoints are intact.
        """
        return self._store.committed()

    def never_saved(self) -> bool:
        """A run began in the run directory (its environment record, or what an interrupted save
        left) but committed no checkpoint: resuming it is starting it (the same run, from step 0;
        R-023). False for an untouched directory, which a resume refuses."""
        return not self.checkpoints() and self._store.began()

    def discard_after(self, step: int) -> list[str]:
        """Delete checkpoints newer than ``step`` (after a rollback they belong to an
        abandoned timeline and must never be resumed). Returns the paths deleted."""
        self._store.wait()
        gone = [p for s, p in self._store.listing() if s > step]  # committed or not: an abandoned timeline's

        def delete() -> None:
            for p in gone:
                self._store.delete(p)

        self._group.on_rank0(delete, "discarding checkpoints")
        return gone

    # ------------------------------------------------------------------ start / resume

    def start(self) -> int:
        """Begin a fresh run: refuse a directory that already holds checkpoints.

        Removes what interrupted saves left (an uncommitted checkpoint, companions without
        one: never a checkpoint, R-023), saying so; records the environment
        (``environment.json``) and returns step 0.

        Raises:
            ResumeRefused: the run directory already holds checkpoints (nothing is
                overwritten; resume it, or use another directory).
        """
        self._hold()
        self._began = protocol.start(self._store, self._group, self.run_dir, self._log)
        return self._began

    def resume(
        self,
        *,
        allow_legacy: bool = False,
        allow_env_change: bool = False,
        reshard: bool = False,
        resume_check: str | None = None,
    ) -> ResumeInfo:
        """Restore the newest consistent checkpoint, after every check passes.

        Candidates are tried newest first; one that fails to verify, lacks its
        snapshot, or has a missing or mismatched sidecar is skipped, and the
        skip is reported. Nothing is restored until every check has passed.

        Args:
            allow_legacy: accept a v1 checkpoint (which lacks teacher, flags,
                monitor and digests); the run continues loudly.
            allow_env_change: accept a different environment; the differences are
                returned, and recorded in the run's history: when the environment differs from
                the recording (or an earlier process's did), rank 0 writes the ``resume`` row,
                the environment this process runs under (R-D12), which ``ckptkit audit``
                reports. It goes in before the history's next row; a loop that writes its own
                ``resume`` row for the step (with its own notes: the reference trainer) replaces it.
            reshard: a distributed run may resume at another world size or layout:
                DCP reshards, data positions come from their offset rules, and
                ``ResumeInfo.resharded`` says the run is no longer bit-comparable.
            resume_check: what a difference between the steps this process re-runs and the rows
                the interrupted process recorded for them does (spec/determinism.md R-D24):
                ``"error"`` stops the run (:class:`~ckptkit.errors.ReplayDivergence`, both
                processes' rows kept), ``"warn"`` says it and goes on, ``"off"`` compares
                nothing; default ``$CKPTKIT_RESUME_CHECK``, else ``"error"``. Equal rows end in
                the line ``resume verified: steps a..b reproduce the interrupted run bit for bit``
                (through ``log``, else stderr) and a ``resume_check`` row.

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
        mode = check_mode(resume_check)
        took_over = self._hold()
        how = protocol.Resume(self.config, self.exempt, allow_legacy, allow_env_change, reshard)

        def restore(ckpt: Checkpoint, sidecars: Sidecars) -> None:
            self.restore(ckpt, sidecars=sidecars)

        info = protocol.resume(self._store, self._group, self._reg, self.run_dir, how, restore, self._log)
        if took_over:  # logged already; in the notes, so the resume row that records them has it (R-LS04)
            info = dataclasses.replace(info, notes=(took_over, *info.notes))
        self._began = info.step
        self._history.expect(self._check(mode, info))
        if self.rank == 0 and (info.env_overrides or self._overridden_before(info.step)):
            row = protocol.resume_row(
                info, allow_legacy=allow_legacy, allow_env_change=allow_env_change, notes=info.notes
            )
            self._history.hold(row)
        return info

    def _check(self, mode: str, info: ResumeInfo) -> ResumeCheck:
        """How this resume judges itself (R-D20): a resume that accepted another environment, another
        layout or a legacy checkpoint is not comparable with the process it replaces."""
        why = (
            "the resume accepted another environment (" + "; ".join(str(d) for d in info.env_overrides) + ")"
            if info.env_overrides
            else "the resume resharded the run"
            if info.resharded
            else "a legacy checkpoint without the full state"
            if info.legacy_missing
            else None
        )
        say = self._log if self._user_log else None
        return ResumeCheck(mode, self.run_dir, replay_command(self.run_dir), why, say)

    def _overridden_before(self, step: int) -> bool:
        """An earlier process of the run, up to ``step``, ran under another environment (its
        ``resume`` row says so): this resume's row must say that this one does not."""
        rows = read_rows(os.path.join(self._store.work_dir, HISTORY_FILE))[0]
        return any(r["kind"] == "resume" and r.get("env_diffs") for r in rows if r["step"] <= step)

    def resume_or_start(
        self,
        *,
        allow_legacy: bool = False,
        allow_env_change: bool = False,
        reshard: bool = False,
        resume_check: str | None = None,
    ) -> int:
        """Resume the newest consistent checkpoint if the run directory holds one, else start
        fresh; returns the step to continue from. The same command line then starts the run
        and continues it after a preemption (``ckptkit audit`` relies on that).

        Raises:
            As :meth:`resume` (never :class:`CheckpointNotFound` for an empty directory).
        """
        if protocol.has_checkpoints(self._group, self._store):
            how = {"allow_legacy": allow_legacy, "allow_env_change": allow_env_change, "reshard": reshard}
            return self.resume(**how, resume_check=resume_check).step
        return self.start()

    def record(
        self,
        step: int,
        *,
        fields: Mapping[str, Any] | None = None,
        digests: Mapping[str, int] | None = None,
        data: Any = None,
        **scalars: Any,
    ) -> None:
        """Record step ``step`` (0-based, just finished) in ``history.jsonl``: a ``step`` row
        with the loop's scalars (floats also as exact bits) and a ``digests`` row with the
        digest of every tensor and value registered, after the step (spec/replay.md "Any
        loop"). ``ckptkit audit -- CMD`` and ``ckptkit replay RUN --from S -- CMD`` compare
        these rows and name the first step and tensor that differ. The re-run of a spiking
        step (the spike guard's, :meth:`GuardView.replaying`) is marked ``"rerun": true``, whoever records it.

        The rows go through :attr:`history`: the rows an interrupted run wrote after the
        resumed step (in the resumed rollback timeline) are dropped once, whoever writes first.
        A loop that records without :meth:`start` or :meth:`resume` takes the run directory's lease
        at its first row (R-LS16).

        Args:
            fields: row fields written as given (JSON values: a loop's own schema with its own
                ``_bits``, the reference trainer's, spec/trainer.md); not ``kind`` or ``step``.
            digests: the ``digests`` row's digests (default: every tensor and value registered).
            data: what the step consumed (a ``DataLoader`` batch: tensors, or a list, tuple or
                dict of them): its digest is the row's ``data`` field, so that a resume fed other
                data is named as ``data`` at its first step (spec/determinism.md R-D26).

        Example::

            state.record(step, loss=loss.item(), grad_norm=gn.item(), lr=sched.get_last_lr()[0], data=batch)

        Raises:
            TypeError: a scalar that is not a number, string or one-element tensor, or ``fields``
                naming ``kind`` or ``step``.
            RunDirInUse: the first row of a loop without :meth:`start` or :meth:`resume`, while
                another job holds the run directory.
            ValueError: that, in a distributed run (every rank calls start() or resume() first).
        """
        from ..format._tree import localized
        from ._fingerprint import checkpoint_digests, data_digest
        from ._history import digests_row, step_row

        if fields is not None and not fields.keys().isdisjoint(("kind", "step")):
            raise TypeError("record(): fields may not name kind or step (the row's own)")
        if self.rank != 0 or self._replaying == "replay":
            return  # a distributed run's history is rank 0's; a replayed step is recorded already
        row = {**step_row(step, scalars), **(fields or {})}
        if data is not None:
            row["data"] = data_digest(data)
        if self._replaying == "rerun":
            row["rerun"] = True  # the re-run of a spiking step (spec/rollback.md R-R04)
        if self._began is None:  # a loop that records without start() or resume(): its history opens here
            if not isinstance(self._group, Alone):
                raise ValueError(
                    f"{self.run_dir}: a distributed run records after start() or resume(), which every rank "
                    "calls to take the run directory's lease before anything is written (R-LS16)"
                )
            self._hold()
            self._began = step
        if digests is None:
            digests = checkpoint_digests(localized(self.checkpoint(step + 1)))
        self._history.append(row)
        self._history.append(digests_row(step + 1, digests))

    @property
    def history(self) -> History:
        """The run's ``history.jsonl``: one :class:`~ckptkit.run.History` for every writer in this
        process (:meth:`record`, the spike guard, the loop's own rows), made the run's by its
        first writer at the step :meth:`start` or :meth:`resume` began at (a fresh file, or the
        rows after it dropped, the notes logged), once, so that no writer drops what another
        wrote. On a rank other than 0 of a distributed run it writes nothing.

        Appending raises ``ValueError`` when neither :meth:`start` nor :meth:`resume` has run in
        this process.
        """
        return self._history

    def _opening(self) -> tuple[int, int]:
        """Where the run's history opens: the step this process began at, and its timeline."""
        began = self._began
        if began is None:
            raise ValueError(f"{self._history.path}: the run's history opens at start() or resume(); call one first")
        os.makedirs(self._store.work_dir, exist_ok=True)
        return began, self._timeline() if began and self._timeline is not None else 0

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


class _Silent(History):
    """The run's history seen from a rank other than 0: rank 0 writes the file, the others nothing."""

    def open(self) -> list[str]:
        return []

    def rows(self) -> list[dict[str, Any]]:
        return []

    def append(self, row: dict[str, Any]) -> None:
        pass

    def hold(self, row: dict[str, Any]) -> None:
        pass


class GuardView:
    """What a spike guard asks of and does to a :class:`RunState` beyond a loop's calls
    (:meth:`RunState.guard_view`): one small face, so the run's own stays what a loop calls."""

    def __init__(self, state: RunState) -> None:
        self._state = state

    def data_positions(self) -> dict[str, int]:
        """Every registered data position, by name, where the stream is now."""
        return {name: entry.get() for name, entry in self._state._reg.data.items()}

    def expected_position(self, name: str, step: int) -> int | None:
        """Where data position ``name``'s offset rule says the stream must be after ``step``
        steps, given the registered values as they are now (None: it has no rule)."""
        values = {n: e.get() for n, e in self._state._reg.values.items()}  # as a checkpoint at `step` would hold them
        want = self._state._reg.data[name].expected_at(step, values)
        return None if want is None else int(want)

    def monitor_name(self, monitor: Any) -> str | None:
        """The name ``monitor`` (this very object) is registered under, or None."""
        return next((n for n, m in self._state._reg.monitors.items() if m is monitor), None)

    def lr(self) -> float:
        """The LR of the first registered optimizer's first param group (NaN: none is registered)."""
        return self._state._reg.lr()

    def scale_lr(self, factor: float) -> None:
        """Multiply the LR of what is registered by ``factor``: every optimizer's param groups
        (and their ``initial_lr``) and every scheduler's base LRs, so that closed-form and
        chainable schedules alike keep the change for the rest of the run (a spike rollback's
        LR drop, spec/rollback.md R-R06)."""
        self._state._reg.scale_lr(factor)

    def use_timeline(self, get: Callable[[], int]) -> None:
        """The history's timeline after a resume is ``get()`` (the number of rollbacks the
        restored state lives after): a resumed history keeps that timeline's rows. The spike
        guard sets it; without one the timeline is 0 (spec/rollback.md R-R10)."""
        self._state._timeline = get

    @contextlib.contextmanager
    def replaying(self, *, rerun: bool = False) -> Iterator[None]:
        """While open, the loop's steps are not new steps of the run: a ring rebuild's replay
        (:meth:`RunState.record` writes nothing: their rows exist) or, with ``rerun``, a spiking step
        re-run from the state before it (its step row says ``"rerun": true``, R-R04)."""
        was = self._state._replaying
        self._state._replaying = "rerun" if rerun and was is None else "replay"  # a re-run inside a replay: a replay
        try:
            yield
        finally:
            self._state._replaying = was
