"""A ``ckptkit.distributed`` checkpoint at an ``s3://`` URL: its files as objects, committed by one record.

The checkpoint ``s3://bkt/P/N`` is the objects (spec/objectstore.md R-O30, R-O31)::

    P/N                       the bytes of metadata.ckdcp, put by the coordinator after every rank's
    P/N.rank-<r>.ckdcp        the bytes of rank r's data file, put by rank r
    P/N.<companion>           what the coordinator was given to commit with it (a RunState's snapshot, sidecars)
    P/N.commit.json           the commit record listing all of them, put last, once, by the coordinator

one checkpoint of the commit-record engine (:mod:`ckptkit.format._commit`): each rank puts its
object conditionally and hands ``(key, size, xxh3, ETag)`` to the coordinator through DCP's
gather; the coordinator puts the metadata and then the record. A rank that dies leaves no
record, so nothing of the save is ever read (R-O15), and the next save of ``N`` cleans what it
left (R-O16). A reader fetches the record, then only the objects it lists, each checked against
its size and digest before a byte of it is parsed, into a private local directory laid out as a
local checkpoint directory (R-O18: the same bytes), which the local reader then reads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..errors import IncompleteCheckpoint, UnsupportedOption
from ..format._commit import Entry, Written, begin, fetch, fetch_committed, finish, put_objects, read_record
from ..format._objectstore import Body, FileSpan, ObjectStore
from ..format._remote import locate
from ..format._urls import StorageURL
from ._format import METADATA_NAME, DirMetadata, data_name

T = TypeVar("T")
U = TypeVar("U")

__all__ = [
    "RemoteCheckpoint",
    "check_listed",
    "discard",
    "local_name",
    "put_file",
    "refuse_local_companions",
    "scratch",
]


def local_name(name: str, key: str) -> str:
    """Where the object ``key`` (relative, listed by ``name``'s record) lies in a local copy of
    the checkpoint's directory ``name``: the metadata and rank files inside it, companions beside it."""
    if key == name:
        return os.path.join(name, METADATA_NAME)
    rest = key[len(name) + 1 :]
    if rest.startswith("rank-") and rest.endswith(".ckdcp"):
        return os.path.join(name, rest)
    return key


@dataclass(frozen=True)
class RemoteCheckpoint:
    """The checkpoint at an ``s3://`` URL: its bucket, prefix and name."""

    url: str
    store: ObjectStore
    base: StorageURL
    name: str

    @classmethod
    def at(cls, checkpoint_id: str | os.PathLike[str]) -> RemoteCheckpoint:
        """Raises: UnsupportedOption: a URL naming a bucket only, another scheme, or no S3 client."""
        store, base, name = locate(checkpoint_id)
        return cls(str(base.child(name)), store, base, name)

    def rank_key(self, rank: int) -> str:
        return f"{self.name}.{data_name(rank)}"

    # ------------------------------------------------------------------ writing

    def begin(self) -> None:
        """The coordinator, before any rank writes: refuse a committed checkpoint, clean an interrupted one.

        Raises:
            CommitConflict: committed already (written once, R-O11), or another writer's objects are young.
        """
        begin(self.store, self.base, self.name)

    def put_rank(self, rank: int, data: Body) -> Written:
        """Rank ``rank``'s data file, as its object (conditional put)."""
        return put_objects(self.store, self.base, self.name, [(self.rank_key(rank), data)])[0]

    def commit(self, metadata: Body, companions: Mapping[str, bytes], ranks: Sequence[Written]) -> None:
        """The coordinator: the metadata and companions as objects, then the one record listing every object.

        Raises:
            CommitConflict: another writer created or replaced one of them (R-O11); nothing committed.
            SaveFailed: a put failed; nothing committed.
        """
        mine: list[tuple[str, Body]] = [
            (self.name, metadata),
            *((f"{self.name}.{s}", b) for s, b in sorted(companions.items())),
        ]
        written = put_objects(self.store, self.base, self.name, mine)
        finish(self.store, self.base, self.name, [*written, *ranks])

    # ------------------------------------------------------------------ reading

    def entries(self) -> dict[str, Entry]:
        """The record's entries by key.

        Raises:
            CheckpointNotFound: no object of the checkpoint exists.
            IncompleteCheckpoint: no record (an interrupted save), naming the objects it left (R-O15).
            FormatError: a damaged record.
        """
        return {e.key: e for e in read_record(self.store, self.base, self.name)}

    def fetch(self, entries: Mapping[str, Entry], key: str, into: str) -> str:
        """The listed object ``key``, checked against its entry (R-O14), into the local copy under
        ``into``; its local path.

        Raises:
            IncompleteCheckpoint: ``key`` is not listed, or listed and missing.
            ChecksumMismatch, FormatError: its bytes differ from the record's (the object named).
        """
        entry = entries.get(key)
        if entry is None:
            raise IncompleteCheckpoint(
                f"{self.store.url(self._key(key))}: not listed by the commit record {self.name}.commit.json of "
                f"{self.url}; a checkpoint's objects are exactly those its record lists (R-O31)",
                (key,),
            )
        path = os.path.join(into, local_name(self.name, key))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fetch(self.store, self.base, entry, path)
        return path

    def fetch_all(self, into: str) -> str:
        """Every listed object into a local copy under ``into`` (R-O14); the copy's directory path."""
        fetch_committed(self.store, self.base, self.name, into, local_name)
        return os.path.join(into, self.name)

    def _key(self, rel: str) -> str:
        return f"{self.base.key}/{rel}" if self.base.key else rel


def check_listed(remote: RemoteCheckpoint, entries: Mapping[str, Entry], md: DirMetadata) -> None:
    """Every rank file the metadata names is listed by the record, with the size the metadata says (R-O33).

    Raises:
        IncompleteCheckpoint: one is not (each named by its object key and rank).
    """
    problems = []
    for rank, f in enumerate(md.files):
        key = remote.rank_key(rank)
        entry = entries.get(key)
        if entry is None:
            problems.append(f"{key} (rank {rank}) is not listed")
        elif entry.size != f.size:
            problems.append(f"{key} (rank {rank}) is listed with {entry.size} bytes, the metadata says {f.size}")
    if problems:
        raise IncompleteCheckpoint(
            f"{remote.url}: " + "; ".join(problems) + f" by its commit record {remote.name}.commit.json (R-O33)",
            tuple(p.split(" ")[0] for p in problems),
        )


def scratch() -> str:
    """A private local directory for one save's or load's copies (removed by :func:`discard`)."""
    return tempfile.mkdtemp(prefix="ckptkit-dcp-")


def discard(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def put_file(write: Callable[[str], T], name: str, put: Callable[[Body], U]) -> tuple[T, U]:
    """What ``write(directory)`` returns and what ``put`` returns for the file ``name`` it wrote
    there, read a part at a time as it goes up (R-O51): the local format's writer, for an object
    (in a private directory, removed after)."""
    local = scratch()
    try:
        result = write(local)
        with open(os.path.join(local, name), "rb") as f:
            return result, put(FileSpan(f.fileno(), os.fstat(f.fileno()).st_size))
    finally:
        discard(local)


def refuse_local_companions(companions: Mapping[str, bytes] | None, path: str) -> None:
    """Raises: UnsupportedOption: companions given for a local directory (they are written beside it)."""
    if companions:
        raise UnsupportedOption(
            f"{path}: companions are committed with a checkpoint on object storage only (R-O30); beside a local "
            "directory write them as files"
        )
