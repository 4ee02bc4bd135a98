"""Rank-side code for the distributed tests: a pool of real gloo ranks, started once.

``RankPool(world)`` spawns ``world`` processes joined by a file:// rendezvous;
``pool.run("fn", *args)`` runs ``fn`` (a function of this module, or ``"module:fn"``
of another) on every rank and returns each rank's result. Every wait is bounded and ``close()`` kills what is
left, so no rank outlives its test, even on failure.
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import signal
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptkit
import ckptkit.distributed as ckd

STEPS = 2


# ---------------------------------------------------------------------------- the pool


def _serve(rank: int, world: int, init_file: str, timeout_s: float, inbox: Any, outbox: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    while True:
        msg = inbox.get()
        if msg is None:
            break
        name, args = msg
        module, _, fn = name.rpartition(":")
        try:
            target = getattr(importlib.import_module(module), fn) if module else globals()[name]
            outbox.put(("ok", target(*args)))
        except BaseException as e:  # noqa: BLE001 - reported to the test, which fails with it
            outbox.put(("err", f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int, timeout_s: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        fd, self._init = tempfile.mkstemp(prefix="ckptkit-rdzv-")
        os.close(fd)
        os.unlink(self._init)
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(
                target=_serve, args=(r, world, self._init, timeout_s, self.inboxes[r], self.outboxes[r]), daemon=True
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, name: str, *args: Any, timeout: float = 120.0) -> list[Any]:
        for box in self.inboxes:
            box.put((name, args))
        out = []
        for rank, box in enumerate(self.outboxes):
            try:
                status, value = box.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"rank {rank} did not answer {name} within {timeout} s") from None
            if status != "ok":
                raise AssertionError(f"rank {rank}: {value}")
            out.append(value)
        return out

    def close(self) -> None:
        for box, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if os.path.exists(self._init):
            os.unlink(self._init)


def assert_same(a: Any, b: Any) -> None:
    """Two state trees are bitwise equal (every tensor, every value)."""
    from ckptkit.audit import compare_states
    from ckptkit.format._tree import flatten

    assert compare_states(flatten(a, "s"), flatten(b, "s")) == []


# ---------------------------------------------------------------------------- rank-side work


def tiny_model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def _fsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def fsdp_train_and_save(path: str) -> dict[str, Any]:
    """Two AdamW steps of a sharded model, saved; returns the full (unsharded) state."""
    model, optim = _fsdp(0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(4, 6, generator=gen)
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    ckd.save(_state(model, optim), path)
    return _full(model, optim)


def fsdp_load(path: str) -> dict[str, Any]:
    """A differently initialised sharded model and optimizer, loaded from ``path``; the full state."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optim = _fsdp(123)
    state = _state(model, optim)
    ckd.load(state, path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, optim)


def save_plain(path: str, value: float) -> None:
    """A replicated plain state (every rank the same), with non-tensor leaves."""
    ckd.save({"w": torch.full((64,), value), "step": int(value), "betas": (0.9, 0.999)}, path)


def save_and_die(path: str, dying_rank: int) -> str:
    """Rank ``dying_rank`` is SIGKILLed half way through writing its data file."""
    from ckptkit.distributed import _format as fmt

    if dist.get_rank() == dying_rank:
        real = fmt.write_framed

        def die(f: Any, *a: Any, **kw: Any) -> Any:
            real(f, *a, **kw)
            f.flush()
            os.ftruncate(f.fileno(), f.tell() // 2)
            os.kill(os.getpid(), signal.SIGKILL)

        fmt.write_framed = die
    state = {f"r{r}": torch.full((256,), float(r)) for r in range(dist.get_world_size())}
    try:
        ckd.save(state, path)
    except Exception as e:  # noqa: BLE001 - the survivor: its peer vanished in the middle of the save
        return f"{type(e).__name__}"
    return "saved"


def async_saves(first: str, third: str) -> list[str]:
    """Two background saves with main-thread collectives in between; the second fails
    (its directory is already committed) and the failure surfaces at the next call."""
    saver = ckd.AsyncSaver()
    out = []
    try:
        saver.save({"w": torch.arange(64, dtype=torch.float32), "step": 3}, first)
        total = torch.ones(1)
        for _ in range(20):  # a training loop's collectives on the default group, meanwhile
            dist.all_reduce(total)
        out.append(f"all_reduce {int(total.item())}")
        saver.save({"w": torch.zeros(64), "step": 4}, first)  # waits for the first; the second fails in the background
        try:
            saver.save({"w": torch.zeros(64), "step": 5}, third)
        except ckptkit.CheckpointError as e:
            out.append(f"{type(e).__name__}: {e}")
        saver.wait()
    finally:
        saver.close()
    return out


def dtensor_overwrite_and_reshard(path: str) -> dict[str, Any]:
    """DCP's DTensor storage behaviours through ckptkit's Writer/Reader (tests/distributed/test_dcp_dropin.py):
    a row-sharded DTensor saved twice into one directory (DCP's default overwrite=True),
    then loaded as column shards and as a replicated DTensor; each rank's full views."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    for scale in (1.0, 2.0):
        state = {"t": distribute_tensor(full * scale, mesh, [Shard(0)]), "step": int(scale)}
        dcp.save(state, storage_writer=ckd.Writer(path))
    out: dict[str, Any] = {"files": sorted(os.listdir(os.path.dirname(path)))}
    for name, placement in (("cols", Shard(1)), ("replicated", Replicate())):
        dest: dict[str, Any] = {"t": distribute_tensor(torch.zeros(6, 8), mesh, [placement]), "step": 0}
        dcp.load(dest, storage_reader=ckd.Reader(path))
        out[name] = (dest["t"].full_tensor(), dest["step"])
    return out


def save_without_collectives(path: str) -> str:
    """dcp.save with use_collectives=False on every rank of 2: ckptkit's Writer refuses it."""
    import torch.distributed.checkpoint as dcp

    writer = ckd.Writer(path)
    try:
        dcp.save({"w": torch.ones(2)}, storage_writer=writer, use_collectives=False)
    except BaseException as e:  # noqa: BLE001 - reported as the test expects it
        return f"{type(e).__name__}: {e}"
    return "saved"


def wide(seed: int) -> torch.nn.Sequential:
    """Four 256x256 layers: 3 MiB of state with AdamW's once it stepped."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))


def _fsdp_wide(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """:func:`wide`, each layer sharded by FSDP2, with AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = wide(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def load_unsharded(model: torch.nn.Module, path: str) -> dict[str, Any]:
    """``model`` and a fresh AdamW loaded from ``path`` in this process (world size 1); the full state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    ckd.load(state, path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model, optim)


def _counted(fn: Callable[[], Any]) -> tuple[Any, dict[str, int], int]:
    """``fn()`` (or the ckptkit error it raised, as text), the bytes its storage reads fetched by
    object key, and the LISTs it made."""
    from _store_faults import Fetched

    from ckptkit.format import _objectstore as objectstore

    made: list[Fetched] = []

    def counted(backend: objectstore.Backend) -> objectstore.Backend:
        made.append(Fetched(backend))
        return made[-1]

    with objectstore.intercept(counted):
        try:
            out = fn()
        except ckptkit.CheckpointError as e:
            out = f"{type(e).__name__}: {e}"
    fetched: dict[str, int] = {}
    for f in made:
        for key, n in f.bytes.items():
            fetched[key] = fetched.get(key, 0) + n
    return out, fetched, sum(f.lists for f in made)


def fsdp_s3_fetched(url: str, env: dict[str, str]) -> tuple[dict[str, Any], dict[str, int], dict[str, Any]]:
    """One AdamW step of :func:`_fsdp_wide` saved to ``url`` (an ``s3://`` URL on the tests' server,
    ``env`` its AWS variables), loaded into a differently initialised copy: the full state saved, the
    bytes this rank's load fetched by object key, and the full state loaded."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    os.environ.update(env)
    model, optim = _fsdp_wide(0)
    model(torch.randn(4, 256, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    optim.step()
    ckd.save(_state(model, optim), url)
    saved = _full(model, optim)
    model, optim = _fsdp_wide(123)
    state = _state(model, optim)
    _, fetched, _ = _counted(lambda: ckd.load(state, url))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return saved, fetched, _full(model, optim)


def s3_load_uncommitted(url: str, env: dict[str, str]) -> tuple[str, int]:
    """A load of ``url``, which has no record: this rank's error and the LISTs it made."""
    os.environ.update(env)
    error, _, lists = _counted(lambda: ckd.load({"w": torch.zeros(4)}, url))
    return error, lists
