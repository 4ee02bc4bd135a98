"""A plain PyTorch training loop, made resumable with ckptkit.

    python examples/resumable_loop.py --run-dir runs/example --steps 200   # starts, or resumes what is there
    python examples/resumable_loop.py --run-dir runs/example --steps 400 --resume   # requires a checkpoint
    ckptkit audit -- python examples/resumable_loop.py --run-dir {run_dir} --steps 40

Lines marked ``# ckptkit`` are everything that was added to the plain loop:
the RunState registrations, ``resume_or_start()``, ``save()``, preemption
(``preemptible()`` + ``step_done()``: SIGTERM saves the step and exits 75, and
the same command resumes), and drawing the step's randomness from ``(seed, step)``
instead of torch's global generator.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

import ckptkit  # ckptkit


@dataclasses.dataclass
class Config:
    lr: float = 3e-3  # AdamW learning rate
    batch: int = 16  # examples per step
    seed: int = 1  # the run's seed: every random draw is a function of (seed, step)
    steps: int = 200  # total steps (exempt from drift: extending a run is a resume)
    ckpt_every: int = 50  # steps between checkpoints (exempt)
    global_dropout: bool = False  # TESTING AID: draw dropout from torch's global generator (not resumable)


class Stream:
    """An endless synthetic dataset read sequentially: ``position`` is the next example."""

    def __init__(self, seed: int) -> None:
        self.seed, self.position = seed, 0

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = []
        for i in range(self.position, self.position + n):
            g = ckptkit.torch_generator(self.seed, i, stream=2)  # ckptkit: example i is a function of (seed, i)
            xs.append(torch.randn(8, generator=g))
        self.position += n
        x = torch.stack(xs)
        return x, x.sum(dim=1, keepdim=True).sin()


@dataclasses.dataclass
class Run:
    cfg: Config
    net: torch.nn.Sequential
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    data: Stream
    state: ckptkit.RunState  # ckptkit


def make_run(cfg: Config, run_dir: Path) -> Run:
    init = ckptkit.torch_generator(cfg.seed, 0, stream=1)  # ckptkit: seeded init, not the global RNG
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.3)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    data = Stream(cfg.seed)
    state = ckptkit.RunState(run_dir, config=cfg, keep=2)  # ckptkit
    state.add_model("net", net)  # ckptkit
    state.add_optimizer("adamw", opt)  # ckptkit
    state.add_scheduler("lr", sched)  # ckptkit
    state.add_data_position("train", get=lambda: data.position, set=lambda p: setattr(data, "position", p))  # ckptkit
    return Run(cfg, net, opt, sched, data, state)


def train_step(run: Run, step: int) -> float:
    x, y = run.data.batch(run.cfg.batch)
    gen = ckptkit.torch_generator(run.cfg.seed, step, stream=5)  # ckptkit: dropout mask from (seed, step)
    h = run.net[1](run.net[0](x))
    if run.cfg.global_dropout:  # what the (seed, step) generator avoids: a resumed process draws other masks
        keep = (torch.rand(h.shape) >= 0.1).to(h.dtype) / 0.9
    else:
        keep = (torch.rand(h.shape, generator=gen) >= 0.1).to(h.dtype) / 0.9  # dropout from the step's generator
    loss = torch.nn.functional.mse_loss(run.net[3](h * keep), y)
    run.opt.zero_grad()
    loss.backward()
    run.opt.step()
    run.sched.step()
    return loss.item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--global-dropout",
        action="store_true",
        help="TESTING AID: draw dropout from the global generator; `ckptkit audit` then exits 1",
    )
    args = p.parse_args(argv)
    cfg = Config(steps=args.steps, global_dropout=args.global_dropout)
    run = make_run(cfg, args.run_dir)
    with run.state.preemptible():  # ckptkit: SIGTERM/SIGINT finish the step, save it, exit 75
        start = run.state.resume().step if args.resume else run.state.resume_or_start()  # ckptkit
        for step in range(start, cfg.steps):
            loss = train_step(run, step)
            run.state.record(step, loss=loss)  # ckptkit: history.jsonl rows that audit and replay compare
            if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps:
                run.state.save(step + 1)  # ckptkit
                print(f"step {step + 1}: loss {loss:.4f}", flush=True)
            run.state.step_done(step + 1)  # ckptkit: a requested stop saves this step and exits here


if __name__ == "__main__":
    main()
