"""Rank-side code for the distributed RunState tests (run through ``_dist_workers.RankPool``).

A tiny loop trained on :class:`ckptkit.RunState` in a process group: a DDP- or
FSDP2-wrapped model, AdamW, a plain EMA teacher, a per-rank data position (rank
``r`` of ``W`` reads batches ``r, r + W, r + 2W, ...``), a per-rank and a
replicated value. Every batch is a function of the position, so a run is a function
of its checkpoints: interrupted and resumed equals uninterrupted, bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from _dist_workers import _counted, _fsdp_wide, _full, _state, tiny_model

import ckptkit


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    steps: int = 6  # steps to train (exempt: a resume may extend it)
    ckpt_every: int = 2  # steps between saves
    lr: float = 1e-2  # AdamW learning rate


def build(layout: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """``(the module the loop trains, the module to register, its optimizer)`` for a layout."""
    net = tiny_model(seed)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model: torch.nn.Module = DistributedDataParallel(net)
    elif layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (net[0], net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)  # in place: net is now the FSDP2 module
        model = net
    else:
        model = net
    return model, model, torch.optim.AdamW(model.parameters(), lr=LoopConfig.lr)


class Loop:
    """One rank's training loop and everything it registers."""

    def __init__(self, run_dir: str, layout: str, rule: Any = None, **rs_kw: Any) -> None:
        # One process without torch.distributed (a run resumed there with a reshard) is rank 0 of 1.
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.model, registered, self.opt = build(layout)
        self.teacher = copy.deepcopy(tiny_model(0)).requires_grad_(False)
        self.pos = self.rank
        self.seen = 0  # per rank: batches this rank trained on
        self.updates = 0  # replicated: optimizer steps taken
        self.rs = ckptkit.RunState(run_dir, config=LoopConfig(), keep=2, **rs_kw)
        self.rs.add_model("model", registered)
        self.rs.add_optimizer("adamw", self.opt)
        self.rs.add_teacher(self.teacher)
        rule = rule or (lambda rank, world, step, _values: rank + step * world)
        self.rs.add_data_position(
            "train", get=lambda: self.pos, set=self._seek, expected=lambda step, v: rule(self.rank, self.world, step, v)
        )
        self.rs.add_value("seen", get=lambda: self.seen, set=self._set_seen, per_rank=True)
        self.rs.add_value("updates", get=lambda: self.updates, set=self._set_updates)

    def _seek(self, pos: int) -> None:
        self.pos = pos

    def _set_seen(self, n: int) -> None:
        self.seen = n

    def _set_updates(self, n: int) -> None:
        self.updates = n

    def step(self, _step: int = 0) -> float:
        """One step; returns the grad norm, the same on every rank (DDP averaged the
        gradients; FSDP2's norm is reduced over the shards)."""
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(self.pos))
        self.model(x).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            live = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in self._params().items()}
            for k, t in self.teacher.state_dict().items():
                t.mul_(0.9).add_(live[k], alpha=0.1)
        self.pos += self.world
        self.seen += 1
        self.updates += 1
        return float(norm)

    def _params(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def train(self, until: int, ckpt_every: int = 2) -> None:
        for step in range(self.rs.resume_or_start(), until):
            self.step()
            if (step + 1) % ckpt_every == 0:
                self.rs.save(step + 1)
        self.rs.wait()

    def state(self) -> dict[str, Any]:
        """Everything the run holds, whole (an FSDP2 model gathered), for bitwise comparison."""
        return {
            **(_full(self.model, self.opt) if dist.is_initialized() else _state(self.model, self.opt)),
            "teacher": self.teacher.state_dict(),
            "pos": self.pos,
            "seen": self.seen,
            "updates": self.updates,
        }


def train(run_dir: str, layout: str, until: int, async_save: bool = False) -> dict[str, Any]:
    """Train from the run directory's newest checkpoint (or from scratch) to step ``until``."""
    loop = Loop(run_dir, layout, async_save=async_save)
    try:
        loop.train(until)
        return loop.state()
    finally:
        loop.rs.close()


def restore_in_memory(layout: str) -> list[str]:
    """Keep a copy at step 2 (as the spike guard's ring does), train on, restore it: the
    run is back at step 2 bit for bit, and the kept copy's digests match the live state."""
    from ckptkit.format._tree import clone, digests

    loop = Loop("/nonexistent-never-saved", layout)
    for _ in range(2):
        loop.step()
    kept = clone(loop.rs.checkpoint(2))
    at_two = clone(loop.state())
    for _ in range(2):
        loop.step()
    moved = clone(loop.state())
    loop.rs.restore(clone(kept))
    back = loop.state()
    out = []
    if _differs(moved, at_two) == []:
        out.append("training did not move the state")
    out += _differs(back, at_two)
    if digests(kept, {}) != digests(loop.rs.checkpoint(2), {}):
        out.append("digests of the restored state differ from the kept copy's")
    return out


def _differs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    from ckptkit.audit import compare_states
    from ckptkit.format._tree import flatten

    return [str(d) for d in compare_states(flatten(a, "s"), flatten(b, "s"))]


def guarded(run_dir: str, layout: str, until: int, spike_at: int) -> dict[str, Any]:
    """The loop under ``SpikeGuard(mode="on")``, a spike injected at ``spike_at``: what each rank saw."""
    from ckptkit.guard._rollback_record import skipped_batches
    from ckptkit.testing import GradSpike

    loop = Loop(run_dir, layout, rule=lambda rank, world, step, values: rank + (step + skipped_batches(values)) * world)
    monitor = ckptkit.guard.SpikeMonitor(ckptkit.SpikeConfig(window=4, min_history=2))
    inject = GradSpike([loop.model], at=spike_at)
    said: list[str] = []
    config = ckptkit.RollbackConfig(mode="on", k=2)
    guard = ckptkit.SpikeGuard(loop.rs, config, monitor=monitor, inject=inject, log=said.append)
    try:
        start = loop.rs.resume_or_start()
        guard.run(loop.step, start, until, save_every=2)
        from ckptkit.format._tree import clone, localized

        # this rank's own copy (DDP: the whole replicated model; FSDP2: its shards)
        here = localized(clone(loop.rs.checkpoint(until)))
        return {
            "pos": loop.pos,
            "updates": loop.updates,
            "model": here.model,
            "optim": here.optim,
            "teacher": here.teacher,
            "record": guard.record.state(),
            "ckpts": [s for s, _ in loop.rs.checkpoints()],
            "log": said,
        }
    finally:
        loop.rs.close()


def resume_at_this_world_size(run_dir: str, layout: str, reshard: bool) -> dict[str, Any]:
    """Resume ``run_dir`` here without training: the state and what the resume said, or its refusal."""
    loop = Loop(run_dir, layout)
    try:
        info = loop.rs.resume(reshard=reshard)
    except ckptkit.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        loop.rs.close()
    return {"state": loop.state(), "step": info.step, "resharded": info.resharded, "notes": list(info.notes)}


def save_diverged_replica(run_dir: str) -> str:
    """A value registered as replicated that each rank holds differently: the save is refused."""
    loop = Loop(run_dir, "ddp")
    rank = loop.rank
    loop.rs.add_value("local_loss", get=lambda: [0.5, float(rank)], set=lambda _v: None)
    loop.rs.start()
    try:
        loop.rs.save(0)
    except ckptkit.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


@contextlib.contextmanager
def _writes_failing_on(rank: int, how: str) -> Iterator[None]:
    """While open, rank ``rank`` cannot write its data file: ``how`` is ``"enospc"`` (the
    write raises, as on a full disk) or ``"kill"`` (the process is SIGKILLed half way)."""
    import errno
    import signal

    from ckptkit.distributed import _format as fmt

    real = fmt.write_framed

    def broken(f: Any, *a: Any, **kw: Any) -> Any:
        if how == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, *a, **kw)
        f.flush()
        os.ftruncate(f.fileno(), f.tell() // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    if dist.get_rank() == rank:
        fmt.write_framed = broken
    try:
        yield
    finally:
        fmt.write_framed = real


def train_then_fail_a_save(run_dir: str, failing_rank: int, how: str) -> str:
    """Train to step 4 with saves at 2 and 4, rank ``failing_rank`` unable to write the save of 4."""
    loop = Loop(run_dir, "ddp")
    loop.train(2)
    loop.step()
    loop.step()
    try:
        with _writes_failing_on(failing_rank, how):
            loop.rs.save(4)
    except ckptkit.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def refusals(run_dir: str) -> list[str]:
    """What a distributed run state refuses at construction and registration, and on a one-process run directory."""
    out = []
    for attempt in (
        lambda: ckptkit.RunState(run_dir, config=LoopConfig(), compression="zstd"),
        lambda: _two_models().add_optimizer("adamw", torch.optim.AdamW(tiny_model(0).parameters())),
        lambda: _two_models().add_scheduler("tensorful", _TensorState()),
        lambda: _two_models().add_stateful("loader", _TensorState()),  # a StatefulDataLoader's generator state
        lambda: ckptkit.RunState(run_dir, config=LoopConfig()).resume(),
    ):
        try:
            attempt()
            out.append("accepted")
        except (ValueError, ckptkit.CheckpointError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _two_models() -> ckptkit.RunState:
    rs = ckptkit.RunState("/nonexistent-never-saved", config=LoopConfig())
    rs.add_model("student", tiny_model(0))
    rs.add_model("critic", tiny_model(1))
    return rs


class _TensorState:
    def state_dict(self) -> dict[str, Any]:
        return {"scale": torch.ones(1)}

    def load_state_dict(self, _sd: dict[str, Any]) -> None:
        pass


def committed_steps(run_dir: str) -> list[int]:
    """The steps ``RunState.checkpoints()`` lists in a distributed run directory."""
    loop = Loop(run_dir, "ddp")
    try:
        return [s for s, _ in loop.rs.checkpoints()]
    finally:
        loop.rs.close()


def wide_on_s3(run: str, env: dict[str, str], until: int) -> tuple[dict[str, Any], dict[str, int], int, list[str]]:
    """:func:`_dist_workers._fsdp_wide` (3 MiB with AdamW's state, each rank holding its shards) on
    ``run``, an ``s3://`` prefix of the tests' server (``env``: its AWS variables), trained from its
    newest step (or the start) to ``until``, saving every 2 steps: the full state at the end, the
    bytes by object key this rank fetched to resume and the LISTs it made, and the notes its run
    state said."""
    os.environ.update(env)
    model, opt = _fsdp_wide(0)
    said: list[str] = []

    def resumed() -> tuple[ckptkit.RunState, int]:
        rs = ckptkit.RunState(run, config=LoopConfig(), keep=2, log=said.append)
        rs.add_model("model", model)
        rs.add_optimizer("adamw", opt)
        return rs, rs.resume_or_start()

    (rs, start), fetched, lists = _counted(resumed)
    try:
        for step in range(start, until):
            model(torch.randn(4, 256, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if (step + 1) % 2 == 0:
                rs.save(step + 1)
        return _full(model, opt), fetched, lists, said
    finally:
        rs.close()


def wide_on_s3_throttled(run: str, env: dict[str, str], until: int) -> tuple[str, list[str]]:
    """:func:`wide_on_s3`'s resume while the store answers every ranged read of rank 1's rank files
    with 503 SlowDown (R-O50): what the resume raised (as text), and the notes its run state said."""
    from _store_faults import Faulty

    from ckptkit.format import _objectstore as objectstore

    os.environ.update(env)
    model, opt = _fsdp_wide(0)
    said: list[str] = []
    throttled = torch.distributed.get_rank() == 1

    class SlowDown(Faulty):
        def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
            if throttled and start is not None and ".rank-" in key:
                raise objectstore.TransientFault(f"injected 503 SlowDown ({key} {start}-{end})")
            return self.inner.get(key, start, end)

    rs = ckptkit.RunState(run, config=LoopConfig(), keep=2, log=said.append)
    try:
        rs.add_model("model", model)
        rs.add_optimizer("adamw", opt)
        with objectstore.intercept(lambda backend: SlowDown(backend, None, "count")):
            try:
                rs.resume_or_start()
            except ckptkit.CheckpointError as e:
                return f"{type(e).__name__}: {e}", said
        return "resumed", said
    finally:
        rs.close()
