"""torchtitan on the CPU: its components and ``Trainer.train``'s loop on 2 gloo ranks, checkpointed by ckptkit.

    python examples/torchtitan_cpu.py --dump-folder runs/tt --steps 8      # starts, or resumes what is there
    python examples/torchtitan_cpu.py --dump-folder runs/tt --steps 8 --kill-at 5   # killed in step 5
    torchrun --nproc-per-node 2 examples/torchtitan_cpu.py --dump-folder runs/tt --steps 8   # the same, by torchrun
    ckptkit verify runs/tt/checkpoint/step-8
    ckptkit plot runs/tt/checkpoint                                         # the run's recorded history
    ckptkit audit -- python examples/torchtitan_cpu.py --dump-folder {run_dir} --checkpoint-folder .
    python examples/torchtitan_cpu.py --dump-folder runs/t2 --checkpoint-folder .   # checkpoints in runs/t2 itself
    ckptkit replay runs/t2 --from 4 -- python examples/torchtitan_cpu.py --dump-folder {run_dir} --checkpoint-folder .

Why not ``torchrun -m torchtitan.train``: torchtitan's ``Trainer`` needs CUDA (it calls
``torch.cuda.set_device`` when it starts; on a CPU machine that is ``AttributeError: ...
'_cuda_setDevice'``). Everything it builds runs on the CPU, so this script builds the same
parts from the same job config -- torchtitan's llama3 debug model (2 layers, SDPA inner
attention), FSDP2 over a CPU mesh, its optimizer, LR schedule, dataloader and, selected in the
job config, ckptkit's ``CheckpointManager`` -- and runs the loop ``Trainer.train`` runs:
``load()``, then step and ``save()`` until ``training.steps``. Without ``torchrun`` the script
starts its 2 gloo ranks itself (forked from one process that imported torchtitan, a ``file://``
rendezvous in the dump folder).

The lines marked ``# ckptkit`` are the whole integration; the rest is torchtitan's. The same
command resumes after a kill: the manager finds the newest committed ``step-N/`` and checks
the job config against it (spec/torchtitan.md). Run it again with another learning rate
(``--lr 1e-3``) to see the resume refused, naming the key.

The manager also records the run in its checkpoint folder (spec/torchtitan.md R-TT11):
``history.jsonl`` -- a row per step with the loss and gradient norm the loop hands it
(``record_step``), bit for bit, and the digest of every tensor of the state -- and
``environment.json``. So ``ckptkit audit``, ``replay`` and ``plot`` serve this loop; for them
the run directory is the checkpoint folder (``--checkpoint-folder .``: the dump folder itself).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

SEQ, BATCH, VOCAB = 16, 2, 2048  # tokens per sample, samples per rank and step, vocabulary


class Tokens(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]], Stateful):
    """Random tokens, a function of (rank, sample index); the index is the position a resume restores."""

    def __init__(self, rank: int) -> None:
        self.rank, self.sample_idx = rank, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
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
    """What torchtitan's ``Trainer`` registers as ``train_state``: the step, the tokens seen, and ``.config``
    (ckptkit's manager reads the job config from it)."""

    def __init__(self, config: Any) -> None:
        self.config, self.step, self.ntokens_seen = config, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def job_config(
    dump_folder: str,
    steps: int,
    *,
    interval: int = 2,
    lr: float = 8e-4,
    async_mode: str = "disabled",
    folder: str = "checkpoint",
) -> Any:
    """torchtitan's llama3 debug job config, smaller, with ckptkit's CheckpointManager selected."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from ckptkit.integrations.torchtitan import CheckpointManager  # ckptkit

    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:2]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # trains on the CPU
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ, BATCH, steps
    config.optimizer.implementation = "foreach"
    config.optimizer.param_groups[0].optimizer_kwargs.update(lr=lr)
    config.dump_folder = os.path.abspath(dump_folder)  # as the checkpoints' job config names it: {run_dir} for an audit
    config.checkpoint = CheckpointManager.Config(  # ckptkit
        enable=True, folder=folder, interval=interval, async_mode=async_mode, last_save_model_only=False
    )
    return config


def build(config: Any, rank: int, world: int) -> dict[str, Any]:
    """The trainer's parts, built from ``config`` as torchtitan's ``Trainer`` builds them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader

    spec = config.model_spec.model
    spec.update_from_config(config=config)  # as the Trainer resolves the job config
    torch.manual_seed(0)  # the initial weights: seeded before the model is built
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
    parts = dict(model=model, optimizers=optimizers, lr_schedulers=lr_schedulers, dataloader=dataloader)
    parts["train_state"] = TrainState(config)
    parts["checkpointer"] = checkpointer(config, parts)
    return parts


def checkpointer(config: Any, parts: dict[str, Any]) -> Any:
    """ckptkit's manager, built from the job config as the ``Trainer`` builds its own."""
    return config.checkpoint.build(
        dataloader=parts["dataloader"],
        model_parts=[parts["model"]],
        optimizers=parts["optimizers"],
        lr_schedulers=parts["lr_schedulers"],
        states={"train_state": parts["train_state"]},  # the manager reads the job config from its .config
        sd_adapter=None,
        base_folder=config.dump_folder,
    )


def train(parts: dict[str, Any], kill_at: int = 0, global_draw: bool = False) -> bool:
    """``Trainer.train``'s loop: load, then step and save until ``training.steps``; True when it resumed.

    ``kill_at``: SIGKILL every rank in that step, once the saves before it have committed (a crash).
    ``global_draw``: TESTING AID: scale each step's loss by a draw from torch's global generator,
    which no checkpoint holds: a resumed process draws other numbers, and the audit names it.
    """
    from torchtitan.distributed.utils import clip_grad_norm_

    ts, ckpt = parts["train_state"], parts["checkpointer"]
    resumed = bool(ckpt.load(step=ts.config.checkpoint.load_step))
    if resumed and dist.get_rank() == 0:
        print(f"resumed at step {ts.step}", flush=True)
    batches = iter(parts["dataloader"])
    while ts.step < ts.config.training.steps:
        ts.step += 1
        parts["optimizers"].zero_grad()
        inputs, labels = next(batches)
        pred = parts["model"](inputs["input"])
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten())
        if global_draw:
            loss = loss * (1 + 1e-3 * torch.rand(16).mean())
        loss.backward()
        grad_norm = clip_grad_norm_(list(parts["model"].parameters()), ts.config.training.max_norm, foreach=True)
        ckpt.maybe_wait_for_staging()  # an async save has copied the state before the step changes it
        parts["optimizers"].step()
        parts["lr_schedulers"].step()
        ts.ntokens_seen += labels.numel()
        if ts.step == kill_at:
            ckpt.maybe_wait_for_saving()  # the previous save has committed on every rank
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.record_step(loss=loss.detach(), grad_norm=grad_norm, data=inputs["input"])  # ckptkit: the step's row
        ckpt.save(ts.step, last_step=ts.step == ts.config.training.steps)
        if dist.get_rank() == 0:
            print(f"step {ts.step}  loss {loss.item():.6f}", flush=True)
    ckpt.maybe_wait_for_saving()
    return resumed


def rank_main(rank: int, world: int, init: str, opts: argparse.Namespace) -> None:
    """One rank: join the gloo group, build, train."""
    if init:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    else:  # started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are in the environment
        dist.init_process_group("gloo")
    from ckptkit.errors import CheckpointError

    try:
        config = job_config(
            opts.dump_folder, opts.steps, interval=opts.interval, lr=opts.lr, folder=opts.checkpoint_folder
        )
        train(build(config, dist.get_rank(), dist.get_world_size()), opts.kill_at, opts.global_draw)
    except CheckpointError as e:  # a refused resume (ConfigDrift, ...): one line, not a traceback per rank
        if dist.get_rank() == 0:
            print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump-folder", required=True, help="torchtitan's dump_folder (checkpoints in checkpoint/)")
    p.add_argument("--steps", type=int, default=8, help="training.steps")
    p.add_argument("--interval", type=int, default=2, help="checkpoint.interval, in steps")
    p.add_argument("--lr", type=float, default=8e-4, help="the learning rate (strict: a resume must keep it)")
    p.add_argument("--kill-at", type=int, default=0, help="SIGKILL the ranks in this step, as a crash would")
    p.add_argument(
        "--checkpoint-folder",
        default="checkpoint",
        help="checkpoint.folder, in the dump folder: the run directory of audit, replay, plot ('.': the dump folder)",
    )
    p.add_argument("--global-draw", action="store_true", help="TESTING AID: a draw no checkpoint holds (see train)")
    opts = p.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        rank_main(0, 0, "", opts)
        return 0
    import multiprocessing

    os.makedirs(opts.dump_folder, exist_ok=True)
    init = os.path.join(os.path.abspath(opts.dump_folder), "rendezvous")
    if os.path.exists(init):
        os.remove(init)  # left by a killed run; a file:// rendezvous must start from none
    ctx = multiprocessing.get_context("forkserver")  # the ranks fork from one process that imported torchtitan
    ctx.set_forkserver_preload(["torchtitan.models.llama3.config_registry", "ckptkit.integrations.torchtitan"])
    procs = [ctx.Process(target=rank_main, args=(r, 2, f"file://{init}", opts)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return max(abs(proc.exitcode or 0) for proc in procs)


if __name__ == "__main__":
    sys.exit(main())
