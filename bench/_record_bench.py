"""What the benches of a trainer's recording share (bench_lightning_record.py, bench_torchtitan_record.py):
a timer around the recorder's per-step methods, and the rounds of modes with their report."""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch


def time_methods(cls: Any, names: Sequence[str], spent: list[float]) -> None:
    """Wrap ``cls``'s methods ``names`` in a timer that appends each call's seconds to ``spent``."""
    for name in names:
        real = getattr(cls, name)

        def timed(self: Any, *a: Any, _real: Any = real, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _real(self, *a, **kw)
            finally:
                spent.append(time.perf_counter() - start)

        setattr(cls, name, timed)


def run_modes(
    doc: str, steps: int, modes: Sequence[str], measure: Callable[[int, str], tuple[float, float]], what: str
) -> None:
    """Parse ``--steps`` and ``--reps``; run ``measure(steps, mode)`` (wall ms per step, ms per step in
    the recording) for every mode, ``--reps`` rounds after a warm-up round, on one intra-op thread;
    print the medians."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--reps", type=int, default=3)
    opts = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for rep in range(opts.reps + 1):
        for mode in modes:
            result = measure(opts.steps, mode)
            if rep:  # round 0 warms up
                times[mode].append(result)
    print(f"{opts.steps} steps, median of {opts.reps}, one thread")
    for mode, runs in times.items():
        wall, spent = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"  {mode:6s} {wall:8.3f} ms/step; in {what} {spent:.3f} ms/step")
