"""Data parallelism for the reference trainer: the process group, the wrappers, the reductions.

    torchrun --nproc_per_node 2 -m ckptkit train --run-dir runs/d --steps 40
    torchrun --nproc_per_node 2 -m ckptkit train --run-dir runs/f --steps 40 --parallel fsdp

Under ``torchrun`` (``WORLD_SIZE`` in the environment) :func:`process_group` joins the
job's process group (gloo on CPU, NCCL where CUDA exists) with a bounded timeout, so a
rank that dies ends the job instead of leaving its peers waiting. Without it the
trainer is one process and nothing here does anything: every reduction is the identity,
so a single-process run computes exactly what it always did.

What stays identical on every rank (spec/trainer.md R-T14): the parameters (DDP
all-reduces the gradients; FSDP2 shards them, and every shard is one rank's), the
reduced loss and grad norm that the spike monitor sees, hence every spike decision,
rollback and LR drop; the n-gram table (its counts are all-reduced each step); the EMA
teacher (replicated under DDP, sharded like the student under FSDP2). What differs is
the rows of the global batch each rank reads (:meth:`Ranks.rows`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..run._group import peer_failure
from ._config import Parallel, TrainerConfig

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Ranks",
    "check_fits",
    "full_tensor",
    "launcher",
    "process_group",
    "ranks",
    "wrap",
]

#: Seconds a collective may wait for a peer before the job fails (``--dist-timeout``).
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: ``rank`` of ``world`` (0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def rows(self, batch: int) -> slice:
        """The rows of a global batch of ``batch`` sequences that this rank trains on."""
        per = batch // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of ``t`` over the ranks (sum, then divide): the same bits on every rank."""
        if not self.distributed:
            return t
        t = t.detach().clone()
        dist.all_reduce(t)
        return t / self.world

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place (exact for integer tensors)."""
        if self.distributed:
            dist.all_reduce(t)
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on some rank (a decision all ranks take)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def agree(self, why: str | None) -> str | None:
        """A stop request seen by some rank, on every rank (so all stop at the same step), else None."""
        if not self.any(why is not None):
            return None
        return why or "a stop requested on another rank"


def launcher(nproc: int) -> list[str]:
    """The command that starts ``ckptkit`` as one process (``nproc`` 1) or as a torchrun job of ``nproc`` ranks."""
    job = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    return [sys.executable, *job, "-m", "ckptkit"]


def ranks() -> Ranks:
    """The current job's :class:`Ranks` (the default process group, if one is initialised)."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


@contextlib.contextmanager
def process_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[Ranks]:
    """Join the ``torchrun`` job for the duration, or do nothing outside one.

    The backend is NCCL when CUDA is available (each rank on its ``LOCAL_RANK`` device),
    gloo otherwise. ``timeout_s`` bounds every collective: a rank that dies makes its
    peers fail within it (and ``torchrun`` then stops the job).
    """
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        yield ranks()
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = int(os.environ.get("RANK", "0"))
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistError as e:  # a node killed during start-up: its peers wait for it, then give up
        raise peer_failure(rank, "joined the job", e) from None
    try:
        yield ranks()
    except dist.DistError as e:  # a collective of the trainer's own (DDP's start-up, an all-reduce)
        raise peer_failure(rank, "trained", e) from None
    finally:
        dist.destroy_process_group()


def check_fits(cfg: TrainerConfig, where: Ranks) -> None:
    """Refuse a config this job cannot train as written.

    Raises:
        ValueError: the global batch does not split evenly over the ranks, or a testing
            aid cannot work under the parallelism (the message names the flags).
    """
    if cfg.data.batch % where.world:
        raise ValueError(
            f"--batch {cfg.data.batch} must be a multiple of the world size {where.world}: each rank "
            "trains its batch / world-size rows of every global batch"
        )
    if where.distributed and cfg.train.parallel is Parallel.FSDP and cfg.testing.spike_at is not None:
        raise ValueError(
            "--spike-at hooks the gradients of whole parameters, which FSDP2 shards: use it with --parallel ddp"
        )


def wrap(model: nn.Module, teacher: nn.Module | None, kind: Parallel, where: Ranks) -> nn.Module:
    """The student as the loop trains it; an FSDP2 teacher is sharded like the student, in place.

    One process: the model itself. DDP: a ``DistributedDataParallel`` wrapper (the
    teacher stays a replicated plain module). FSDP2: every block, then the root, is
    ``fully_shard``-ed, and the teacher's ``hidden`` (its only entry point) unshards
    like ``forward`` does.
    """
    if not where.distributed:
        return model
    if kind is Parallel.DDP:
        from torch.nn.parallel import DistributedDataParallel

        # Unused parameters are normal here: --rand-depth skips blocks, an empty mask the predictor.
        return DistributedDataParallel(model, find_unused_parameters=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (where.world,))
    for m in (model, teacher):
        if m is None:
            continue
        for block in m.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        # The root reshards after its forward too: the teacher has no backward to do it, and
        # outside a step (EMA update, digests, save) every parameter must be its shard.
        fully_shard(m, mesh=mesh, reshard_after_forward=True)
    if teacher is not None:
        register_fsdp_forward_method(teacher, "hidden")  # the teacher's forward (the student's is forward)
    return model


def full_tensor(t: Any) -> torch.Tensor:
    """The whole tensor behind ``t``: a sharded DTensor is gathered (a collective), a tensor is itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
