"""The single-file store: one verified container per step, written after its companions.

A step is ``step-00000120.ckpt`` beside its snapshot and sidecars
(``.config.json``, ``.<kind>``), which are written first: the container is the
commit, and it records their digests (spec/companions.md). With ``async_save`` the
state is snapshot into a reused buffer and the same files are written, in the same
order, in the background. The run's one-process half of the :class:`~ckptkit.run._store.Store`
protocol; spec/runstate.md is the contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError
from ..format._asyncsave import AsyncSaver
from ..format._atomic import clean_stale_temps
from ..format._checkpoint import Checkpoint, load, save
from ..format._companions import COMPANIONS_KEY, record_of
from ..format._container import SECTIONS
from ..format._place import LocalPlace
from ._files import (
    CKPT_SUFFIX,
    DCP_SUFFIX,
    LocalRunDir,
    check_step,
    checkpoint_name,
    list_checkpoints,
    read_companions,
    read_environment,
    read_sidecars,
    remove_companions,
    remove_debris,
    restorable,
    retain,
    set_aside,
    step_paths,
    whole_checkpoints,
    write_companions,
)
from ._group import WORLD_SIZE, world_of, world_size_changed
from ._registry import Registry
from ._store import Opened, Sidecars

__all__ = ["FileStore", "bind", "submit"]


class FileStore(LocalRunDir):
    """``step-N.ckpt`` files in ``run_dir`` (a one-process run)."""

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
        self.place = LocalPlace(run_dir)
        self._saver: AsyncSaver | None = AsyncSaver(compression=compression) if async_save else None
        self._checked: tuple[str, Checkpoint, Sidecars] | None = None  # check() read every byte: open() takes them

    def path(self, step: int) -> str:
        return os.path.join(self.run_dir, checkpoint_name(step))

    def listing(self) -> list[tuple[int, str]]:
        return list_checkpoints(self.run_dir)

    def committed(self) -> list[tuple[int, str]]:
        self.wait()
        return list_checkpoints(self.run_dir)

    def facts(self) -> dict[str, Any]:
        return {}

    def refuse_foreign(self) -> None:
        """A one-process run refuses a run directory a distributed run saved into.

        Raises:
            WorldSizeChanged: the directory holds ``step-*.dcp`` checkpoints.
        """
        if whole_checkpoints(self.run_dir, DCP_SUFFIX):  # what an interrupted save left is none
            try:
                saved = world_of(read_environment(self.run_dir))
            except CheckpointError:
                saved = {WORLD_SIZE: "N (environment.json is unreadable)"}
            raise world_size_changed(self.run_dir, saved, {})

    def refuse_unstorable(self, kind: str, name: str, obj: Any) -> None:
        from ..format._codec import encode_tree

        encode_tree(obj.state_dict(), f"{kind} {name!r}")

    # ------------------------------------------------------------------ save

    def save(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> str:
        os.makedirs(self.run_dir, exist_ok=True)
        path = self.path(step)
        if self._saver is not None:
            submit(self._saver, ckpt, sidecars, lambda taken, copied: self._write(path, taken, config, copied))
        else:
            self._write(path, ckpt, config, sidecars)
        return path

    def _write(self, path: str, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> None:
        set_aside(step_paths(path, sidecars), ckpt.step, self.log)  # a damaged step's pieces
        record = write_companions(path, ckpt.step, config, sidecars)
        save(path, bind(ckpt, record), compression=self.compression)
        self._retain()

    def _retain(self) -> None:
        retain(self.run_dir, self.keep, self.delete, self.log)

    def delete(self, path: str) -> None:
        # Container first: a crash mid-delete leaves orphan companions (swept by
        # retention), never a container without its companions.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        remove_companions(path, self.reg.sidecars)

    def wait(self) -> None:
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        if self._saver is not None:
            self._saver.close()

    # ------------------------------------------------------------------ resume

    def sweep(self) -> list[str]:
        return clean_stale_temps(self.run_dir) + remove_debris(self.run_dir)

    def check(self, step: int, path: str) -> dict[str, Any] | None:
        self._checked = None
        ckpt = load(path)
        check_step(path, step, ckpt.step, field="step", what="header step", offset=8)
        sidecars = read_companions(path, step, self.reg.sidecars, ckpt.monitor)
        self._checked = (path, ckpt, restorable(sidecars))
        return record_of(ckpt.monitor)

    def open(self, path: str, *, reshard: bool) -> Opened:
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] == path:
            return Opened(checked[1], checked[2])
        ckpt = load(path)
        return Opened(ckpt, restorable(read_sidecars(path, ckpt.step, self.reg.sidecars)))

    def load(self, path: str, opened: Opened, *, copy: bool = False) -> Checkpoint:
        return opened.ckpt  # every tensor was read (and verified) into memory of its own by open()


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
