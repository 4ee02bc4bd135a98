"""What recording a Hugging Face ``Trainer`` run costs per optimizer step (spec/performance.md §9.4).

    python bench/bench_hf_record.py                       # the tiny GPT-2 of examples/hf_finetune.py
    python bench/bench_hf_record.py --n-embd 256 --n-layer 4 --reps 3   # ~3.3M parameters, ~38 MiB of state
    python bench/bench_hf_record.py --json                # one JSON object (schema_version 1)

Each mode trains the example's model (``examples/hf_finetune.py``, its ``TrainingArguments``)
for ``--steps`` optimizer steps with ckptkit's ``Trainer``, no checkpoint saved
(``save_strategy="no"``), on ``--threads`` intra-op threads (default 1), and reports the median, over ``--reps``
interleaved rounds (a first warm-up round is not counted), of the wall time of ``train()``
divided by the steps, and the time spent in the recorder's own hooks per step (``hooks``: the
recording's cost itself, which the noise of a shared machine affects less than the step's):

* ``off``: ``record=False`` (no history);
* ``rows``: a ``step`` row per step, digests rarely (``digests_every=10**9``);
* ``every``: a ``step`` row and a ``digests`` row (weights, optimizer and scheduler states) per
  step, the default while the state is at most 64 MiB (R-HF08).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from hf_finetune import make_trainer  # the example's fine-tune: the tiny GPT-2 by default

MODES: dict[str, dict[str, Any]] = {
    "off": {"record": False},
    "rows": {"digests_every": 10**9},
    "every": {"digests_every": 1},
}


def timed_hooks(trainer: Any, spent: list[float]) -> None:
    """Wrap the recorder's per-step work (the step's hooks and the micro-batch record) in a timer."""
    rec = trainer._ckptkit_recorder
    if rec is None:
        return
    for name in ("micro_batch", "on_optimizer_step", "on_step_end"):
        real = getattr(rec, name)

        def timed(*a: Any, _real: Any = real, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                spent.append(time.perf_counter() - start)

        setattr(rec, name, timed)


def ms_per_step(opts: argparse.Namespace, mode: str) -> tuple[float, float]:
    """(wall ms of ``train()`` per step, ms per step in the recorder's hooks)."""
    with tempfile.TemporaryDirectory() as out:
        off = {"save_strategy": "no", "logging_strategy": "no"}
        trainer = make_trainer(out, steps=opts.steps, size=(opts.n_embd, opts.n_layer), args=off, **MODES[mode])
        spent: list[float] = []
        timed_hooks(trainer, spent)
        start = time.perf_counter()
        trainer.train()
        return (time.perf_counter() - start) * 1e3 / opts.steps, sum(spent) * 1e3 / opts.steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--n-embd", type=int, default=16)
    p.add_argument("--n-layer", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    hooks: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(opts.reps + 1):
        for mode in MODES:
            t, h = ms_per_step(opts, mode)
            if rep:  # round 0 warms up
                times[mode].append(t)
                hooks[mode].append(h)
    with tempfile.TemporaryDirectory() as out:
        params = sum(p.numel() for p in make_trainer(out, size=(opts.n_embd, opts.n_layer)).model.parameters())
    result = {
        "schema_version": 1,
        "params": params,
        "state_mib": round(params * 4 * 3 / 2**20, 2),  # fp32 weights and AdamW's two moments
        "steps": opts.steps,
        "ms_per_step": {m: round(statistics.median(v), 3) for m, v in times.items()},
        "hooks_ms_per_step": {m: round(statistics.median(v), 3) for m, v in hooks.items()},
        "threads": torch.get_num_threads(),
    }
    if opts.json:
        print(json.dumps(result, sort_keys=True))
        return
    print(f"{params} parameters (~{result['state_mib']} MiB of state), {opts.steps} steps, median of {opts.reps}")
    base = result["ms_per_step"]["off"]
    for mode, ms in result["ms_per_step"].items():
        hook = result["hooks_ms_per_step"][mode]
        print(f"  {mode:6s} {ms:8.3f} ms/step  (+{ms - base:.3f}); in the recorder's hooks {hook:.3f} ms/step")


if __name__ == "__main__":
    main()
