"""The object store: a one-process run whose run directory is an ``s3://`` prefix.

The same files as the single-file store (:class:`~ckptkit.run._file_store.FileStore`),
byte for byte, as objects: ``step-00000120.ckpt`` with its snapshot and sidecars, and
``environment.json``; each step is committed by its record ``step-00000120.ckpt.commit.json``
(spec/objectstore.md R-O10..R-O18, R-O22..R-O25). A step is written by the single-file
store's own writers into a private working directory, uploaded, committed, and its local
copy removed; a resume fetches a step's listed objects (each checked against its record)
into the working directory and checks them there as the single-file store checks its
files. ``history.jsonl`` lives in the working directory and goes up before each commit record
and when the run closes (R-O23), once it changed; the history comes down, and anything goes up,
only once the job holds the run's lease (spec/lease.md R-LS16).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

from ..distributed._objects import RemoteCheckpoint
from ..errors import CheckpointError
from ..format._asyncsave import AsyncSaver
from ..format._checkpoint import Checkpoint, save
from ..format._commit import RECORD_SUFFIX, commit, fetch_committed, listing, remove, sweep
from ..format._objectstore import PROBE_PREFIX, Body, FileSpan, store_for
from ..format._place import ObjectPlace
from ..format._sidecar import sidecar_path
from ..format._snapshot import Snapshot, read_snapshot, snapshot_path
from ..format._urls import parse
from ._dcp_store import DcpStore
from ._file_store import FileStore, bind, submit
from ._files import (
    CKPT_SUFFIX,
    DCP_SUFFIX,
    ENVIRONMENT_FILE,
    RunRecords,
    checkpoint_name,
    remove_companions,
    step_of,
    write_companions,
)
from ._group import Group, world_size_changed
from ._registry import Registry
from ._store import Opened

__all__ = ["ObjectDcpStore", "ObjectRunStore", "RunObjects"]


class RunObjects(RunRecords):
    """What both object stores share: the prefix, its place (whose stage is a private working
    directory, where the run's records are written: :class:`~ckptkit.run._files.RunRecords`) and
    retention."""

    run_dir: str
    keep: int
    log: Callable[[str], None]
    suffix: str  # the store's checkpoint names: step-N.ckpt, or a distributed run's step-N.dcp
    wait: Callable[[], None]  # each store's wait for its save in flight
    delete: Callable[[str], None]  # each store's removal of one step

    def path(self, step: int) -> str:
        return str(self.url.child(checkpoint_name(step, self.suffix)))

    def listing(self) -> list[tuple[int, str]]:
        """Committed checkpoints only: objects without a record are no checkpoint (R-O15)."""
        return self.steps(self.suffix)

    def committed(self) -> list[tuple[int, str]]:
        self.wait()
        return self.listing()

    def began(self) -> bool:
        """Any object under the prefix: the run's environment record, or what a save left (not a
        store check's probe, which a process killed in the middle of it leaves: R-O49)."""
        found = self.objects.list(self.url.child("").key)
        return any(not key.rpartition("/")[2].startswith(PROBE_PREFIX) for key, _size, _modified in found)

    def _open_objects(self, run_dir: str) -> None:
        self.place = place = ObjectPlace(run_dir)
        self.url, self.objects = place.url, place.objects

    def _key(self, name: str) -> str:
        return self.url.child(name).key

    def _here(self, path: str) -> str:
        """The working-directory copy of the object at ``path`` (a URL under the run)."""
        return os.path.join(self.work_dir, path.rpartition("/")[2])

    def steps(self, suffix: str) -> list[tuple[int, str]]:
        """The committed checkpoints of ``suffix``: objects without a record are no checkpoint (R-O15)."""
        found = listing(self.objects, self.url, suffix)
        named = [(step_of(name, suffix), name) for name, committed in found.items() if committed]
        return sorted((s, str(self.url.child(n))) for s, n in named if s is not None)

    def _replace(self, name: str) -> None:
        """Before this run saves step ``name`` again (a rollback's save of its target, spec/rollback.md
        R-R09): remove the committed one, record first (R-O38). Object storage has no atomic replace:
        a crash in between leaves no checkpoint at that step, so the resume starts from an earlier
        one, which re-runs to the same rollback."""
        if self.objects.head(self.url.child(name + RECORD_SUFFIX).key) is not None:
            remove(self.objects, self.url, name)

    def _retain(self) -> None:
        """Remove all but the newest ``keep`` steps, each record first (R-O17); a failure is said, and
        retried by the next save (the new step is committed already)."""
        for _step, path in self.listing()[: -self.keep]:
            try:
                self.delete(path)
            except CheckpointError as e:
                self.log(f"retention: cannot delete {path} ({e}); will retry at the next save")


class ObjectRunStore(RunObjects):
    """``step-N.ckpt`` objects under ``run_dir``, an ``s3://`` prefix (a one-process run)."""

    suffix = CKPT_SUFFIX
    names_optimizer_models = False

    def __init__(
        self,
        run_dir: str,
        reg: Registry,
        *,
        keep: int,
        compression: str,
        async_save: bool,
        log: Callable[[str], None],
    ) -> None:
        self.run_dir, self.reg, self.keep, self.compression, self.log = run_dir, reg, keep, compression, log
        self._open_objects(run_dir)
        # The single-file store over the working directory checks and opens the fetched copies.
        self._local = FileStore(self.work_dir, reg, keep=keep, compression=compression, async_save=False, log=log)
        self._saver: AsyncSaver | None = AsyncSaver(compression=compression) if async_save else None

    # ------------------------------------------------------------------ names

    def any_checkpoints(self) -> bool:
        return bool(self.listing())

    def facts(self) -> dict[str, Any]:
        return {}

    def refuse_foreign(self) -> None:
        """Nothing to refuse: a prefix a distributed run saved into gets the DCP store (R-O35)."""

    def refuse_unstorable(self, kind: str, name: str, obj: Any) -> None:
        self._local.refuse_unstorable(kind, name, obj)

    def snapshot(self, path: str) -> Snapshot:
        return read_snapshot(snapshot_path(self._here(path)))

    # ------------------------------------------------------------------ save

    def save(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> str:
        if self._saver is not None:
            submit(self._saver, ckpt, sidecars, lambda taken, copied: self._write(step, taken, config, copied))
        else:
            self._write(step, ckpt, config, sidecars)
        return self.path(step)

    def _write(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> None:
        """The single-file store's bytes, written here, uploaded and committed (R-O22), then retention."""
        name = checkpoint_name(step)
        here = os.path.join(self.work_dir, name)
        try:
            record = write_companions(here, step, config, sidecars)
            save(here, bind(ckpt, record), compression=self.compression)
            parts = [name, os.path.basename(snapshot_path(here)), *(f"{name}.{kind}" for kind in sorted(sidecars))]
            self.send_records()  # before the record: a commit never outruns its rows (R-O37)
            self._replace(name)
            with contextlib.ExitStack() as files:  # each goes up from its file, a part at a time (R-O51)
                objects: list[tuple[str, Body]] = []
                for part in parts:
                    f = files.enter_context(open(os.path.join(self.work_dir, part), "rb"))
                    objects.append((part, FileSpan(f.fileno(), os.fstat(f.fileno()).st_size)))
                commit(self.objects, self.url, name, objects)
        finally:
            self._forget(here)
        self._retain()

    def _forget(self, here: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(here)
        remove_companions(here, self.reg.sidecars)

    def delete(self, path: str) -> None:
        remove(self.objects, self.url, path.rpartition("/")[2])

    def wait(self) -> None:
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        try:
            if self._saver is not None:
                self._saver.close()
            self.send_records()
        finally:
            self.place.close()

    # ------------------------------------------------------------------ resume

    def sweep(self) -> list[str]:
        """Remove the objects of every step that has no record (R-O16)."""
        found = listing(self.objects, self.url, CKPT_SUFFIX)
        return [
            key
            for name, committed in sorted(found.items())
            if not committed
            for key in sweep(self.objects, self.url, name)
        ]

    def _fetch_checkpoint(self, path: str) -> str:
        """Every object ``path``'s record lists, each checked (R-O14), into the working directory."""
        name = path.rpartition("/")[2]
        fetch_committed(self.objects, self.url, name, self.work_dir)
        self.place.bring(ENVIRONMENT_FILE)  # the companion record checks its digest
        return os.path.join(self.work_dir, name)

    def check(self, step: int, path: str) -> dict[str, Any] | None:
        return self._local.check(step, self._fetch_checkpoint(path))

    def open(self, path: str, *, reshard: bool) -> Opened:
        here = self._here(path)
        if not os.path.exists(here):
            here = self._fetch_checkpoint(path)
        return self._local.open(here, reshard=reshard)

    def load(self, path: str, opened: Opened, *, copy: bool = False) -> Checkpoint:
        self._forget(self._here(path))  # read into memory of its own (or mapped, which outlives the name)
        return self._local.load(path, opened, copy=copy)


class ObjectDcpStore(RunObjects, DcpStore):
    """``step-N.dcp`` checkpoints under ``run_dir``, an ``s3://`` prefix, saved and loaded by every
    rank of a distributed run (spec/objectstore.md R-O35..R-O37).

    A step is the objects of a :mod:`ckptkit.distributed` checkpoint at ``run_dir/step-N.dcp``
    (its metadata, every rank's data file) and rank 0's companions ``step-N.dcp.config.json`` and
    ``step-N.dcp.<kind>``, all listed by its one commit record. Each rank has a private working
    directory (no rank shares a local path with another: a node may be another machine); a step is
    checked and opened from a copy of its listed objects fetched there, each checked against the
    record, by the DCP store's own checks. Rank 0 uploads ``history.jsonl`` before each commit record and
    when the run closes, and ``environment.json`` at the start, as the one-process object store does.
    """

    def __init__(self, run_dir: str, reg: Registry, group: Group, **options: Any) -> None:
        """The DCP store's ``options`` (keep, compression, async_save, log), over the prefix ``run_dir``."""
        DcpStore.__init__(self, run_dir, reg, group, **options)
        self._open_objects(run_dir)
        self._staged: dict[str, bytes] = {}

    @staticmethod
    def saved_into(run_dir: str) -> bool:
        """A distributed run committed a step under the ``s3://`` prefix ``run_dir`` (so a resume
        in one process takes this store, with a reshard: RS-D7)."""
        url = parse(run_dir)
        return any(listing(store_for(url), url, DCP_SUFFIX).values())

    def any_checkpoints(self) -> bool:
        return bool(self.listing() or self.steps(CKPT_SUFFIX))

    def refuse_foreign(self) -> None:
        """A distributed run refuses a prefix a one-process run saved into (R-O35).

        Raises:
            WorldSizeChanged: the prefix holds committed ``step-*.ckpt`` checkpoints.
        """
        if self.steps(CKPT_SUFFIX):
            raise world_size_changed(self.run_dir, {}, self.facts())

    def snapshot(self, path: str) -> Snapshot:
        return read_snapshot(snapshot_path(self._here(path)))

    # ------------------------------------------------------------------ save

    def _companions(self, path: str, step: int, config: bytes, sidecars: Mapping[str, Any]) -> dict[str, Any]:
        """Rank 0: the companions written in the working directory (bound to the run's environment
        record there), read back to be committed with the step by its record (R-O36)."""
        here = self._here(path)
        self._replace(path.rpartition("/")[2])  # every rank waits for rank 0 here, before it writes
        if not os.path.exists(os.path.join(self.work_dir, ENVIRONMENT_FILE)):
            self.place.bring(ENVIRONMENT_FILE)
        try:
            record = write_companions(here, step, config, sidecars)
            staged = {}
            for part in [snapshot_path(here), *(sidecar_path(here, kind) for kind in sorted(sidecars))]:
                with open(part, "rb") as f:
                    staged[part[len(here) + 1 :]] = f.read()
        finally:
            self._forget(here)
        self._staged = staged
        self.send_records()  # before the record: a commit never outruns its rows (R-O37)
        return record

    def _companion_objects(self) -> dict[str, bytes] | None:
        staged, self._staged = self._staged, {}
        return staged if self.rank == 0 else None

    def delete(self, path: str) -> None:
        remove(self.objects, self.url, path.rpartition("/")[2])

    def close(self) -> None:
        try:
            DcpStore.close(self)
            if self.rank == 0:
                self.send_records()
        finally:
            self.place.close()

    # ------------------------------------------------------------------ resume

    def sweep(self) -> list[str]:
        """Rank 0: remove the objects of every step without a record, its rank objects included (R-O16)."""
        head, names = self.url.child("").key, set()
        for key, _size, _modified in self.objects.list(self.url.child("").key):
            name = key[len(head) :].split(".", 2)
            if len(name) >= 2 and name[1] == DCP_SUFFIX[1:] and step_of(".".join(name[:2]), DCP_SUFFIX) is not None:
                names.add(".".join(name[:2]))
        return [key for name in sorted(names) for key in sweep(self.objects, self.url, name)]

    def _copy(self, path: str) -> str:
        """The working-directory copy of the step at ``path``: every listed object, each checked (R-O14)."""
        here = self._here(path)
        if not os.path.exists(os.path.join(here, "metadata.ckdcp")):
            self._forget(here)
            RemoteCheckpoint.at(path).fetch_all(self.work_dir)
            self.place.bring(ENVIRONMENT_FILE)  # the companion record checks its digest
        return here

    def _forget(self, here: str) -> None:
        shutil.rmtree(here, ignore_errors=True)
        remove_companions(here, self.reg.sidecars)

    def check(self, step: int, path: str) -> dict[str, Any] | None:
        return DcpStore.check(self, step, self._copy(path))

    def open(self, path: str, *, reshard: bool) -> Opened:
        return DcpStore.open(self, self._copy(path), reshard=reshard)

    def load(self, path: str, opened: Opened, *, copy: bool = False) -> Checkpoint:
        here = self._copy(path)
        try:
            return self._load(here, opened.ckpt, copy=copy)
        finally:
            self._forget(here)
