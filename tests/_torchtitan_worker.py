"""One rank of a torchtitan job whose job config selects ckptkit's CheckpointManager.

The test that forks it: tests/integrations/test_torchtitan.py.

``run(PHASE, RANK, WORLD, INIT_FILE, OUT)`` on 2 gloo ranks (the test forks them from a forkserver
that imported torchtitan once; ``python tests/_torchtitan_worker.py PHASE RANK WORLD INIT_FILE OUT``
runs one by hand). The model is
torchtitan's llama3 debug model, made smaller through its own config (2 layers, SDPA inner attention,
which trains on the CPU), sharded with FSDP2; the optimizer, LR schedule, dataloader and checkpoint
manager are torchtitan's, built from the job config as its Trainer builds them, and the loop is
``Trainer.train``'s (load, then step, save). torchtitan's Trainer itself needs a GPU.

Phases:
  first   train 8 steps uninterrupted into OUT/ref (synchronous saves), then train again into OUT/run
          with async saves and SIGKILL the process in step 5, after step 4's save committed
  resume  with a trip-wire on every unpickling entry point: resume OUT/run and train to step 8; then
          try resumes with a changed job config (a strict key, the schedule's length, exempt keys)
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import torchtitan_cpu  # the documented CPU route (docs/integrations.md): its job config, parts and loop
from torchtitan_cpu import TrainState, build, checkpointer, train

STEPS, INTERVAL = 8, 2
COUNTS: collections.Counter[str] = collections.Counter()


def job_config(dump: str, async_mode: str) -> Any:
    """The example's job config: torchtitan's llama3 debug model, smaller, ckptkit's CheckpointManager."""
    return torchtitan_cpu.job_config(dump, STEPS, interval=INTERVAL, async_mode=async_mode)


def final_state(parts: dict[str, Any]) -> dict[str, Any]:
    """Everything a resume must restore, as full tensors and plain values."""
    from torch.distributed.tensor import DTensor
    from torchdata.stateful_dataloader import StatefulDataLoader

    def full(tree: Any) -> Any:
        if isinstance(tree, DTensor):
            return tree.full_tensor()
        if isinstance(tree, dict):
            return {k: full(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [full(v) for v in tree]
        return tree

    return {
        "model": full(parts["model"].state_dict()),
        "optim": full(parts["optimizers"].state_dict()),
        "lr": parts["lr_schedulers"].state_dict(),
        "data": StatefulDataLoader.state_dict(parts["dataloader"]),
        "train": parts["train_state"].state_dict(),
    }


def install_tripwire() -> None:
    """Count every call into Python's and torch's unpickling entry points from here on."""
    import torch.serialization

    real_loads, real_load, real_unpickler, real_torch_load = pickle.loads, pickle.load, pickle.Unpickler, torch.load

    def loads(*a: Any, **k: Any) -> Any:
        COUNTS["pickle.loads"] += 1
        return real_loads(*a, **k)

    def load(*a: Any, **k: Any) -> Any:
        COUNTS["pickle.load"] += 1
        return real_load(*a, **k)

    def torch_load(*a: Any, **k: Any) -> Any:
        COUNTS["torch.load"] += 1
        return real_torch_load(*a, **k)

    class Unpickler(real_unpickler):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            COUNTS["pickle.Unpickler"] += 1
            super().__init__(*a, **k)

    pickle.loads, pickle.load, pickle.Unpickler = loads, load, Unpickler  # type: ignore[misc]
    torch.load = torch.serialization.load = torch_load


def extend(config: Any) -> None:
    """Run 4 more steps on the schedule the run trained on; log and save at another cadence."""
    config.training.steps, config.lr_scheduler.total_steps = 12, 8
    config.checkpoint.interval, config.metrics.log_freq = 3, 5


def drift_attempts(config_of: Any, parts: dict[str, Any]) -> dict[str, str]:
    """Resume the finished run with changed job configs: what each attempt said."""
    from ckptkit.errors import ConfigDrift

    said = {}
    for name, change in (
        ("lr", lambda c: c.optimizer.param_groups[0].optimizer_kwargs.update(lr=1e-3)),
        ("steps", lambda c: setattr(c.training, "steps", 12)),
        ("exempt", extend),
    ):
        config = config_of()
        change(config)
        config.model_spec.model.update_from_config(config=config)  # as the Trainer resolves it
        parts["train_state"] = TrainState(config)
        try:
            said[name] = f"loaded: {checkpointer(config, parts).load()}"
        except ConfigDrift as e:
            said[name] = f"ConfigDrift: {e}"
    return said


def run(phase: str, rank: int, world: int, init_file: str, out: str) -> None:
    """One rank of ``phase`` (the module docstring)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if phase == "first":
        parts = build(job_config(os.path.join(out, "ref"), "disabled"), rank, world)
        train(parts)
        torch.save(final_state(parts), os.path.join(out, f"ref-{rank}.pt"))
        train(build(job_config(os.path.join(out, "run"), "async"), rank, world), kill_at=5)
        raise AssertionError("not killed")
    install_tripwire()
    parts = build(job_config(os.path.join(out, "run"), "async"), rank, world)
    resumed_at = -1
    real_load = parts["checkpointer"].load

    def load(step: int = -1) -> bool:
        nonlocal resumed_at
        got = real_load(step)
        resumed_at = parts["train_state"].step
        return got

    parts["checkpointer"].load = load
    resumed = train(parts)
    counts = dict(COUNTS)
    torch.save(final_state(parts), os.path.join(out, f"resumed-{rank}.pt"))
    said = drift_attempts(lambda: job_config(os.path.join(out, "run"), "async"), parts)
    from torchtitan.components.dataloader import ParallelAwareDataloader

    dl = parts["dataloader"]
    ParallelAwareDataloader.load_state_dict(dl, ParallelAwareDataloader.state_dict(dl))  # the trip-wire sees it
    report = dict(resumed=resumed, resumed_at=resumed_at, counts=counts, control=dict(COUNTS), said=said)
    with open(os.path.join(out, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
