"""examples/spike_guard.py's loop with the knobs tests/audit/test_compositions.py turns.

    python tests/_composition_loop.py --run-dir R --steps 30 [--mode on] [--spike-at S]
        [--no-record] [--plant entropy|global|threads --plant-from P] [--die-at K]

The loop, its guard, its recording and its resume are the example's (imported, not
copied); this adds three testing aids around them:

* ``--no-record``: the loop records no ``step``/``digests`` rows (the guard's rows remain);
* ``--plant``: from step ``P`` on, each optimizer step nudges the first parameter by noise
  that is *not* a function of (seed, step) -- ``entropy`` draws from the OS (two processes
  never agree), ``global`` from torch's global generator, seeded once when the process
  starts (the usual "it is seeded, so it is deterministic": a process that resumes starts
  the stream over); ``threads``: a process that resumes from a checkpoint runs under another
  intra-op thread count and accepts the environment change (``allow_env_change``), as a job
  rescheduled onto another machine does (one that starts fresh does not; ``--plant-from`` is moot);
* ``--die-at K``: the process SIGKILLs itself as step ``K`` begins (a crash, no save).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import spike_guard as sg

import ckptkit


def _plant(run: sg.Run, kind: str, start: int, now: list[int]) -> None:
    """Wrap the optimizer's step: from step ``start`` on, a nudge the resume cannot reproduce."""
    inner = run.opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        if now[0] >= start:
            first = next(run.net.parameters())
            g = None
            if kind == "entropy":
                g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
            with torch.no_grad():
                first.add_(torch.randn(first.shape, generator=g) * 1e-4)
        return out

    run.opt.step = step  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--mode", choices=["off", "warn", "on"], default="on")
    p.add_argument("--spike-at", type=int)
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--plant", choices=["entropy", "global", "threads"])
    p.add_argument("--plant-from", type=int, default=0)
    p.add_argument("--die-at", type=int)
    args = p.parse_args(argv)
    cfg = sg.Config(steps=args.steps, mode=args.mode, spike_at=args.spike_at)
    run = sg.make_run(cfg, args.run_dir)
    if args.no_record:
        run.state.record = lambda *_a, **_k: None  # type: ignore[method-assign]
    now = [0]
    if args.plant in ("entropy", "global"):
        _plant(run, args.plant, args.plant_from, now)
    threads = args.plant == "threads"
    if threads and run.state.checkpoints():  # only the process that resumes
        torch.set_num_threads(torch.get_num_threads() + 1)
    if args.plant == "global":
        torch.manual_seed(cfg.seed)

    def step_fn(step: int) -> sg.StepOut:
        if step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        now[0] = step
        return sg.train_step(run, step)

    with run.state.preemptible():
        start = run.state.resume_or_start(allow_env_change=threads)
        try:
            run.guard.run(step_fn, start, cfg.steps, save_every=cfg.ckpt_every)
        except ckptkit.TrainingUnstable as e:
            print(f"composition loop: {e}", file=sys.stderr)
            return 3
        finally:
            run.state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
