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

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ckptkit.integrations import _lightning_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _record_bench  # this folder's: the timer and the rounds
from lightning_finetune import Net, loader, make_trainer  # the example's network and trainer

MODES: dict[str, dict[str, Any]] = {
    "off": {"record": False},
    "rows": {"digests_every": 10**9},
    "every": {"digests_every": 1},
}
SPENT: list[float] = []


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
    _record_bench.time_methods(_lightning_record.Recorder, ("batch_end", "before_optimizer_step"), SPENT)
    _record_bench.run_modes(__doc__, 200, list(MODES), ms_per_step, "the recorder's hooks")


if __name__ == "__main__":
    main()
