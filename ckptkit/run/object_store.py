"""The object store: a one-process run whose run directory is an ``s3://`` prefix.

The same files as the single-file store (:class:`~ckptkit.run.file_store.FileStore`),
byte for byte, as objects: ``step-00000120.ckpt`` with its snapshot and sidecars, and
``environment.json``; each step is committed by its record ``step-00000120.ckpt.commit.json``
(spec/objectstore.md R-O10..R-O18, R-O22..R-O25). A step is written by the single-file
store's own writers into a private working directory, uploaded, committed, and its local
copy removed; a resume fetches a step's listed objects (each checked against its record)
into the working directory and checks them there as the single-file store checks its
files. ``history.jsonl`` lives in the working directory and goes up after each commit
and when the run closes (R-O23).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError, CheckpointNotFound
from ..format.asyncsave import AsyncSaver
from ..format.checkpoint import Checkpoint, save
from ..format.commit import listing, read_committed, remove, sweep
from ..format.objectstore import store_for
from ..format.snapshot import Snapshot, read_snapshot, snapshot_path
from ..format.urls import parse
from ._registry import Registry
from .file_store import FileStore, bind, submit
from .files import (
    CKPT_SUFFIX,
    ENVIRONMENT_FILE,
    checkpoint_name,
    read_environment,
    remove_companions,
    step_of,
    write_companions,
)
from .history import HISTORY_FILE
from .store import Opened

__all__ = ["ObjectRunStore"]


class ObjectRunStore:
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
        self.run_dir, self.url, self.reg, self.keep, self.compression, self.log = (
            run_dir, parse(run_dir), reg, keep, compression, log,
        )  # fmt: skip
        self.objects = store_for(self.url)
        self.work_dir = tempfile.mkdtemp(prefix="ckptkit-run-")
        # The single-file store over the working directory checks and opens the fetched copies.
        self._local = FileStore(self.work_dir, reg, keep=keep, compression=compression, async_save=False, log=log)
        self._saver: AsyncSaver | None = AsyncSaver(compression=compression) if async_save else None
        self._fetch(HISTORY_FILE, missing_ok=True)  # the rows so far; a resume drops those after its step

    # ------------------------------------------------------------------ names

    def _key(self, name: str) -> str:
        return self.url.child(name).key

    def _here(self, path: str) -> str:
        """The working-directory copy of the object at ``path`` (a URL under the run)."""
        return os.path.join(self.work_dir, path.rpartition("/")[2])

    def path(self, step: int) -> str:
        return str(self.url.child(checkpoint_name(step)))

    def listing(self) -> list[tuple[int, str]]:
        """Committed checkpoints only: objects without a record are no checkpoint (R-O15)."""
        found = listing(self.objects, self.url, CKPT_SUFFIX)
        steps = [(step_of(name), name) for name, committed in found.items() if committed]
        return sorted((s, str(self.url.child(n))) for s, n in steps if s is not None)

    def committed(self) -> list[tuple[int, str]]:
        self.wait()
        return self.listing()

    def any_checkpoints(self) -> bool:
        return bool(self.listing())

    def facts(self) -> dict[str, Any]:
        return {}

    def refuse_foreign(self) -> None:
        """Nothing to refuse: no distributed run saves to object storage (R-O01 refuses it)."""

    def refuse_unstorable(self, kind: str, name: str, obj: Any) -> None:
        self._local.refuse_unstorable(kind, name, obj)

    # ------------------------------------------------------------------ the run's records

    def _fetch(self, name: str, *, missing_ok: bool = False) -> None:
        """Copy the run-level object ``name`` (no record: environment, history) into the working directory."""
        try:
            data = self.objects.get(self._key(name))
        except CheckpointNotFound:
            if missing_ok:
                return
            raise CheckpointNotFound(f"{self.url.child(name)}: the run's environment record is missing") from None
        with open(os.path.join(self.work_dir, name), "wb") as f:
            f.write(data)

    def begin(self, environment: bytes) -> None:
        self.objects.put(self._key(ENVIRONMENT_FILE), environment)  # one whole object; a fresh run replaces it
        with open(os.path.join(self.work_dir, ENVIRONMENT_FILE), "wb") as f:
            f.write(environment)

    def environment(self) -> dict[str, Any]:
        self._fetch(ENVIRONMENT_FILE)
        return read_environment(self.work_dir)

    def snapshot(self, path: str) -> Snapshot:
        return read_snapshot(snapshot_path(self._here(path)))

    def _upload_history(self) -> None:
        """``history.jsonl`` as it stands, one whole object (R-O23)."""
        here = os.path.join(self.work_dir, HISTORY_FILE)
        if os.path.exists(here):
            with open(here, "rb") as f:
                self.objects.put(self._key(HISTORY_FILE), f.read())

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
            objects = []
            for part in parts:
                with open(os.path.join(self.work_dir, part), "rb") as f:
                    objects.append((part, f.read()))
            from ..format.commit import commit

            commit(self.objects, self.url, name, objects)
        finally:
            self._forget(here)
        self._upload_history()
        self._retain()

    def _forget(self, here: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(here)
        remove_companions(here, self.reg.sidecars)

    def _retain(self) -> None:
        """Remove all but the newest ``keep`` steps, each record first (R-O17); a failure is said, and
        retried by the next save (the new step is committed already)."""
        for _step, path in self.listing()[: -self.keep]:
            try:
                self.delete(path)
            except CheckpointError as e:
                self.log(f"retention: cannot delete {path} ({e}); will retry at the next save")

    def delete(self, path: str) -> None:
        remove(self.objects, self.url, path.rpartition("/")[2])

    def wait(self) -> None:
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        try:
            if self._saver is not None:
                self._saver.close()
            self._upload_history()
        finally:
            shutil.rmtree(self.work_dir, ignore_errors=True)

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
        for part, data in read_committed(self.objects, self.url, name).items():
            with open(os.path.join(self.work_dir, part), "wb") as f:
                f.write(data)
        self._fetch(ENVIRONMENT_FILE, missing_ok=True)  # the companion record checks its digest
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
