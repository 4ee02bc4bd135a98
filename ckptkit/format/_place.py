"""Where a run lives, as one plug: a local directory or an object prefix.

:func:`place_for` is the one question "is this path a URL?" the run's lease asks; it
answers with a :class:`Place`, and the code above it never asks again. A place keeps a
run's small records. The lease (``lease.json``) is read with a version, created only where
none is, and replaced or removed only while the version read still holds. A local directory
does it with files: a hard link creates without replacing (the local form of
``If-None-Match: *``), an atomic rename replaces, and a version is the digest of the bytes,
read back after each write; an object prefix does it with conditional requests
(``If-None-Match: *``, ``If-Match`` on the ETag). The records a run writes as files
(``environment.json``, ``history.jsonl``) are written in the place's *stage*, a local folder:
a local directory's stage is the directory itself; an object prefix's is a private folder, and
:meth:`Place.bring` and :meth:`Place.send` move a record between it and the prefix as one whole
object (spec/objectstore.md R-O23). spec/lease.md and spec/objectstore.md are the contract;
tests/format/test_place_contract.py runs the same tests against both.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from typing import Protocol

from ..errors import CheckpointNotFound, CommitConflict
from ._atomic import create_exclusive, write_bytes_atomic
from ._io import open_regular
from ._objectstore import ObjectStore, store_for
from ._urls import is_url, parse

__all__ = ["LocalPlace", "ObjectPlace", "Place", "place_for"]


class Place(Protocol):
    """Where a run lives; its records are named by their file names (``lease.json``)."""

    #: The directory or ``s3://`` prefix, as given: what messages name.
    where: str

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


def place_for(path: str | os.PathLike[str]) -> Place:
    """The place ``path`` names: an :class:`ObjectPlace` for an ``s3://`` prefix, else a
    :class:`LocalPlace` (R-O01: a URL never becomes a local folder named ``s3:``).

    Raises:
        UnsupportedOption: a URL of a scheme not served, or the S3 client is missing.
    """
    return ObjectPlace(os.fspath(path)) if is_url(path) else LocalPlace(os.fspath(path))


def _version(data: bytes) -> str:
    """A local record's version: what tells two contents apart (a rewrite of the same bytes is the same)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class LocalPlace:
    """A local (or mounted) directory; its records are files in it."""

    def __init__(self, where: str) -> None:
        self.where = where

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


class ObjectPlace:
    """An ``s3://bucket/prefix``; its records are objects under it, written with conditional requests."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.url = parse(where)
        self.objects: ObjectStore = store_for(self.url)
        self._stage: str | None = None  # made on first use
        self._sent: dict[str, str | None] = {}  # each record's version as last brought or sent (None: none)

    def child(self, name: str) -> str:
        return str(self.url.child(name))

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
        """A private folder, made on first use: a record written there is at the place once sent."""
        if self._stage is None:
            self._stage = tempfile.mkdtemp(prefix="ckptkit-run-")
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
            shutil.rmtree(self._stage, ignore_errors=True)
