"""A verified local copy of a recorded run (or one checkpoint) on object storage.

The commands that read a recorded run -- ``ckptkit diff``, ``plot`` and ``replay`` -- read
local files. An ``s3://`` argument is turned into such files once, at the command's
entry, by the commit engine (spec/objectstore.md R-O40..R-O44): each checkpoint chosen is
read through its commit record, every object's size and xxh3-64 checked
(:func:`ckptkit.format._commit.fetch_committed`), and written under a private temporary
directory that stands for the URL while the command runs; the run's records
(``environment.json``, ``history.jsonl``, ``config.json``) come along as whole objects.
An object without a record is never copied, nor is the run's lease (spec/lease.md R-LS09).
The command then reads the copy with every check it makes on a local run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..distributed._objects import RemoteCheckpoint
from ..errors import CheckpointNotFound
from ..format._commit import RECORD_SUFFIX, fetch_committed, read_record
from ..format._objectstore import ObjectStore, store_for
from ..format._urls import StorageURL, parse
from ._files import DCP_SUFFIX, ENVIRONMENT_FILE, step_of
from ._history import HISTORY_FILE

__all__ = ["RUN_RECORDS", "Copied", "Select", "every_step", "local_copy", "newest_step", "no_step", "replay_from"]

#: The objects of a run prefix that are the run's, not a checkpoint's: copied whole when present (R-O41).
RUN_RECORDS = (ENVIRONMENT_FILE, HISTORY_FILE, "config.json")
#: Which of a run's committed steps (sorted) a command needs.
Select = Callable[[list[int]], Iterable[int]]


def every_step(steps: list[int]) -> list[int]:
    return steps


def no_step(_steps: list[int]) -> list[int]:
    return []


def newest_step(steps: list[int]) -> list[int]:
    return steps[-1:]


def replay_from(url: str, step: int) -> Select:
    """A replay's steps: the newest at or before ``step`` and every later one (compared with the replay's).

    Raises (when applied):
        CheckpointNotFound: no committed step at or before ``step``; the message lists the run's.
    """

    def select(steps: list[int]) -> list[int]:
        before = [s for s in steps if s <= step]
        if not before:
            have = ", ".join(map(str, steps)) or "none"
            raise CheckpointNotFound(f"{url}: no checkpoint at or before step {step} (checkpoints: {have})")
        return [s for s in steps if s >= max(before)]

    return select


@dataclass(frozen=True)
class Copied:
    """What :func:`local_copy` made: ``path`` stands for ``url`` while the copy lives."""

    url: str
    path: str
    checkpoints: tuple[str, ...]
    records: tuple[str, ...]

    def describe(self) -> str:
        """One line: what was read, where it is, and that every object was checked."""
        parts = [f"{len(self.checkpoints)} committed checkpoint(s), every object checked against its commit record"]
        parts += list(self.records)
        return f"{self.url}: read into {self.path} ({'; '.join(parts)})"


@contextlib.contextmanager
def local_copy(url: str, select: Select = every_step) -> Iterator[Copied]:
    """A verified local copy of the run prefix or checkpoint at ``url``, removed on exit (R-O40).

    A prefix with objects under it is a run: the committed ``step-N`` checkpoints ``select``
    picks, and its records (R-O41). Otherwise ``url`` names one object: the checkpoint whose
    record lists it (a container, or a companion such as ``.config.json``), or a run record.

    Raises:
        CheckpointNotFound: nothing at ``url`` (``IncompleteCheckpoint``: objects without a record).
        ChecksumMismatch, FormatError: an object differs from its record (named by URL).
    """
    where = parse(url)
    base = tempfile.mkdtemp(prefix="ckptkit-copy-")
    try:
        yield _copy(store_for(where), where, base, select)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _copy(store: ObjectStore, url: StorageURL, base: str, select: Select) -> Copied:
    head = f"{url.key}/" if url.key else ""
    names = {rel for key, _size, _mtime in store.list(head) if "/" not in (rel := key[len(head) :])}
    if names:
        return _copy_run(store, url, os.path.join(base, url.name or url.bucket), names, select)
    if not url.key:
        raise CheckpointNotFound(f"{url}: the bucket holds no run (expected s3://bucket/prefix)")
    return _copy_object(store, url, base)


def _copy_run(store: ObjectStore, url: StorageURL, here: str, names: set[str], select: Select) -> Copied:
    """A run prefix's chosen committed steps and its records into ``here`` (R-O41)."""
    os.makedirs(here)
    committed = (n[: -len(RECORD_SUFFIX)] for n in names if n.endswith(RECORD_SUFFIX))
    steps = dict(sorted((s, n) for n in committed if (s := _step(n)) is not None))
    chosen = [steps[s] for s in sorted(set(select(sorted(steps))))]
    for name in chosen:
        if name.endswith(DCP_SUFFIX):  # a distributed step: its objects become the step-N.dcp/ directory
            RemoteCheckpoint(str(url.child(name)), store, url, name).fetch_all(here)
        else:
            fetch_committed(store, url, name, here)
    records = tuple(r for r in RUN_RECORDS if r in names)
    for r in records:
        _write(here, {r: store.get(url.child(r).key)})
    if not chosen and not records:
        raise CheckpointNotFound(
            f"{url}: no committed checkpoint and none of {', '.join(RUN_RECORDS)} under this prefix"
        )
    return Copied(str(url), here, tuple(chosen), records)


def _copy_object(store: ObjectStore, url: StorageURL, base: str) -> Copied:
    """The one object ``url`` names, with the rest of its checkpoint (R-O42)."""
    name, parent = url.name, url.parent
    owner = next((n for n in _stems(name) if store.head(parent.child(n + RECORD_SUFFIX).key) is not None), None)
    if owner is None:
        if name in RUN_RECORDS:
            _write(base, {name: store.get(url.key)})
            return Copied(str(url), os.path.join(base, name), (), (name,))
        read_record(store, parent, name)  # the engine's refusal: no such checkpoint, or not committed (R-O15)
        owner = name  # its record appeared since the HEAD
    if name not in {e.key for e in read_record(store, parent, owner)}:
        raise CheckpointNotFound(f"{url}: not an object of {owner}, whose commit record does not list it")
    fetch_committed(store, parent, owner, base)
    return Copied(str(url), os.path.join(base, name), (owner,), ())


def _step(name: str) -> int | None:
    """The step of a committed checkpoint's name, of either store (``step-N.ckpt``, ``step-N.dcp``)."""
    return step_of(name, DCP_SUFFIX) if name.endswith(DCP_SUFFIX) else step_of(name)


def _stems(name: str) -> list[str]:
    """``name`` and each name it may be a companion of (``a.ckpt.config.json``: itself, ``a.ckpt.config``,
    ``a.ckpt``, ``a``)."""
    out = [name]
    while "." in out[-1]:
        out.append(out[-1].rpartition(".")[0])
    return out


def _write(here: str, files: dict[str, bytes]) -> None:
    for part, data in files.items():
        with open(os.path.join(here, part), "wb") as f:
            f.write(data)
