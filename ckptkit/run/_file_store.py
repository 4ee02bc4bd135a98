"""The single-file store: one verified container per step, written after its companions.

A step is ``step-00000120.ckpt`` beside its snapshot and sidecars
(``.config.json``, ``.<kind>``), which are written first: the container is the
commit, and it records their digests (spec/companions.md). With ``async_save`` the
state is snapshot into a reused buffer and the same files are written, in the same
order, in the background. The run's one-process half of the :class:`~ckptkit.run._store.Store`
protocol; spec/runstate.md is the contract.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError
from ..format._asyncsave import AsyncSaver
from ..format._checkpoint import Checkpoint, container_writer, load
from ..format._companions import COMPANIONS_KEY, record_of
from ..format._container import SECTIONS
from ..format._place import Place
from ._files import (
    CKPT_SUFFIX,
    DCP_SUFFIX,
    ENVIRONMENT_FILE,
    RunRecords,
    check_step,
    checkpoint_name,
    read_companions,
    read_sidecars,
    remove_debris,
    restorable,
    retain,
    set_aside,
    step_of,
    step_paths,
    write_companions,
)
from ._group import WORLD_SIZE, world_of, world_size_changed
from ._registry import Registry
from ._store import Opened, Sidecars

__all__ = ["FileStore", "bind", "submit"]


class FileStore(RunRecords):
    """``step-N.ckpt`` checkpoints at the run's place (a one-process run).

    A step is written in the place's stage, companions first, then committed there
    (:meth:`~ckptkit.format._place.Place.commit`): in a local run directory the container,
    renamed into place last, is the commit; under an ``s3://`` prefix the same files, byte for
    byte, stream up as objects and the step's commit record follows (spec/objectstore.md R-O22).
    A resume reads a step from the stage, where an object prefix fetches it first, each object
    checked against its record (R-O14).
    """

    suffix = CKPT_SUFFIX
    names_optimizer_models = False

    def __init__(
        self,
        place: Place,
        reg: Registry,
        *,
        keep: int,
        compression: str,
        async_save: bool,
        log: Callable[[str], None],
    ) -> None:
        self.place, self.run_dir = place, place.where
        self.reg, self.keep, self.compression, self.log = reg, keep, compression, log
        self._saver: AsyncSaver | None = AsyncSaver(compression=compression) if async_save else None
        self._checked: tuple[str, Checkpoint, Sidecars] | None = None  # check() read every byte: open() takes them

    def path(self, step: int) -> str:
        return self.place.child(checkpoint_name(step))

    def committed(self) -> list[tuple[int, str]]:
        self.wait()
        return self.listing()

    def facts(self) -> dict[str, Any]:
        return {}

    def refuse_foreign(self) -> None:
        """A one-process run refuses a run directory a distributed run saved into.

        Raises:
            WorldSizeChanged: the directory holds ``step-*.dcp`` checkpoints.
        """
        if self.steps(DCP_SUFFIX, committed=True):  # what an interrupted save left is none
            try:
                saved = world_of(self.environment())
            except CheckpointError:
                saved = {WORLD_SIZE: "N (environment.json is unreadable)"}
            raise world_size_changed(self.run_dir, saved, {})

    def refuse_unstorable(self, kind: str, name: str, obj: Any) -> None:
        from ..format._codec import encode_tree

        encode_tree(obj.state_dict(), f"{kind} {name!r}")

    # ------------------------------------------------------------------ save

    def save(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> str:
        os.makedirs(self.place.stage, exist_ok=True)
        if self._saver is not None:
            submit(self._saver, ckpt, sidecars, lambda taken, copied: self._write(step, taken, config, copied))
        else:
            self._write(step, ckpt, config, sidecars)
        return self.path(step)

    def _write(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> None:
        """Companions, then the container, in the stage; the history before the commit (a commit
        never outruns its rows, R-O37); the commit; then retention."""
        name = checkpoint_name(step)
        here = os.path.join(self.place.stage, name)
        parts = step_paths(here, sorted(sidecars))
        set_aside(parts, ckpt.step, self.log)  # a damaged step's pieces
        record = write_companions(here, ckpt.step, config, sidecars)
        self.send_records()
        write = container_writer(bind(ckpt, record), compression=self.compression)
        self.place.commit(name, [os.path.basename(p) for p in parts[1:]], write)  # the container, written last
        self._retain()

    def _retain(self) -> None:
        retain(self.place.stage, self.listing(), self.keep, self.delete, self.log)

    def delete(self, path: str) -> None:
        # Container first: a crash mid-delete leaves orphan companions (swept by
        # retention), never a container without its companions.
        self.place.remove(path.rpartition("/")[2], step_paths(self._here(path), self.reg.sidecars))

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
        return self.place.sweep(CKPT_SUFFIX, lambda name: step_of(name) is not None) + remove_debris(self.place.stage)

    def _fetch(self, path: str) -> str:
        """The checkpoint at ``path`` in the stage, with the run's environment record (its companion
        record checks its digest); the stage copy's path."""
        here = self.place.fetch(path.rpartition("/")[2])
        self.place.bring(ENVIRONMENT_FILE)
        return here

    def check(self, step: int, path: str) -> dict[str, Any] | None:
        self._checked = None
        here = self._fetch(path)
        ckpt = load(here)
        check_step(here, step, ckpt.step, field="step", what="header step", offset=8)
        sidecars = read_companions(here, step, self.reg.sidecars, ckpt.monitor)
        self._checked = (path, ckpt, restorable(sidecars))
        return record_of(ckpt.monitor)

    def open(self, path: str, *, reshard: bool) -> Opened:
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] == path:
            return Opened(checked[1], checked[2])
        here = self._fetch(path)
        ckpt = load(here)
        return Opened(ckpt, restorable(read_sidecars(here, ckpt.step, self.reg.sidecars)))

    def load(self, path: str, opened: Opened, *, copy: bool = False) -> Checkpoint:
        """Every tensor was read (and verified) into memory of its own, or mapped, by open(): the
        stage copy can go."""
        self.place.release(path.rpartition("/")[2])
        return opened.ckpt


def submit(
    saver: AsyncSaver,
    ckpt: Checkpoint,
    sidecars: Mapping[str, tuple[int, Any]],
    write: Callable[[Checkpoint, Sidecars], None],
) -> None:
    """Snapshot ``ckpt``'s trees and the sidecars into ``saver``'s reused buffer now, then
    ``write(the copy, its sidecars)`` in the background (``async_save``: the same files, in
    the same order, as a save in the foreground)."""
    stamps, trees = {}, {name: getattr(ckpt, name) for name in SECTIONS}
    for kind, (table_step, tree) in sidecars.items():
        stamps[kind], trees[f"sidecar:{kind}"] = table_step, tree

    def run(snap: dict[str, Any]) -> None:
        copied = {kind: (table_step, snap[f"sidecar:{kind}"]) for kind, table_step in stamps.items()}
        write(dataclasses.replace(ckpt, **{name: snap[name] for name in SECTIONS}), copied)

    saver.submit(trees, run)


def bind(ckpt: Checkpoint, record: dict[str, Any]) -> Checkpoint:
    """``ckpt`` with the companion record (spec/companions.md): the digests of the
    snapshot, sidecars and environment record just written, so that none of them
    can be edited or swapped without the checkpoint noticing."""
    return dataclasses.replace(ckpt, monitor={**(ckpt.monitor or {}), COMPANIONS_KEY: record})
