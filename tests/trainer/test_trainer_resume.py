"""Interrupted + resumed == uninterrupted, for the reference trainer (ckptkit.trainer).

The property the whole toolkit exists for (ADR-0021): a run stopped at any
point -- cleanly (``--steps K`` then ``--resume --steps N``) or by a crash
between checkpoints -- and resumed, ends with a checkpoint whose bytes equal
the uninterrupted run's, and with the same history rows (all fields but wall
time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import TINY_FLAGS, artifacts, assert_same_run, history, run, tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.run import checkpoint_name
from ckptkit.run._history import INTERRUPTED_FILE

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- the property


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(2, 9))
    quant = draw(st.booleans())
    return {
        "n": n,
        "ckpt_every": draw(st.integers(1, 4)),
        # Each interruption: the step count it stops at, and whether it is a crash.
        "cuts": draw(st.lists(st.tuples(st.integers(1, n - 1), st.booleans()), min_size=1, max_size=3)),
        "changes": {
            "train.seed": draw(st.integers(0, 2**64 - 1)),
            "train.aux": draw(st.booleans()),
            "train.rand_depth": draw(st.booleans()),
            "model.ngram": draw(st.booleans()),
            "model.quant": "int8" if quant else "none",
            "train.quant_check": quant and draw(st.booleans()),
            # Trip the latch before, at or after an interruption (or never).
            "testing.trip_latch_at": draw(st.none() | st.integers(0, n - 1)) if quant else None,
        },
    }


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_interrupted_and_resumed_run_matches_uninterrupted(tmp_path_factory: Any, sc: dict[str, Any]) -> None:
    cfg = tiny(**{"train.ckpt_every": sc["ckpt_every"]}, **sc["changes"])
    n = sc["n"]
    ref, cut = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("cut")
    run(cfg, ref, n)

    started = False
    for stop, crash in sorted(set(sc["cuts"])):
        if crash:  # dies after `stop` steps; only checkpoints at multiples of ckpt_every survive
            run(cfg, cut, n, resume=started and _has_ckpt(cut), crash_after=stop)
        else:  # stops cleanly at `stop` (its final checkpoint)
            run(cfg, cut, stop, resume=started and _has_ckpt(cut))
        started = True
    # A crash before the first checkpoint leaves nothing to resume: start again, fresh.
    run(cfg, cut, n, resume=_has_ckpt(cut))
    assert_same_run(ref, cut, n)


def _has_ckpt(run_dir: Path) -> bool:
    return any(name.endswith(".ckpt") for name in os.listdir(run_dir))


# ----------------------------------------------------------------------------- fixed cases


@pytest.mark.parametrize("crash", [False, True], ids=["stop", "crash"])
def test_resume_with_every_feature_on_matches_uninterrupted(tmp_path: Path, crash: bool) -> None:
    cfg = tiny(
        **{
            "train.ckpt_every": 2,
            "model.quant": "int8",
            "train.quant_check": True,
            "train.rand_depth": True,
            "train.seed": 12345,
            "testing.trip_latch_at": 5,
        }
    )
    run(cfg, tmp_path / "ref", 8)
    if crash:
        run(cfg, tmp_path / "cut", 8, crash_after=5)  # newest checkpoint: 4; rows 4 is after it
    else:
        run(cfg, tmp_path / "cut", 3)
    run(cfg, tmp_path / "cut", 8, resume=True)
    assert_same_run(tmp_path / "ref", tmp_path / "cut", 8)
    # Checkpoints both runs wrote at the same step are identical too (container only:
    # the snapshot records --steps, which the interrupted run set differently).
    for step in (4, 6):
        a = artifacts(tmp_path / "ref", step)[checkpoint_name(step)]
        assert a == artifacts(tmp_path / "cut", step)[checkpoint_name(step)]


def test_resume_sets_the_interrupted_rows_aside_and_verifies_the_steps_it_re_runs(tmp_path: Path) -> None:
    cfg = tiny(**{"train.ckpt_every": 3})
    run(cfg, tmp_path, 10, crash_after=5)
    before = history(tmp_path)
    assert [r["step"] for r in before if r["kind"] == "step"] == [0, 1, 2, 3, 4]
    result = run(cfg, tmp_path, 6, resume=True)  # from step 3: rows 3 and 4 are the interrupted process's
    rows = history(tmp_path)
    assert [r["step"] for r in rows if r["kind"] == "step"] == [0, 1, 2, 3, 4, 5]
    resume = [r for r in rows if r["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 3
    # rows 3 and 4 and the digests rows after them (spec/replay.md R-P02) are kept, not deleted (R-D21)
    assert any("set aside 4 row(s)" in note and INTERRUPTED_FILE in note for note in resume[0]["notes"])
    aside = [json.loads(line) for line in (tmp_path / INTERRUPTED_FILE).read_text().splitlines()]
    assert aside[0] == {"kind": "interrupted", "rows": 4, "step": 3, "timeline": 0}
    assert aside[1:] == before[-4:] and [(r["kind"], r["step"]) for r in aside[1:]] == [
        ("step", 3),
        ("digests", 4),
        ("step", 4),
        ("digests", 5),
    ]
    (verdict,) = [r for r in rows if r["kind"] == "resume_check"]
    assert (
        verdict
        == {
            "kind": "resume_check",
            "step": 5,
            "resumed_at": 3,
            "verdict": "verified",
            "from": 3,
            "to": 4,
            "steps": 2,
            "tensors": verdict["tensors"],
        }
        and verdict["tensors"] > 0
    )
    assert result.step == 6


def test_resume_in_a_separate_process_through_the_cli(tmp_path: Path) -> None:
    knobs = [
        *TINY_FLAGS,
        "--keep",
        "100",
        "--ckpt-every",
        "2",
        "--log-every",
        "1000",
        "--quant",
        "int8",
        "--quant-check",
        "--rand-depth",
        "--seed",
        "99",
        "--trip-latch-at",
        "3",
    ]
    cfg = tiny(
        **{
            "train.ckpt_every": 2,
            "model.quant": "int8",
            "train.quant_check": True,
            "train.rand_depth": True,
            "train.seed": 99,
            "testing.trip_latch_at": 3,
        }
    )
    run(cfg, tmp_path / "ref", 7)
    # Interrupted in this process, resumed by another one through `python -m ckptkit train`.
    run(cfg, tmp_path / "cut", 4)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptkit",
            "train",
            "--run-dir",
            str(tmp_path / "cut"),
            "--steps",
            "7",
            "--resume",
            *knobs,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"step 7: {tmp_path / 'cut' / checkpoint_name(7)}"
    assert "resumed" in proc.stderr and "fp32 fallback is latched" in proc.stderr
    assert_same_run(tmp_path / "ref", tmp_path / "cut", 7)
