"""What the reference trainer's run-keeping costs per step: fingerprints and the rollback ring.

    python bench/bench_trainer.py                 # 200 steps x 3 rounds, about a minute on 2 cores
    python bench/bench_trainer.py --steps 400 --rounds 5 --json

Four variants of the same run (default config, the shipped corpus, 1 intra-op thread)
are trained in fresh directories, interleaved round by round so a noisy neighbour
slows every variant alike:

* ``plain``: fingerprints off (``param_digests`` stubbed out), ``--auto-rollback warn``;
* ``fingerprints``: the trainer as shipped (``warn``: digests in every step row, a
  ``digests`` row per step, a ``checkpoint`` row per checkpoint);
* ``ring``: as shipped with ``--auto-rollback on`` (the state before every step kept
  in memory, K = 10).

Each variant's time is the median over rounds of the whole ``train()`` call divided by
its steps; the report gives the per-step overhead against ``plain`` in ms and percent.
The trainer's spec quotes these figures (``spec/replay.md``, ``spec/rollback.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from ckptkit.trainer import TrainerConfig, train
from ckptkit.trainer import _loop as loop

VARIANTS = ("plain", "fingerprints", "ring")


def run_once(variant: str, steps: int, root: str) -> float:
    """Seconds for one fresh ``train()`` of ``steps`` steps in the given variant."""
    cfg = TrainerConfig().replace(
        **{"train.steps": steps, "train.auto_rollback": "on" if variant == "ring" else "warn"}
    )
    real = loop.param_digests
    if variant == "plain":
        loop.param_digests = lambda _model: None  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory(dir=root) as d:
            t0 = time.perf_counter()
            train(cfg, d, log=None)
            return time.perf_counter() - t0
    finally:
        loop.param_digests = real  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="counted rounds (one warm-up round is added)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        with tempfile.TemporaryDirectory(prefix="ckptkit-bench-trainer-") as root:
            for r in range(args.rounds + 1):
                for v in VARIANTS:
                    s = run_once(v, args.steps, root)
                    print(f"round {r}{' (warm-up)' if r == 0 else ''}: {v} {s:.2f} s", file=sys.stderr)
                    if r:
                        times[v].append(s)
    finally:
        torch.set_num_threads(threads)  # importable (tests): leave the process as it was
    per_step = {v: statistics.median(ts) / args.steps * 1e3 for v, ts in times.items()}
    base = per_step["plain"]
    out: dict[str, Any] = {
        "schema_version": 1,
        "steps": args.steps,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "ms_per_step": per_step,
        "overhead_ms": {v: per_step[v] - base for v in VARIANTS if v != "plain"},
        "overhead_pct": {v: 100 * (per_step[v] - base) / base for v in VARIANTS if v != "plain"},
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"reference trainer, {args.steps} steps, median of {args.rounds} rounds, 1 intra-op thread")
    print(f"{'variant':<14}{'ms/step':>10}{'overhead':>12}{'%':>8}")
    for v in VARIANTS:
        extra = "" if v == "plain" else f"{out['overhead_ms'][v]:>+10.2f}ms{out['overhead_pct'][v]:>+7.1f}%"
        print(f"{v:<14}{per_step[v]:>10.2f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
