"""Asynchronous save: snapshot the state into a reusable buffer, write it in the background.

A save has two halves. The *snapshot* copies every tensor out of the live state
and must finish before training changes it again; the *write* (encode, hash,
write, fsync, rename) can overlap training. :meth:`AsyncSaver.save` does the first
half and returns; a background thread does the second with the very code
:func:`ckptkit.save` runs, so an asynchronous save and a synchronous one of the
same state produce the same bytes. The cost model is in ``spec/performance.md``.

Invariants:
    * At most one write is in flight. A save first waits for the previous write:
      the snapshot buffer is reused, never reallocated for the same state shapes
      (pinned host memory when a tensor lives on a GPU, so device-to-host copies
      are asynchronous).
    * A failed write is never lost: the next :meth:`~AsyncSaver.save`,
      :meth:`~AsyncSaver.wait` or :meth:`~AsyncSaver.close` raises it
      (:class:`~ckptkit.errors.SaveFailed` for an I/O error); the previous
      checkpoint at that path is intact and no temporary file remains
      (:func:`ckptkit.format._atomic.atomic_write`). One nobody collected is printed to
      stderr at interpreter exit.
    * Values the container cannot carry are refused by ``save`` itself, before
      anything is queued (:class:`~ckptkit.errors.UnsupportedValue`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedValue
from ._checkpoint import Checkpoint, save
from ._container import SECTIONS
from ._io import cpus, run_parallel
from ._section import ALIGN, align_up, check_plain
from ._values import TypedValue

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncSaver"]


class AsyncSaver:
    """Saves checkpoints in a background thread from a reusable snapshot buffer.

    Args:
        compression, level: as for :func:`ckptkit.save`.

    The buffer holds one copy of the state (its size is the sum of the tensor
    sizes); it is allocated by the first save and grown only when the state grows.
    Not meant to be shared between threads: one training loop drives one saver.

    Example:
        >>> saver = AsyncSaver()  # doctest: +SKIP
        >>> for step in range(steps):  # doctest: +SKIP
        ...     train_step()
        ...     if step % 100 == 0:
        ...         saver.save(f"run/step-{step:08d}.ckpt", Checkpoint(step=step, model={"net": net.state_dict()}))
        >>> saver.close()  # doctest: +SKIP
    """

    def __init__(self, *, compression: str | Mapping[str, str] = "raw", level: int = 3) -> None:
        self.compression = compression
        self.level = level
        self._pool = _Pool()
        self._thread: threading.Thread | None = None
        self._state = _State()
        weakref.finalize(self, _report_uncollected, self._state)

    # ------------------------------------------------------------------ public

    def save(self, path: str | os.PathLike[str], ckpt: Checkpoint) -> None:
        """Snapshot ``ckpt`` and write it to ``path`` in the background (atomically, durably).

        Returns once the state is copied: training may change it from then on.

        Raises:
            SaveFailed: the *previous* background write failed (this save is not
                started; call again to retry it).
            UnsupportedValue: a value in ``ckpt`` the container cannot carry
                (nothing is queued).
        """
        if not isinstance(ckpt, Checkpoint):
            raise UnsupportedValue(f"save() takes a Checkpoint (got {type(ckpt).__name__})")
        path = os.fspath(path)
        compression, level = self.compression, self.level

        def write(snap: dict[str, Any]) -> None:
            save(path, dataclasses.replace(ckpt, **snap), compression=compression, level=level)

        self.submit({name: getattr(ckpt, name) for name in SECTIONS}, write)

    def submit(self, trees: Mapping[str, Any], write: Callable[[dict[str, Any]], object]) -> None:
        """Snapshot ``trees`` into the buffer and run ``write(snapshot)`` in the background.

        The general form of :meth:`save` (``RunState`` uses it to write its
        snapshot, sidecars and container as one job). ``snapshot`` maps the same
        names to the same trees in canonical form (sorted maps), with every tensor
        replaced by a CPU copy in the buffer; aliases stay aliases.

        Raises:
            SaveFailed: the previous background write failed.
            UnsupportedValue: a value in ``trees`` the container cannot carry.
        """
        self.wait()
        snap, ready = self._pool.snapshot(trees)
        state = self._state

        def run() -> None:
            try:
                if ready is not None:
                    ready.synchronize()  # device-to-host copies are complete
                write(snap)
            except BaseException as e:  # noqa: BLE001 - kept for the caller; nothing is lost
                state.error = e

        self._thread = threading.Thread(target=run, name="ckptkit-async-save")
        self._thread.start()

    @property
    def pending(self) -> bool:
        """A background write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the background write (if any) is committed.

        Raises:
            SaveFailed: it failed (raised once; the saver is usable again).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._state.error = self._state.error, None
        if err is not None:
            raise err

    def close(self) -> None:
        """Wait for the background write and free the snapshot buffer.

        Raises:
            SaveFailed: the last background write failed.
        """
        try:
            self.wait()
        finally:
            self._pool = _Pool()

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass
class _State:
    error: BaseException | None = None


def _report_uncollected(state: _State) -> None:
    if state.error is not None:
        print(f"ckptkit: an asynchronous save failed and nobody called wait(): {state.error}", file=sys.stderr)


class _Pool:
    """One growable byte arena that snapshots are copied into, reused from save to save."""

    def __init__(self) -> None:
        self._arena: torch.Tensor | None = None
        self._pinned = False

    def _reserve(self, nbytes: int, pinned: bool) -> torch.Tensor:
        import torch

        arena = self._arena
        if arena is None or arena.numel() < nbytes or (pinned and not self._pinned):
            self._arena = None  # free the old one first: never two arenas at once
            arena = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
            self._arena, self._pinned = arena, pinned
        return arena

    def snapshot(self, trees: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """Validate ``trees`` and copy their tensors into the arena.

        Returns:
            ``(snapshot trees, event)``: the event (or None) completes when
            asynchronous device-to-host copies have landed.
        """
        import torch  # torch-side work; importing ckptkit stays torch-free

        from ._codec import check_tensor, storage_key

        slots: dict[Any, _Slot] = {}
        order: list[_Slot] = []

        def leaf(value: Any, at: str) -> Any:
            if not isinstance(value, torch.Tensor):
                return NotImplemented
            check_tensor(value, at)
            key = storage_key(value)
            slot = slots.get(key)
            if slot is None:
                slot = slots[key] = _Slot(value)
                order.append(slot)
            return slot

        plain = {name: None if tree is None else check_plain(tree, name, on_leaf=leaf) for name, tree in trees.items()}
        total = 0
        for slot in order:
            slot.offset = total
            total = align_up(total + slot.nbytes, ALIGN)
        on_gpu = any(s.source.device.type == "cuda" for s in order)
        pinned = on_gpu and torch.cuda.is_available()
        arena = self._reserve(total, pinned)
        copies: list[tuple[Any, Any]] = []
        with torch.no_grad():
            for slot in order:
                slot.fill(arena, copies, non_blocking=pinned)
        _memcpy(copies)
        event = None
        if pinned:
            event = torch.cuda.Event()
            event.record()
        return {name: _place(tree) for name, tree in plain.items()}, event


_PIECE = 8 << 20  # bytes per memcpy task


def _memcpy(pairs: list[tuple[Any, Any]]) -> None:
    """Copy numpy byte arrays ``dst[:] = src``, in pieces, one thread per core.

    numpy releases the GIL while it copies, so the threads run in parallel; plain
    threads, because torch's own parallel ``copy_`` spins its OpenMP pool per
    tensor and is many times slower on a busy machine (``bench/``).
    """
    import numpy as np

    pieces = [(d[a : a + _PIECE], s[a : a + _PIECE]) for d, s in pairs for a in range(0, s.nbytes, _PIECE)]
    lanes = min(cpus(), 4, max(1, sum(s.nbytes for _, s in pieces) // (32 << 20)))
    run_parallel(lambda job: np.copyto(job[0], job[1]), pieces, lanes, "ckptkit-snapshot")


class _Slot:
    """A distinct tensor of the snapshot: where it comes from and where its copy lives."""

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source
        self.nbytes = source.numel() * source.element_size()
        self.offset = 0
        self.copy: torch.Tensor | None = None

    def fill(self, arena: torch.Tensor, plain: list[tuple[Any, Any]], *, non_blocking: bool) -> None:
        """Place the copy in ``arena``; a plain CPU tensor's bytes are queued on ``plain``, others copied now."""
        import torch

        from ._codec import flat_bytes

        src = self.source.detach()
        if self.nbytes == 0:
            self.copy = torch.empty(src.shape, dtype=src.dtype)
            return
        dst = arena[self.offset : self.offset + self.nbytes].view(src.dtype).view(src.shape)
        if src.is_contiguous() and not src.is_conj() and not src.is_neg() and src.device.type == "cpu":
            # Copied as bytes: the same bytes whatever the values (NaN payloads included).
            plain.append((flat_bytes(dst).numpy(), flat_bytes(src).numpy()))
        else:
            dst.copy_(src, non_blocking=non_blocking)  # strided, conj/neg views, device tensors
        self.copy = dst


def _place(tree: Any) -> Any:
    if isinstance(tree, _Slot):
        return tree.copy
    if isinstance(tree, tuple):
        return tuple(_place(v) for v in tree)
    if isinstance(tree, list):
        return [_place(v) for v in tree]
    if isinstance(tree, dict):
        return {k: _place(v) for k, v in tree.items()}
    if isinstance(tree, TypedValue):
        return TypedValue(tree.name, tuple(_place(v) for v in tree.fields))
    return tree
