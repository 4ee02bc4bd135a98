"""A verified local copy of a recorded run (or one checkpoint) on object storage.

The commands that read a recorded run -- ``ckptkit diff``, ``plot`` and ``replay`` -- read
local files. An ``s3://`` argument is turned into such files once, at the command's
entry, by the run's place (:mod:`ckptkit.format._place`, spec/objectstore.md R-O40..R-O44):
each checkpoint chosen is fetched into the place's stage through its commit record, every
object's size and xxh3-64 checked, and the stage stands for the URL while the command runs;
the run's records (``environment.json``, ``history.jsonl``, ``config.json``) come along as
whole objects. An object without a record is never copied, nor is the run's lease
(spec/lease.md R-LS09). The command then reads the copy with every check it makes on a local run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..distributed._objects import local_name
from ..errors import CheckpointNotFound
from ..format._place import Place, place_for
from ..format._urls import parse
from ..run._files import DCP_SUFFIX, ENVIRONMENT_FILE, step_of
from ..run._history import HISTORY_FILE

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
    run = place_for(url)
    try:
        if run.began():
            yield _copy_run(run, str(where), select)
            return
        if not where.key:
            raise CheckpointNotFound(f"{where}: the bucket holds no run (expected s3://bucket/prefix)")
        parent = place_for(str(where.parent))
        try:
            yield _copy_object(parent, url, where.name)
        finally:
            parent.close()
    finally:
        run.close()


def _copy_run(run: Place, url: str, select: Select) -> Copied:
    """A run prefix's chosen committed steps and its records into the place's stage (R-O41)."""
    steps = dict(sorted((s, n) for n in run.names("") if (s := _step(n)) is not None))
    chosen = [steps[s] for s in sorted(set(select(sorted(steps))))]
    for name in chosen:  # a distributed step's objects become the step-N.dcp/ directory
        run.fetch(name, local_name if name.endswith(DCP_SUFFIX) else None)
    records = tuple(r for r in RUN_RECORDS if run.bring(r))
    if not chosen and not records:
        raise CheckpointNotFound(
            f"{url}: no committed checkpoint and none of {', '.join(RUN_RECORDS)} under this prefix"
        )
    return Copied(url, run.stage, tuple(chosen), records)


def _copy_object(parent: Place, url: str, name: str) -> Copied:
    """The one object ``url`` (``name`` under ``parent``) names, with the rest of its checkpoint (R-O42)."""
    committed = parent.names("")
    owner = next((n for n in _stems(name) if n in committed), None)
    if owner is None and name in RUN_RECORDS and parent.bring(name):
        return Copied(url, os.path.join(parent.stage, name), (), (name,))
    owner = owner or name  # no record: the fetch refuses it (no such checkpoint, or not committed: R-O15)
    here = os.path.join(parent.stage, name)
    parent.fetch(owner)
    if not os.path.exists(here):
        raise CheckpointNotFound(f"{url}: not an object of {owner}, whose commit record does not list it")
    return Copied(url, here, (owner,), ())


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
