"""What recording a Lightning run costs per optimizer step (spec/lightning.md R-L10).

    python bench/bench_lightning_record.py                # the network of examples/lightning_finetune.py

Each mode trains the example's network for ``--steps`` optimizer steps on one intra-op thread,
no checkpoint saved, and reports the median over ``--reps`` rounds (a first warm-up round is
not counted) of the wall time of ``fit`` per step and the time per step in the recorder's own
hooks (the recording's cost itself, which a shared machine's noise affects less):

* ``off``: ``CheckpointIO(record=False)``;
* ``rows``: a ``step`` row per step, digests rarely (``digests_every=10**9``);
* ``every``: a ``step`` row and a ``digests`` row per step, the default while the state is small.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ckptkit.integrations import _lightning_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lightning_finetune import Net, loader, make_trainer  # the example's network and trainer

MODES: dict[str, dict[str, Any]] = {
    "off": {"record": False},
    "rows": {"digests_every": 10**9},
    "every": {"digests_every": 1},
}
SPENT: list[float] = []


def timed_hooks() -> None:
    """Wrap the recorder's per-step work in a timer."""
    for name in ("batch_end", "before_optimizer_step"):
        real = getattr(_lightning_record.Recorder, name)

        def timed(self: Any, *a: Any, _real: Any = real, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _real(self, *a, **kw)
            finally:
                SPENT.append(time.perf_counter() - start)

        setattr(_lightning_record.Recorder, name, timed)


def ms_per_step(steps: int, mode: str) -> tuple[float, float]:
    """(wall ms of ``fit`` per step, ms per step in the recorder's hooks)."""
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(out, steps=steps, save_every=10**9, **MODES[mode])
        torch.manual_seed(0)
        model = Net()
        SPENT.clear()
        start = time.perf_counter()
        trainer.fit(model, loader())
        return (time.perf_counter() - start) * 1e3 / steps, sum(SPENT) * 1e3 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    opts = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    timed_hooks()
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for rep in range(opts.reps + 1):
        for mode in MODES:
            result = ms_per_step(opts.steps, mode)
            if rep:  # round 0 warms up
                times[mode].append(result)
    print(f"{opts.steps} steps, median of {opts.reps}, one thread")
    for mode, runs in times.items():
        wall, hooks = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"  {mode:6s} {wall:8.3f} ms/step; in the recorder's hooks {hooks:.3f} ms/step")


if __name__ == "__main__":
    main()
