"""Where a run lives, as one plug: a local directory or an object prefix.

:func:`place_for` is the one question "is this path a URL?" in the library (spec/objectstore.md
§1); it answers with a :class:`Place`, and the code above it never asks again: where a caller
takes another road it asks the place (:attr:`Place.fetches`, :meth:`Place.make`), and a surface
that serves local files only has this module refuse a URL (:func:`local_only`). A place keeps a
run's small records. The lease (``lease.json``) is read with a version, created only where
none is, and replaced or removed only while the version read still holds. A local directory
does it with files: a hard link creates without replacing (the local form of
``If-None-Match: *``), an atomic rename replaces, and a version is the digest of the bytes,
read back after each write; an object prefix does it with conditional requests
(``If-None-Match: *``, ``If-Match`` on the ETag). The records a run writes as files
(``environment.json``, ``history.jsonl``) are written in the place's *stage*, a local folder:
a local directory's stage is the directory itself; an object prefix's is a private folder, and
:meth:`Place.bring` and :meth:`Place.send` move a record between it and the prefix as one whole
object (spec/objectstore.md R-O23).

A place also keeps a run's checkpoints, whatever their format (the stores above say *what* a
checkpoint is, the place *where* it lives): a store writes a step's files in the stage and the
place commits them with the container it writes (a local directory: the container renamed into
place last; a prefix: the container streamed up while it is written, R-O52, the companions from
their files, R-O51, then the one commit record, R-O10), names what is committed, fetches a
committed one into the stage to be read (checked against its record, R-O14), removes one (the
commit first, R-O17) and sweeps what interrupted saves left (R-O16).
spec/lease.md and spec/objectstore.md are the contract; tests/format/test_place_contract.py runs
the same tests against both.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import BinaryIO, Protocol

from ..errors import CheckpointNotFound, CommitConflict, UnreadableFile, UnsupportedOption
from ._atomic import atomic_write, clean_stale_temps, create_exclusive, write_bytes_atomic
from ._commit import RECORD_SUFFIX, commit, fetch_committed, listing, remove, sweep
from ._io import Source, open_regular
from ._objectstore import PROBE_PREFIX, Body, FileSpan, ObjectStore, single_writer_vouched, store_for
from ._urls import is_url, parse

__all__ = [
    "LocalPlace",
    "ObjectPlace",
    "Place",
    "list_run_dir",
    "local_only",
    "place_and_name",
    "place_for",
    "read_file",
    "serves",
    "write_file",
]


class Place(Protocol):
    """Where a run lives; its records and checkpoints are named by their file names (``lease.json``,
    ``step-00000120.ckpt``)."""

    #: The directory or ``s3://`` prefix, as given: what messages name.
    where: str
    #: True where a checkpoint is read from a copy fetched into the stage, every object checked
    #: against its commit record (an object prefix, R-O14); False where it is read where it is (a
    #: local directory, R-O36): what a command that walks files (``verify``, ``diff``) asks.
    fetches: bool

    def make(self) -> None:
        """The place ready for a first file: a local directory and its parents made; an object
        prefix needs nothing (it is there once an object is under it)."""
        ...

    def child(self, name: str) -> str:
        """Where the record ``name`` is (a path, or a URL): what a message names."""
        ...

    def read(self, name: str, *, kind: str, limit: int) -> tuple[bytes, str] | None:
        """The record ``name`` (at most ``limit`` bytes of it) and its version; None when there is none.

        Raises:
            UnreadableFile: something is there that is no readable ``kind`` file (a local FIFO,
                a directory); ``StoreUnavailable``: the place cannot be reached.
        """
        ...

    def create(self, name: str, data: bytes) -> str:
        """Create the record ``name`` holding ``data`` only where none is; its version.

        Raises:
            CommitConflict: one is there (another writer's).
        """
        ...

    def replace(self, name: str, data: bytes, version: str) -> str:
        """Replace the record ``name`` with ``data`` only while it is the one of ``version``; the new version.

        Raises:
            CommitConflict: it is another now (``CheckpointNotFound``: there is none).
        """
        ...

    def delete_if(self, name: str, version: str) -> None:
        """Remove the record ``name`` only while it is the one of ``version``.

        Raises:
            CommitConflict: it is another now (``CheckpointNotFound``: there is none).
        """
        ...

    @property
    def stage(self) -> str:
        """The local folder where the run's records are written as files (``history.jsonl``)."""
        ...

    def bring(self, name: str) -> bool:
        """The record ``name`` into the stage as it is at the place now; False when the place has
        none (the stage is then left as it was)."""
        ...

    def send(self, name: str) -> None:
        """The stage's record ``name`` to the place, whole, when it changed since it was brought
        or last sent (none in the stage: nothing)."""
        ...

    def close(self) -> None:
        """Free the stage (a record not sent is lost)."""
        ...

    def began(self) -> bool:
        """Something of a run is at the place beyond what its stage shows (a local directory: nothing
        is, its stage being the directory; a prefix: any object but a store check's probe, R-O49)."""
        ...

    def unchecked(self) -> bool:
        """The user vouched that one job at a time writes here, instead of the store's conditional
        writes being checked (R-O49); never for a local directory."""
        ...

    def names(self, suffix: str, *, marker: str | None = None) -> dict[str, bool]:
        """``{name: committed}`` of the checkpoints named ``...suffix`` at the place. A local directory
        names every entry so named, committed unless a directory without its ``marker`` file; a prefix
        names only those its commit records commit (R-O15: objects without one are no checkpoint)."""
        ...

    def commit(self, name: str, companions: Sequence[str], write: Callable[[BinaryIO], object]) -> None:
        """Commit the checkpoint ``name``: its container, which ``write(f)`` writes, and its
        ``companions`` (file names, written in the stage beside it). Locally the container is written
        atomically into place, after them: the commit; on a prefix it streams up while it is written
        (R-O52), then the companions go up (R-O51), then its one commit record (R-O10), and the stage
        copies go.

        Raises:
            CommitConflict, SaveFailed: nothing committed; earlier checkpoints are intact.
        """
        ...

    def make_room(self, name: str) -> None:
        """Before the checkpoint ``name`` is saved again (a rollback's save): a prefix has no atomic
        replace, so its committed one goes, record first (R-O38); a local rename replaces: nothing."""
        ...

    def hand_over(self, name: str, parts: Sequence[str]) -> dict[str, bytes] | None:
        """The companions ``parts`` written in the stage beside ``name``, for a writer that commits them
        with the checkpoint (a prefix: their bytes, the stage copies gone); locally None, the files
        staying where they are."""
        ...

    def fetch(
        self, name: str, layout: Callable[[str, str], str] | None = None, *, only: Callable[[str], bool] | None = None
    ) -> str:
        """The committed checkpoint ``name`` in the stage, to be read there; its path. A prefix fetches
        every object its record lists (``only``: those whose key it keeps, the small ones a reader
        needs whole, which reads the others by range), each checked (R-O14), to ``layout(name, key)``
        (default: the key), once until :meth:`release`; a local directory's is where it is, whole.

        Raises:
            CheckpointNotFound, IncompleteCheckpoint, ChecksumMismatch, FormatError: (a prefix) no
                such committed checkpoint, or an object differs from its record (named).
        """
        ...

    def release(self, name: str) -> None:
        """Free the stage copy :meth:`fetch` made of ``name`` (locally nothing)."""
        ...

    def remove(self, name: str, files: Sequence[str]) -> None:
        """Uncommit and remove the checkpoint ``name``: locally its ``files`` (paths in the stage, the
        commit first; one ending in a separator is a directory, removed whole), on a prefix its
        record first, then every object it listed (R-O17). A missing one is no error.

        Raises:
            OSError, CheckpointError: one would not go (retention says so and retries).
        """
        ...

    def sweep(self, suffix: str, named: Callable[[str], bool]) -> list[str]:
        """Remove what interrupted writes left (never a checkpoint); what was removed. Locally dead
        writers' temp files; on a prefix the objects of each ``named`` checkpoint without a record (R-O16)."""
        ...


def place_for(path: str | os.PathLike[str]) -> Place:
    """The place ``path`` names: an :class:`ObjectPlace` for an ``s3://`` prefix, else a
    :class:`LocalPlace` (R-O01: a URL never becomes a local folder named ``s3:``).

    Raises:
        UnsupportedOption: a URL of a scheme not served, or the S3 client is missing.
    """
    return ObjectPlace(os.fspath(path)) if is_url(path) else LocalPlace(os.fspath(path))


def place_and_name(path: str | os.PathLike[str]) -> tuple[Place, str]:
    """The place that holds ``path`` and its name there (``s3://b/run/step-3.dcp``: the prefix
    ``s3://b/run`` and ``step-3.dcp``; a trailing ``/`` is no part of the name).

    Raises:
        UnsupportedOption: as :func:`place_for`.
    """
    where, name = os.path.split(os.fspath(path).rstrip("/"))
    return place_for(where or "."), name


def serves(path: object) -> bool:
    """``path`` names what some place serves: a local path, or a URL of a served scheme with a bucket
    (R-O01, R-O02; whether the client is installed is asked when the place is made)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    if not is_url(path):
        return True
    with contextlib.suppress(UnsupportedOption):
        parse(path)
        return True
    return False


def local_only(path: str | os.PathLike[str], what: str, *, why: str = "", option: str = "") -> str:
    """``path`` as a local path, for a surface that does not serve object storage (R-O01).

    Raises:
        UnsupportedOption: ``path`` is a URL; the message names it (after ``option``, the setting
            that gave it), ``what`` refuses it, then ``why`` (what would go wrong and what to use
            instead) or the surfaces that serve ``s3://``.
    """
    text = os.fspath(path)
    if is_url(text):
        scheme = text.partition("://")[0]
        served = why or (
            "; ckptkit.save/load/verify/open_checkpoint, ckptkit.distributed, RunState, the Lightning plug-in and "
            "`ckptkit train --run-dir/verify/inspect/diff/plot/replay RUN` serve s3://; use a local (or mounted) "
            "directory"
        )
        raise UnsupportedOption(
            f"{option}{text}: {what} does not serve {scheme}:// URLs yet (it writes and reads local files only){served}"
        )
    return text


def read_file(path: str | os.PathLike[str]) -> Source:
    """The checkpoint file at ``path`` to be read: a local file, or at an ``s3://`` URL the committed
    object, its size and digest checked against its record (R-O14), in an unlinked temporary file
    that tensors map as a file's (named by the URL).

    Raises:
        CheckpointNotFound: nothing is at ``path``; IncompleteCheckpoint, ChecksumMismatch,
            FormatError: (a URL) objects without a commit record, or damaged (named);
            UnsupportedOption: another scheme, or no S3 client.
    """
    if not is_url(path):
        return Source(path)
    from ._remote import remote_source

    return remote_source(path)


def write_file(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Write the checkpoint file at ``path`` through ``write(f)``, whole or not at all: locally renamed
    into place; at an ``s3://`` URL the same bytes, committed by its record (R-O10, R-O18).

    Raises:
        CommitConflict: (a URL) a checkpoint is committed there already (R-O11); SaveFailed,
            OSError: nothing at ``path`` is replaced.
    """
    if not is_url(path):
        atomic_write(path, write)
        return
    from ._remote import put_checkpoint

    put_checkpoint(path, write)


def list_run_dir(run_dir: str) -> list[str]:
    """The names in ``run_dir`` (none when it does not exist).

    Raises:
        UnreadableFile: it cannot be listed (no permission, not a directory) (R-025).
    """
    try:
        return os.listdir(run_dir)
    except FileNotFoundError:
        return []
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, "error")
        raise UnreadableFile(
            f"{run_dir}: cannot list the run directory ({code}: {e.strerror}); "
            "check its permissions, or run as its owner",
            errno=e.errno,
            path=run_dir,
        ) from None


def _version(data: bytes) -> str:
    """A local record's version: what tells two contents apart (a rewrite of the same bytes is the same)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class LocalPlace:
    """A local (or mounted) directory; its records are files in it."""

    fetches = False

    def __init__(self, where: str) -> None:
        self.where = where

    def make(self) -> None:
        os.makedirs(self.where, exist_ok=True)

    def child(self, name: str) -> str:
        return os.path.join(self.where, name)

    def read(self, name: str, *, kind: str, limit: int) -> tuple[bytes, str] | None:
        try:  # opened without blocking and checked to be a file, as every file of a run
            fd, _size = open_regular(self.child(name), kind)
        except CheckpointNotFound:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit)
        return data, _version(data)

    def _now(self, name: str) -> str | None:
        """The version of the record ``name`` as it is now (None: there is none)."""
        try:
            with open(self.child(name), "rb") as f:
                return _version(f.read())
        except FileNotFoundError:
            return None

    def _still(self, name: str, version: str) -> None:
        """The record ``name`` is the one of ``version``.

        Raises:
            CommitConflict: it is another (``CheckpointNotFound``: there is none).
        """
        now = self._now(name)
        if now is None:
            raise CheckpointNotFound(f"{self.child(name)}: no such file")
        if now != version:
            raise CommitConflict(f"{self.child(name)}: replaced by another writer", path=self.child(name))

    def create(self, name: str, data: bytes) -> str:
        os.makedirs(self.where, exist_ok=True)
        if not create_exclusive(self.child(name), data):
            raise CommitConflict(f"{self.child(name)}: already exists", path=self.child(name))
        return _version(data)

    def replace(self, name: str, data: bytes, version: str) -> str:
        """A rename cannot be conditional: the version is checked before the write and the bytes
        read back after it, so of two writers in the same instant at least one finds out."""
        self._still(name, version)
        write_bytes_atomic(self.child(name), data)
        self._still(name, _version(data))
        return _version(data)

    def delete_if(self, name: str, version: str) -> None:
        self._still(name, version)
        try:
            os.unlink(self.child(name))
        except FileNotFoundError:
            raise CheckpointNotFound(f"{self.child(name)}: no such file") from None

    @property
    def stage(self) -> str:
        """The directory itself: a record written in the stage is at the place."""
        return self.where

    def bring(self, name: str) -> bool:
        return os.path.lexists(self.child(name))

    def send(self, name: str) -> None:
        """Nothing to do: the stage is the place."""

    def close(self) -> None:
        """Nothing to free: the stage is the run directory."""

    def began(self) -> bool:
        return False

    def unchecked(self) -> bool:
        return False

    def names(self, suffix: str, *, marker: str | None = None) -> dict[str, bool]:
        return {
            n: marker is None or not os.path.isdir(self.child(n)) or os.path.isfile(os.path.join(self.child(n), marker))
            for n in list_run_dir(self.where)
            if n.endswith(suffix)
        }

    def commit(self, name: str, companions: Sequence[str], write: Callable[[BinaryIO], object]) -> None:
        """The container, renamed into place after its companions, is the commit."""
        atomic_write(self.child(name), write)

    def make_room(self, name: str) -> None:
        """Nothing to do: the save's rename replaces it in one step."""

    def hand_over(self, name: str, parts: Sequence[str]) -> dict[str, bytes] | None:
        return None

    def fetch(
        self, name: str, layout: Callable[[str, str], str] | None = None, *, only: Callable[[str], bool] | None = None
    ) -> str:
        return self.child(name)

    def release(self, name: str) -> None:
        """Nothing to free: the checkpoint was read where it is."""

    def remove(self, name: str, files: Sequence[str]) -> None:
        for path in files:
            if path.endswith(os.sep):  # a directory checkpoint's own directory, removed whole
                if os.path.isdir(path):
                    shutil.rmtree(path)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def sweep(self, suffix: str, named: Callable[[str], bool]) -> list[str]:
        return clean_stale_temps(self.where)


class ObjectPlace:
    """An ``s3://bucket/prefix``; its records are objects under it, written with conditional requests."""

    fetches = True

    def __init__(self, where: str) -> None:
        self.where = where
        self.url = parse(where)
        self.objects: ObjectStore = store_for(self.url)
        self._stage: str | None = None  # made on first use
        self._sent: dict[str, str | None] = {}  # each record's version as last brought or sent (None: none)
        self._fetched: dict[str, list[str]] = {}  # each checkpoint fetched into the stage: its files

    def child(self, name: str) -> str:
        return str(self.url.child(name))

    def make(self) -> None:
        """Nothing to make: a prefix is there once an object is under it."""

    def _key(self, name: str) -> str:
        return self.url.child(name).key

    def read(self, name: str, *, kind: str, limit: int) -> tuple[bytes, str] | None:
        with contextlib.suppress(CheckpointNotFound):
            data, etag = self.objects.read(self._key(name))
            return data[:limit], etag
        return None

    def create(self, name: str, data: bytes) -> str:
        return self.objects.put(self._key(name), data, if_absent=True)

    def replace(self, name: str, data: bytes, version: str) -> str:
        return self.objects.replace(self._key(name), data, version)

    def delete_if(self, name: str, version: str) -> None:
        self.objects.delete_if(self._key(name), version)

    @property
    def stage(self) -> str:
        """A private folder named as the prefix, made on first use: a record written there is at the
        place once sent."""
        if self._stage is None:
            self._stage = os.path.join(tempfile.mkdtemp(prefix="ckptkit-"), self.url.name or self.url.bucket)
            os.mkdir(self._stage)
        return self._stage

    def bring(self, name: str) -> bool:
        try:
            data = self.objects.get(self._key(name))
        except CheckpointNotFound:
            self._sent[name] = None
            return False
        with open(os.path.join(self.stage, name), "wb") as f:
            f.write(data)
        self._sent[name] = _version(data)
        return True

    def send(self, name: str) -> None:
        """One whole object (R-O23); only when it changed, so that a run whose rows did not change
        puts nothing."""
        try:
            with open(os.path.join(self.stage, name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        if _version(data) != self._sent.get(name):
            self.objects.put(self._key(name), data)
            self._sent[name] = _version(data)

    def close(self) -> None:
        if self._stage is not None:
            shutil.rmtree(os.path.dirname(self._stage), ignore_errors=True)

    def began(self) -> bool:
        """Any object under the prefix: the run's environment record, or what a save left (not a
        store check's probe, which a process killed in the middle of it leaves: R-O49)."""
        found = self.objects.list(self._key(""))
        return any(not key.rpartition("/")[2].startswith(PROBE_PREFIX) for key, _size, _modified in found)

    def unchecked(self) -> bool:
        return single_writer_vouched()

    def names(self, suffix: str, *, marker: str | None = None) -> dict[str, bool]:
        return {name: True for name, committed in listing(self.objects, self.url, suffix).items() if committed}

    def commit(self, name: str, companions: Sequence[str], write: Callable[[BinaryIO], object]) -> None:
        """Removes a committed ``name`` first (:meth:`make_room`); the stage copies go, committed or not."""
        try:
            self.make_room(name)
            with contextlib.ExitStack() as files:  # each goes up from its file, a part at a time (R-O51)
                objects: list[tuple[str, Body]] = []
                for part in companions:
                    f = files.enter_context(open(os.path.join(self.stage, part), "rb"))
                    objects.append((part, FileSpan(f.fileno(), os.fstat(f.fileno()).st_size)))
                commit(self.objects, self.url, name, write, objects)
        finally:
            for part in companions:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.stage, part))

    def make_room(self, name: str) -> None:
        """A crash in between leaves no checkpoint at that step, so the resume starts from an earlier
        one, which re-runs to the same rollback."""
        if self.objects.head(self._key(name + RECORD_SUFFIX)) is not None:
            remove(self.objects, self.url, name)

    def hand_over(self, name: str, parts: Sequence[str]) -> dict[str, bytes]:
        out = {}
        for part in parts:
            path = os.path.join(self.stage, part)
            with open(path, "rb") as f:
                out[part[len(name) + 1 :]] = f.read()
            os.unlink(path)
        return out

    def fetch(
        self, name: str, layout: Callable[[str, str], str] | None = None, *, only: Callable[[str], bool] | None = None
    ) -> str:
        if name not in self._fetched:
            self.release(name)
            self._fetched[name] = fetch_committed(self.objects, self.url, name, self.stage, layout, only)
        return os.path.join(self.stage, name)

    def release(self, name: str) -> None:
        for path in self._fetched.pop(name, []):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(os.path.join(self.stage, name), ignore_errors=True)

    def remove(self, name: str, files: Sequence[str]) -> None:
        remove(self.objects, self.url, name)

    def sweep(self, suffix: str, named: Callable[[str], bool]) -> list[str]:
        """A save in progress writes a checkpoint's parts before its record, and a distributed one
        its rank objects before its metadata: each is named by the key up to its ``suffix``."""
        head, found = self._key(""), set()
        for key, _size, _modified in self.objects.list(head):
            rel = key[len(head) :]
            stem = rel.split(suffix + ".", 1)[0] + suffix if suffix + "." in rel else rel
            if "/" not in rel and stem.endswith(suffix) and named(stem):
                found.add(stem)
        return [key for stem in sorted(found) for key in sweep(self.objects, self.url, stem)]
