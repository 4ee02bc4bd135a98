"""A plain PyTorch loop with automatic spike rollback (ckptkit.SpikeGuard, mode "on").

    python examples/spike_guard.py --run-dir runs/sg --steps 300 --spike-at 200   # rolls back to 190
    python examples/spike_guard.py --run-dir runs/sg --steps 400 --resume         # extend it
    python examples/spike_guard.py --run-dir runs/u --steps 300 --spike-at 200 --spike-repeat 6   # unstable: exit 3

An MLP with dropout, AdamW, a warmup + cosine ``LambdaLR``, a shuffled
``DataLoader`` (reshuffled every epoch), gradient clipping. Lines marked
``# ckptkit`` are what the guard, the resumable loader and the dropout recipe
add. ``--spike-at S`` is a TESTING AID: it multiplies every gradient of step S by
10 (``ckptkit.testing.GradSpike``, armed by the guard around the step).

One history, every writer: ``state.record`` writes a ``step`` row (and a
``digests`` row) per execution, the guard its ``spike`` and ``rollback`` rows (the
PRD's ``rollbacks: [{step, reason, lr_after}]``), all through the run's own
``history.jsonl`` (``RunState.history``), so ``ckptkit verify``, ``ckptkit plot``,
``ckptkit audit`` and ``ckptkit replay`` read the whole story;
``ckptkit.run.kept_rows`` reads the loss curve of the run as it stands.
``--global-draw`` is a TESTING AID too: the step also draws from the global
generator (a determinism bug), which ``ckptkit audit -- python examples/spike_guard.py
--run-dir {run_dir} --steps 40 --global-draw`` must find.
Exit codes: 0 trained, 3 training is unstable, 75 stopped by SIGTERM/SIGINT (run
the same command to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import ckptkit
from ckptkit.guard import skipped_batches  # ckptkit
from ckptkit.testing import GradSpike  # ckptkit (testing aid)


@dataclasses.dataclass
class Config:
    lr: float = 3e-3  # AdamW peak learning rate
    warmup: int = 20  # linear warmup (steps), then cosine to 10% at `decay` steps
    decay: int = 1000  # steps of the cosine schedule
    batch: int = 16  # examples per step
    examples: int = 512  # dataset size (32 batches an epoch)
    seed: int = 1  # every random draw is a function of (seed, step) or (seed, epoch)
    steps: int = 300  # total steps (exempt from drift: extending a run is a resume)
    ckpt_every: int = 10  # steps between checkpoints (exempt)
    mode: str = "on"  # the guard's mode: off, warn or on
    spike_at: int | None = None  # TESTING AID: gradients x10 at this step
    spike_repeat: int = 2  # TESTING AID: arrivals at spike_at that spike (2: one rollback)
    global_draw: bool = False  # TESTING AID: the step also draws from the global generator (a bug to find)


class EpochShuffle(torch.utils.data.Sampler[int]):
    """One epoch's indices in an order that is a function of (seed, epoch), from ``start`` on."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.start = n, seed, 0, 0

    def __iter__(self) -> Any:
        g = ckptkit.torch_generator(self.seed, self.epoch, stream=2)
        return iter(torch.randperm(self.n, generator=g)[self.start :].tolist())

    def __len__(self) -> int:
        return self.n - self.start


class Batches:
    """A shuffled ``DataLoader`` that resumes at the exact batch (the recipe of docs/adopting.md).

    ``position`` counts the batches read; ``seek(p)`` rebuilds the loader at epoch
    ``p // per_epoch``, batch ``p % per_epoch``: the order is a function of (seed,
    epoch), so nothing else needs saving.
    """

    def __init__(self, dataset: torch.utils.data.Dataset[Any], batch: int, seed: int) -> None:
        self.sampler = EpochShuffle(len(dataset), seed)  # type: ignore[arg-type]
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=self.sampler, drop_last=True)
        self.batch, self.per_epoch = batch, len(dataset) // batch  # type: ignore[arg-type]
        self.position = 0
        self._it: Iterator[Any] | None = None

    def seek(self, position: int) -> None:
        self.position, self._it = position, None

    def next(self) -> Any:
        if self._it is None:
            self.sampler.epoch, within = divmod(self.position, self.per_epoch)
            self.sampler.start = within * self.batch
            self._it = iter(self.loader)
        try:
            out = next(self._it)
        except StopIteration:  # the epoch is over: the next one, reshuffled
            self._it = None
            return self.next()
        self.position += 1
        return out


@dataclasses.dataclass
class Run:
    cfg: Config
    net: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    data: Batches
    state: ckptkit.RunState  # ckptkit
    guard: ckptkit.SpikeGuard  # ckptkit


def schedule(cfg: Config) -> Any:
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = min(1.0, (step - cfg.warmup) / max(1, cfg.decay - cfg.warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * t))

    return factor


def make_run(cfg: Config, run_dir: Path) -> Run:
    g = ckptkit.torch_generator(cfg.seed, 0, stream=1)
    x = torch.randn(cfg.examples, 8, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg))
    data = Batches(dataset, cfg.batch, cfg.seed)
    state = ckptkit.RunState(run_dir, config=cfg, keep=3)  # ckptkit
    state.add_model("net", net)  # ckptkit
    state.add_optimizer("adamw", opt)  # ckptkit
    state.add_scheduler("lr", sched)  # ckptkit
    state.add_data_position(
        "train",
        get=lambda: data.position,
        set=data.seek,  # ckptkit
        expected=lambda step, values: step + skipped_batches(values),
    )  # ckptkit
    inject = None if cfg.spike_at is None else GradSpike([net], at=cfg.spike_at, repeat=cfg.spike_repeat)  # ckptkit
    guard = ckptkit.SpikeGuard(
        state, ckptkit.RollbackConfig(mode=cfg.mode), inject=inject
    )  # ckptkit: rows in the run's history
    return Run(cfg, net, opt, sched, data, state, guard)


@dataclasses.dataclass(frozen=True)
class StepOut:
    loss: float
    grad_norm: float


def train_step(run: Run, step: int) -> StepOut:
    x, y = run.data.next()
    lr = run.opt.param_groups[0]["lr"]
    with ckptkit.step_rng(run.cfg.seed, step):  # ckptkit: nn.Dropout's mask is a function of (seed, step)
        loss = torch.nn.functional.mse_loss(run.net(x), y)
    run.opt.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.net.parameters(), 1.0)
    run.opt.step()
    run.sched.step()
    if run.cfg.global_draw:  # TESTING AID: not a function of (seed, step), so not the same run after a resume
        with torch.no_grad():
            first = next(run.net.parameters())
            first.add_(torch.randn(first.shape) * 1e-4)
    run.state.record(step, loss=loss, grad_norm=grad_norm, lr=lr, data=(x, y))  # ckptkit: step and digests rows
    return StepOut(loss.item(), grad_norm.item())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--resume", action="store_true", help="require a checkpoint to continue from")
    p.add_argument("--mode", choices=["off", "warn", "on"], default=Config.mode)
    p.add_argument("--spike-at", type=int, help="TESTING AID: gradients x10 at this step")
    p.add_argument("--spike-repeat", type=int, default=Config.spike_repeat, help="TESTING AID")
    p.add_argument("--global-draw", action="store_true", help="TESTING AID: a draw from the global generator")
    args = p.parse_args(argv)
    cfg = Config(
        steps=args.steps,
        mode=args.mode,
        spike_at=args.spike_at,
        spike_repeat=args.spike_repeat,
        global_draw=args.global_draw,
    )
    run = make_run(cfg, args.run_dir)
    with run.state.preemptible():  # ckptkit: SIGTERM/SIGINT finish the step, save it, exit 75
        start = run.state.resume().step if args.resume else run.state.resume_or_start()  # ckptkit
        try:
            run.guard.run(lambda step: train_step(run, step), start, cfg.steps, save_every=cfg.ckpt_every)  # ckptkit
        except ckptkit.TrainingUnstable as e:
            print(f"spike_guard: {e}", file=sys.stderr)
            return 3
        finally:
            run.state.close()  # ckptkit: closes the run's history too
    rec = run.guard.record
    print(f"step {cfg.steps}: {rec.count} rollback(s), lr scale {rec.lr_scale:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
