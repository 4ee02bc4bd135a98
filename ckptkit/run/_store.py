"""The protocol a storage of a run's checkpoints meets, and what it hands a resume.

:class:`~ckptkit.RunState` is one façade over one :class:`Store`, the way
torchtitan's checkpointer is one manager with a class per storage: the single-file
store (:class:`~ckptkit.run._file_store.FileStore`, ``step-N.ckpt`` and its
companions) and the DCP store (:class:`~ckptkit.run._dcp_store.DcpStore`, one
``ckptkit.distributed`` checkpoint per step). *What* a checkpoint is is the store; *where*
it lives is the store's :class:`~ckptkit.format._place.Place`, a local directory or an
``s3://`` prefix whose steps are each committed by a record (spec/objectstore.md). What every store shares — which
checkpoint to resume, the companion check, drift, environment, legacy, the fit to
what is registered — is written once, in :mod:`ckptkit.run._resume`; a store only
knows its files. A store's collective work goes through the run's
:mod:`~ckptkit.run._group`: every method is called on every rank, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..format._checkpoint import Checkpoint
from ..format._place import Place
from ..format._snapshot import Snapshot

__all__ = ["Opened", "Sidecars", "Store"]

#: ``kind -> (table_step, tree)``: a step's sidecars, the form ``RunState.restore`` takes.
Sidecars = dict[str, tuple[int, Any]]


@dataclass
class Opened:
    """A checkpoint opened for a resume on this rank, before anything is restored.

    Attributes:
        ckpt: its contents as far as the registration checks need them (a store that
            has read its tensors already holds them here; the DCP store loads them later).
        sidecars: its sidecars, each checked against its step.
        resharded: it was saved at another world size or layout (a reshard was asked for).
        notes: what opening it on this rank had to say (a reshard, per-rank values).
        checked_whole: :meth:`Store.check` read every byte of it; False (a DCP step on an object
            prefix) when the load checks the rank files' chunks it reads, so that damage it finds
            is raised on every rank, changes nothing registered and is passed over (R-O36).
    """

    ckpt: Checkpoint
    sidecars: Sidecars
    resharded: bool = False
    notes: list[str] = field(default_factory=list)
    checked_whole: bool = True


class Store(Protocol):
    """One storage of a run's checkpoints (spec/runstate.md "Files in the run directory")."""

    #: A checkpoint name's suffix: ``.ckpt`` or ``.dcp``.
    suffix: str
    #: Optimizer state is saved by its model's parameter names (``add_optimizer(model=)``).
    names_optimizer_models: bool
    #: How many newest checkpoints retention keeps.
    keep: int
    #: Where the run lives: a local directory or an ``s3://`` prefix.
    place: Place

    @property
    def work_dir(self) -> str:
        """Where the run's appended files (``history.jsonl``) live on this machine: the run directory,
        or (object storage) a private working directory whose history goes up with each checkpoint."""
        ...

    def leased(self) -> None:
        """Every rank, once rank 0 holds the run directory's lease: before it the store writes
        nothing (spec/lease.md R-LS16); object storage brings the run's history here, as it stands now."""
        ...

    def path(self, step: int) -> str:
        """Where step ``step``'s checkpoint is (to name it before it exists)."""
        ...

    def begin(self, environment: bytes) -> None:
        """Rank 0, a fresh run (already refused if used): prepare the run directory, record its environment."""
        ...

    def environment(self) -> dict[str, Any]:
        """The run's ``environment.json`` (``CheckpointNotFound`` when missing, ``FormatError`` when not JSON)."""
        ...

    def snapshot(self, path: str) -> Snapshot:
        """The config snapshot of the checkpoint at ``path`` (after :meth:`open`)."""
        ...

    def any_checkpoints(self) -> bool:
        """The run directory holds a checkpoint, of this store or another (``resume_or_start``)."""
        ...

    def began(self) -> bool:
        """A run began here: its environment record, or what an interrupted save left, is in the
        run directory (committed checkpoints or not; R-023)."""
        ...

    def listing(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every checkpoint written, committed or not, oldest first."""
        ...

    def committed(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every committed checkpoint, oldest first (a background save
        in flight first commits)."""
        ...

    def facts(self) -> dict[str, Any]:
        """The parallelism this process runs at, as ``environment.json`` records it (``{}``: one process)."""
        ...

    def refuse_foreign(self) -> None:
        """Refuse a run directory holding the other store's checkpoints (``WorldSizeChanged``)."""
        ...

    def refuse_unstorable(self, kind: str, name: str, obj: Any) -> None:
        """Refuse, at registration, a stateful object whose state this store cannot carry."""
        ...

    def save(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> str:
        """Write step ``step``: its companions first, then the checkpoint (its commit), then
        apply retention; returns its path. A failed save leaves earlier checkpoints intact."""
        ...

    def sweep(self) -> list[str]:
        """Remove what an interrupted save left; returns the names removed."""
        ...

    def check(self, step: int, path: str) -> dict[str, Any] | None:
        """Rank 0: that the checkpoint at ``path``, named ``step``, is consistent — every byte (a
        DCP step on an object prefix: all but its rank files, whose chunks its load checks), its
        snapshot, sidecars and companion record; returns that record (None: a checkpoint from
        before the binding). Damage raises ``FormatError`` or ``CheckpointNotFound``."""
        ...

    def open(self, path: str, *, reshard: bool) -> Opened:
        """Every rank: the checkpoint at ``path`` as far as a resume checks it; refuses another
        world unless ``reshard`` (``WorldSizeChanged``)."""
        ...

    def load(self, path: str, opened: Opened, *, copy: bool = False) -> Checkpoint:
        """Every rank: the checkpoint's contents with its tensors, in destinations shaped like the
        registered objects (``copy``: in copies of them, the registered objects untouched).

        Raises:
            FormatError, CheckpointNotFound, UnreadableFile: (``opened.checked_whole`` false) damage
                found while loading, raised on every rank.
        """
        ...

    def delete(self, path: str) -> None:
        """Rank 0: uncommit and remove a checkpoint and its companions."""
        ...

    def wait(self) -> None:
        """Block until a background save committed (its failure raised here)."""
        ...

    def close(self) -> None:
        """Finish a background save and free what it holds."""
        ...
