"""bench/bench_trainer.py still runs against the trainer it measures (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_trainer_bench_runs_and_reports_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench_trainer", ROOT / "bench" / "bench_trainer.py")
    threads = torch.get_num_threads()
    assert bench.main(["--steps", "3", "--rounds", "1", "--json"]) == 0
    assert torch.get_num_threads() == threads
    out = json.loads(capsys.readouterr().out)
    assert set(out["ms_per_step"]) == {"plain", "fingerprints", "ring"}
    assert set(out["overhead_ms"]) == {"fingerprints", "ring"} and out["steps"] == 3
