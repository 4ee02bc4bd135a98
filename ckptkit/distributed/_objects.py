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
left (R-O16). A reader fetches the record and the metadata object, checked against its entry
(R-O14), then only the byte ranges of the rank files that hold the chunks its plan reads
(:class:`RankRanges`, R-O33): each chunk is checked against its digest in that metadata, the
way a local load checks it, so no rank fetches another rank's whole file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

from ..errors import IncompleteCheckpoint, UnsupportedOption
from ..format._commit import (
    Entry,
    Written,
    begin,
    commit_begun,
    fetch,
    put_written,
    read_range,
    read_record,
)
from ..format._objectstore import ObjectStore
from ..format._remote import locate
from ..format._urls import StorageURL
from ._format import METADATA_NAME, DirMetadata, data_name

#: Chunks of one rank file fewer than this many bytes apart are read by one ranged GET, the bytes
#: between them read and dropped: a rank's many small tensors (biases, AdamW's step counters) cost
#: a few requests, never one each, and at most this much is read in vain per gap. 64 KiB take
#: less time to transfer than a request's round trip to S3 on any link where it matters.
RANGE_GAP = 64 << 10
#: A rank file's byte ranges are fetched in windows of at most this size (or the part size, if
#: smaller), up to RANGES_AHEAD at once ahead of the reads: at most 72 MiB held per rank (R-O51),
#: 8 connections in flight as a whole object's parallel ranged GETs have (R-O21).
RANGE_WINDOW = 8 << 20
RANGES_AHEAD = 8

__all__ = [
    "RANGES_AHEAD",
    "RANGE_GAP",
    "RANGE_WINDOW",
    "RankRanges",
    "RemoteCheckpoint",
    "check_listed",
    "discard",
    "is_rank_key",
    "local_name",
    "refuse_local_companions",
    "scratch",
]


def local_name(name: str, key: str) -> str:
    """Where the object ``key`` (relative, listed by ``name``'s record) lies in a local copy of
    the checkpoint's directory ``name``: the metadata and rank files inside it, companions beside it."""
    if key == name:
        return os.path.join(name, METADATA_NAME)
    if is_rank_key(name, key):
        return os.path.join(name, key[len(name) + 1 :])
    return key


def is_rank_key(name: str, key: str) -> bool:
    """Whether the object ``key`` listed by ``name``'s record is one of its rank files
    (``name.rank-00001.ckdcp``), which a reader reads by range (R-O36), never whole."""
    rest = key[len(name) + 1 :] if key.startswith(name + ".") else ""
    return rest.startswith("rank-") and rest.endswith(".ckdcp")


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

    def put_rank(self, rank: int, write: Callable[[BinaryIO], object]) -> Written:
        """Rank ``rank``'s data file, written by ``write(f)``, as its object (conditional put), each
        part uploaded while the file is written (R-O52)."""
        return put_written(self.store, self.base, self.name, self.rank_key(rank), write)

    def commit(
        self, write: Callable[[BinaryIO], object], companions: Mapping[str, bytes], ranks: Sequence[Written]
    ) -> None:
        """The coordinator: the metadata, written by ``write(f)`` as it goes up (R-O52), and the
        companions as objects, then the one record listing every object.

        Raises:
            CommitConflict: another writer created or replaced one of them (R-O11); nothing committed.
            SaveFailed: a put failed; nothing committed.
        """
        mine = [(f"{self.name}.{s}", b) for s, b in sorted(companions.items())]
        commit_begun(self.store, self.base, self.name, write, mine, ranks)

    # ------------------------------------------------------------------ reading

    def entries(self, *, name_leftovers: bool = True) -> dict[str, Entry]:
        """The record's entries by key; without a record, ``name_leftovers`` LISTs what the save left
        to name it (the coordinator's part, R-O33).

        Raises:
            CheckpointNotFound: no object of the checkpoint exists (not ``name_leftovers``: no record).
            IncompleteCheckpoint: no record (an interrupted save), naming the objects it left (R-O15).
            FormatError: a damaged record.
        """
        return {e.key: e for e in read_record(self.store, self.base, self.name, name_leftovers=name_leftovers)}

    def fetch(self, entries: Mapping[str, Entry], key: str, into: str) -> str:
        """The listed object ``key``, checked against its entry (R-O14), into the local copy under
        ``into``; its local path.

        Raises:
            IncompleteCheckpoint: ``key`` is not listed, or listed and missing.
            ChecksumMismatch, FormatError: its bytes differ from the record's (the object named).
        """
        entry = entries.get(key)
        if entry is None:
            raise self._unlisted(key)
        path = os.path.join(into, local_name(self.name, key))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fetch(self.store, self.base, entry, path)
        return path

    def ranges(self, entries: Mapping[str, Entry], rank: int, extents: Iterable[tuple[int, int]]) -> RankRanges:
        """The bytes ``[start, end)`` of each of ``extents`` in ``rank``'s listed data file, to be read
        by ranged GETs (R-O33); the caller checks their digests.

        Raises:
            IncompleteCheckpoint: the rank file is not listed.
        """
        key = self.rank_key(rank)
        entry = entries.get(key)
        if entry is None:
            raise self._unlisted(key)
        return RankRanges(self.store, self.base, entry, self.store.url(self._key(key)), extents)

    def _key(self, rel: str) -> str:
        return f"{self.base.key}/{rel}" if self.base.key else rel

    def _unlisted(self, key: str) -> IncompleteCheckpoint:
        return IncompleteCheckpoint(
            f"{self.store.url(self._key(key))}: not listed by the commit record {self.name}.commit.json of "
            f"{self.url}; a checkpoint's objects are exactly those its record lists (R-O31)",
            (key,),
        )


class RankRanges:
    """The parts of one listed rank file that a rank's load reads, as positional reads (what
    :func:`~ckptkit.distributed._storage.read_chunk` takes from a local file).

    The extents are merged where less than :data:`RANGE_GAP` apart and cut into windows of at most
    :data:`RANGE_WINDOW`; the windows are fetched in file order by ranged GETs, up to
    :data:`RANGES_AHEAD` of them at once ahead of the reads, so a rank holds at most that many
    windows of a rank file (R-O51), never the whole file, and fetches no byte outside its merged
    extents. Reads are expected in file order (a chunk's pieces, chunks by offset); a read behind
    the windows fetched is right, only fetched again.
    """

    def __init__(
        self, store: ObjectStore, base: StorageURL, entry: Entry, path: str, extents: Iterable[tuple[int, int]]
    ) -> None:
        self.store, self.base, self.entry = store, base, entry
        self.path = path  # the object's URL, which errors name
        spans: list[list[int]] = []
        for a, b in sorted((a, b) for a, b in extents if b > a):
            if spans and a - spans[-1][1] < RANGE_GAP:
                spans[-1][1] = max(spans[-1][1], b)
            else:
                spans.append([a, b])
        step = min(store.part_size, RANGE_WINDOW)
        self.todo = deque((a, min(a + step, end)) for start, end in spans for a in range(start, end, step))
        self.ahead: deque[tuple[int, Future[bytes]]] = deque()
        self.pool = ThreadPoolExecutor(RANGES_AHEAD, thread_name_prefix="ckptkit-ranges")
        self.window, self.at = b"", 0

    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the file's bytes from ``offset``, which lie inside the extents.

        Raises:
            IncompleteCheckpoint, FormatError: the object is missing or shorter than listed (named).
            StoreUnavailable, UnreadableFile: the store failed every attempt, or refused the read.
        """
        done = 0
        while done < buf.nbytes:
            pos = offset + done
            if not self.at <= pos < self.at + len(self.window):
                self._fill(pos)
            n = min(buf.nbytes - done, self.at + len(self.window) - pos)
            buf[done : done + n] = self.window[pos - self.at : pos - self.at + n]
            done += n

    def _fill(self, pos: int) -> None:
        """Make the window that holds byte ``pos`` the current one; the windows before it are dropped."""
        self.window = b""
        while True:
            while self.todo and len(self.ahead) < RANGES_AHEAD:
                a, b = self.todo.popleft()
                self.ahead.append((a, self.pool.submit(read_range, self.store, self.base, self.entry, a, b)))
            if not self.ahead or self.ahead[0][0] > pos:
                break
            a, fut = self.ahead.popleft()
            data = fut.result()
            if pos < a + len(data):
                self.window, self.at = data, a
                return
        # behind the windows fetched (a read out of order): fetched again, up to the next one
        stop = min(pos + RANGE_WINDOW, self.ahead[0][0] if self.ahead else self.entry.size)
        self.window, self.at = read_range(self.store, self.base, self.entry, pos, stop), pos

    def close(self) -> None:
        """Drop what is held, cancel what is not fetched yet and wait for what is being fetched."""
        self.window = b""
        self.todo.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.ahead.clear()


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


def refuse_local_companions(companions: Mapping[str, bytes] | None, path: str) -> None:
    """Raises: UnsupportedOption: companions given for a local directory (they are written beside it)."""
    if companions:
        raise UnsupportedOption(
            f"{path}: companions are committed with a checkpoint on object storage only (R-O30); beside a local "
            "directory write them as files"
        )
