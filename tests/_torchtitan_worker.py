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
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

STEPS, INTERVAL, SEQ, BATCH, VOCAB = 8, 2, 16, 2, 2048
COUNTS: collections.Counter[str] = collections.Counter()


class Tokens(IterableDataset, Stateful):
    """Deterministic random tokens per rank, its position a plain int (as torchtitan's text datasets keep)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.sample_idx = rank, 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.sample_idx)
            x = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            self.sample_idx += 1
            yield {"input": x[:-1]}, x[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample_idx = state_dict["sample_idx"]


class TrainState(Stateful):
    """What torchtitan's Trainer registers as ``train_state``: its step, token count, and ``.config``."""

    def __init__(self, config: Any) -> None:
        self.config, self.step, self.ntokens_seen = config, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def job_config(dump: str, async_mode: str) -> Any:
    """torchtitan's llama3 debug job config, smaller, with ckptkit's CheckpointManager selected."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from ckptkit.integrations.torchtitan import CheckpointManager

    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:2]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ, BATCH, STEPS
    config.optimizer.implementation = "foreach"
    config.dump_folder = dump
    config.checkpoint = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=INTERVAL, async_mode=async_mode, last_save_model_only=False
    )
    return config


def build(config: Any, rank: int, world: int) -> dict[str, Any]:
    """The trainer's parts, built from ``config`` as torchtitan's Trainer builds them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader

    spec = config.model_spec.model
    spec.update_from_config(config=config)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = config.optimizer.build(model_parts=[model])
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    train_state = TrainState(config)
    parts = dict(model=model, optimizers=optimizers, lr_schedulers=lr_schedulers, dataloader=dataloader)
    parts["train_state"] = train_state
    parts["checkpointer"] = checkpointer(config, parts)
    return parts


def checkpointer(config: Any, parts: dict[str, Any]) -> Any:
    return config.checkpoint.build(
        dataloader=parts["dataloader"],
        model_parts=[parts["model"]],
        optimizers=parts["optimizers"],
        lr_schedulers=parts["lr_schedulers"],
        states={"train_state": parts["train_state"]},
        sd_adapter=None,
        base_folder=config.dump_folder,
    )


def train(parts: dict[str, Any], kill_at: int | None = None) -> bool:
    """``Trainer.train``: load, then step and save until ``training.steps``; True when it resumed."""
    ts, ckpt = parts["train_state"], parts["checkpointer"]
    resumed = ckpt.load(step=ts.config.checkpoint.load_step)
    batches = iter(parts["dataloader"])
    while ts.step < ts.config.training.steps:
        ts.step += 1
        parts["optimizers"].zero_grad()
        inputs, labels = next(batches)
        pred = parts["model"](inputs["input"])
        F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten()).backward()
        ckpt.maybe_wait_for_staging()
        parts["optimizers"].step()
        parts["lr_schedulers"].step()
        ts.ntokens_seen += labels.numel()
        if ts.step == kill_at:
            ckpt.maybe_wait_for_saving()  # step 4's save has committed on every rank
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save(ts.step, last_step=ts.step == ts.config.training.steps)
    ckpt.maybe_wait_for_saving()
    return bool(resumed)


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
