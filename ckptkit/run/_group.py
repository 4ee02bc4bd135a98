"""Who decides and who agrees: a run's processes as one object, and the world they form.

Every run-directory operation of a :class:`~ckptkit.RunState` goes through a group:
rank 0 chooses (a checkpoint, the files it writes, what retention deletes) and every
rank learns the choice; every rank checks, and a refusal on one rank is raised on
all of them, so no rank waits in a collective for a peer that gave up. In one
process the group is :class:`Alone`, whose collectives are plain calls; in a
``torch.distributed`` job it is :class:`Collective`, each call bounded by the
group's timeout (spec/runstate.md RS-D1..RS-D9).

The world is what ``environment.json`` records of the parallelism (world size,
each module's layout, RS-D5); a resume at another world refuses with
:func:`world_size_changed`, which says both worlds and what to do.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from ..errors import CheckpointError, DistributedFailure, WorldSizeChanged

__all__ = [
    "LAYOUT",
    "RESHARD_NOTE",
    "WORLD_SIZE",
    "Alone",
    "Collective",
    "Group",
    "describe_world",
    "group_of",
    "layout_of",
    "peer_failure",
    "peer_gone",
    "world_facts",
    "world_of",
    "world_size_changed",
]

T = TypeVar("T")

#: environment.json keys that describe the parallelism (spec/runstate.md RS-D5).
WORLD_SIZE = "world_size"
LAYOUT = "layout."
RESHARD_NOTE = "the run is no longer bit-comparable to its past"


def initialised() -> bool:
    """``torch.distributed`` is imported and has a default process group (torch is not imported here)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _portable(e: BaseException, rank: int) -> CheckpointError:
    """``e`` as it can travel to the other ranks (pickled in memory): itself when it survives."""
    if isinstance(e, CheckpointError):
        with contextlib.suppress(Exception):
            back = pickle.loads(pickle.dumps(e))
            if type(back) is type(e) and str(back) == str(e):
                return e
    line = f"{type(e).__name__}: {e}"
    return DistributedFailure(f"rank {rank}: {line}", {rank: line})


class Alone:
    """One process: rank 0 of a world of 1, whose collectives are plain calls (an error
    is raised where it happens). A one-process run, or a distributed run resumed in one
    process (RS-D7)."""

    rank = 0
    world = 1
    group: Any = None

    def gather(self, value: Any, what: str) -> list[Any]:
        return [value]

    def agree(self, fn: Callable[[], T], what: str) -> T:
        return fn()

    def from_rank0(self, fn: Callable[[], T], what: str) -> T:
        return fn()

    def on_rank0(self, fn: Callable[[], object], what: str) -> None:
        fn()


#: What torch.distributed says when a peer's process is gone (gloo's and the store's words).
_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "wait timeout", "timed out")


def peer_gone(e: BaseException) -> bool:
    """Whether a failed collective or rendezvous means a peer stopped answering (it died or was
    killed): a ``torch.distributed.DistError`` (store, network, backend), or gloo's words for it."""
    import torch.distributed as dist

    return isinstance(e, dist.DistError) or any(w in str(e) for w in _GONE)


def peer_failure(rank: int, doing: str, e: BaseException) -> DistributedFailure:
    """The one line a rank says when a peer stopped answering while it ``doing`` (spec/runstate.md
    RS-D8): the peer's death named as such, never as a failure of what this rank was about to do."""
    line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return DistributedFailure(
        f"rank {rank}: a peer of this job died or was killed: it stopped answering while this rank {doing} "
        f"({line}); the job stops, the checkpoints committed so far are intact: start the job again on every "
        "node (a resume continues from the newest one)",
        {rank: line},
    )


class Collective:
    """A process group's collectives, each bounded by the group's timeout; a peer that
    died makes them fail with :class:`DistributedFailure` instead of hanging."""

    def __init__(self, process_group: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)

    def _collective(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except RuntimeError as e:
            if peer_gone(e):
                raise peer_failure(self.rank, f"waited for it at {what!r}", e) from e
            line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise DistributedFailure(
                f"rank {self.rank}: {what} failed ({line}); another rank probably failed or was killed",
                {self.rank: line},
            ) from e

    def gather(self, value: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._collective(what, lambda: self.dist.all_gather_object(out, value, group=self.group))
        return out

    def agree(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on every rank; if it raised on any, raise on all (this rank's own
        error, else the lowest failing rank's)."""
        try:
            value, err = fn(), None
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others hang
            value, err = None, e
        errors = self.gather(None if err is None else _portable(err, self.rank), what)
        if err is not None:
            raise err
        for other in errors:
            if other is not None:
                raise other
        return value  # type: ignore[return-value]

    def from_rank0(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on rank 0, its result (or its error) on every rank."""
        err: BaseException | None = None
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                err = e
                box[0] = ("err", _portable(e, 0))
        self._collective(what, lambda: self.dist.broadcast_object_list(box, group=self.group, group_src=0))
        if err is not None:
            raise err
        status, value = box[0]
        if status == "err":
            raise value
        return value  # type: ignore[no-any-return]

    def on_rank0(self, fn: Callable[[], object], what: str) -> None:
        """``fn()`` on rank 0 while every rank waits; its error on every rank. The agreement is
        the barrier: no rank goes on (lists a step being deleted, say) before rank 0 is done."""

        def rank0() -> None:
            if self.rank == 0:
                fn()

        self.agree(rank0, what)


Group = Alone | Collective


def group_of(process_group: Any) -> Group:
    """The group of a run given ``process_group`` (the default one when ``torch.distributed``
    is initialised): :class:`Alone` without either."""
    if process_group is None and not initialised():
        return Alone()
    return Collective(process_group)


def layout_of(module: Any) -> str:
    """``ddp``, ``fsdp2 mesh 2`` (the mesh shape, ``2x4`` for two dimensions) or ``plain``."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "ddp"
    if isinstance(module, FSDPModule):
        params = cast(torch.nn.Module, module).parameters()  # fully_shard mixes FSDPModule into the module's class
        mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
        return "fsdp2" if mesh is None else "fsdp2 mesh " + "x".join(map(str, mesh.shape))
    return "plain"


def world_facts(world: int, modules: Mapping[str, Any]) -> dict[str, Any]:
    """The parallelism a run records in ``environment.json``: world size, each module's layout."""
    return {WORLD_SIZE: world, **{f"{LAYOUT}{name}": layout_of(m) for name, m in sorted(modules.items())}}


def describe_world(facts: Mapping[str, Any]) -> str:
    if WORLD_SIZE not in facts:
        return "one process (no process group)"
    layouts = ", ".join(f"{k[len(LAYOUT) :]}: {v}" for k, v in sorted(facts.items()) if k.startswith(LAYOUT))
    return f"world size {facts[WORLD_SIZE]}" + (f" ({layouts})" if layouts else "")


def world_size_changed(run_dir: str, saved: Mapping[str, Any], now: Mapping[str, Any]) -> WorldSizeChanged:
    """The refusal of a resume at another world size or layout, saying both and what to do."""
    if WORLD_SIZE in saved:
        todo = (
            f"run it with torchrun --nproc_per_node {saved[WORLD_SIZE]} and the same parallelism, or resume with "
            f"reshard=True (--reshard, under torchrun): DCP reshards the model and optimizer, the data positions are "
            f"re-derived from their offset rule, and {RESHARD_NOTE}"
        )
    else:
        todo = "resume it in one process (python, not torchrun), the way it was saved"
    return WorldSizeChanged(
        f"{run_dir}: saved at {describe_world(saved)}, resumed at {describe_world(now)}; a checkpoint continues the "
        f"same run bit for bit only at the world size and layout it was saved at: {todo}",
        dict(saved),
        dict(now),
    )


def world_of(facts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in facts.items() if k == WORLD_SIZE or k.startswith(LAYOUT)}
