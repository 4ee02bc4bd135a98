"""What recording a torchtitan run costs per step (spec/torchtitan.md R-TT12).

    python bench/bench_torchtitan_record.py             # the model of examples/torchtitan_cpu.py, one rank

The example's parts (torchtitan's llama3 debug model, smaller; FSDP2 on a gloo group of one rank
in this process) train ``--steps`` steps per mode with no checkpoint saved; reported: the median
over ``--reps`` rounds (a first warm-up round is not counted) of the wall time per step, and the
time per step in the manager's recording (``Recorder.step``: the rows, the state dicts a digest
reads and the digest itself), which a shared machine's noise affects less:

* ``off``: ``record=False``;
* ``rows``: a ``step`` row per step, digests rarely (``digests_every=10**9``);
* ``every``: a ``step`` row and a ``digests`` row per step, the default while the state is small.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckptkit.integrations import _torchtitan_record
from ckptkit.integrations.torchtitan import CheckpointManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _record_bench  # this folder's: the timer and the rounds
import torchtitan_cpu  # the example's job config, parts and loop

MODES: dict[str, dict[str, Any]] = {"off": {"record": False}, "rows": {"digests_every": 10**9}, "every": {}}
SPENT: list[float] = []


def ms_per_step(steps: int, mode: str) -> tuple[float, float]:
    """(wall ms per step of the loop, ms per step in the recording)."""
    with tempfile.TemporaryDirectory() as out:
        config = torchtitan_cpu.job_config(out, steps, folder=".")
        config.checkpoint = CheckpointManager.Config(enable=True, folder=".", interval=10**9, **MODES[mode])
        parts = torchtitan_cpu.build(config, 0, 1)
        SPENT.clear()
        start = time.perf_counter()
        torchtitan_cpu.train(parts)
        wall = time.perf_counter() - start
        parts["checkpointer"].close()
        return wall * 1e3 / steps, sum(SPENT) * 1e3 / steps


def main() -> None:
    _record_bench.time_methods(_torchtitan_record.Recorder, ("step",), SPENT)
    with tempfile.TemporaryDirectory() as init:  # the example's FSDP2 mesh needs a process group: one rank
        dist.init_process_group("gloo", init_method=f"file://{init}/rendezvous", rank=0, world_size=1)
        try:
            _record_bench.run_modes(__doc__, 40, list(MODES), ms_per_step, "the recording")
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
