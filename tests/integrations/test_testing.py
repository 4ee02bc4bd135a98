"""ckptkit.testing's checks fail when they should: a helper that cannot fail
would certify a broken trainer. (Its passing side runs in examples/, and here for a
command: the Hugging Face example SIGKILLed where hypothesis chooses.)"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, TINY_FLAGS, examples
from hypothesis import given, settings

from ckptkit import torch_generator
from ckptkit.errors import AuditError
from ckptkit.testing import (
    assert_command_resumes,
    assert_resume_equivalent,
    assert_step_leaves_global_rng_alone,
    interruptions,
)


@pytest.mark.parametrize(
    ("step", "changed"),
    [
        (lambda: torch.rand(3), "torch"),
        (lambda: torch.nn.functional.dropout(torch.ones(4), 0.5), "torch"),
        (lambda: torch.manual_seed(0), "torch"),
        (lambda: random.random(), "python"),
        (lambda: np.random.rand(2), "numpy"),
        (lambda: (random.random(), np.random.rand()), "python, numpy"),
    ],
)
def test_a_step_that_touches_a_global_rng_is_named(step, changed):
    with pytest.raises(AssertionError) as e:
        assert_step_leaves_global_rng_alone(step)
    assert str(e.value) == (
        f"the step changed global RNG state: {changed}; draw from "
        "ckptkit.torch_generator(seed, step, stream) instead of the global generator, or "
        "wrap the draws you cannot hand a generator (nn.Dropout, torch.randn) in "
        "`with ckptkit.step_rng(seed, step):`"
    )


def test_a_step_drawing_from_its_own_generator_passes():
    assert_step_leaves_global_rng_alone(lambda: torch.rand(3, generator=torch_generator(1, 5, stream=2)))


@given(stops=interruptions(10, max_stops=4))
def test_interruptions_are_sorted_distinct_steps_inside_the_run(stops):
    assert stops == sorted(set(stops)) and 1 <= len(stops) <= 4
    assert all(1 <= s <= 9 for s in stops)


def test_a_run_too_short_to_interrupt_or_a_stop_outside_it_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"steps must be >= 2 to interrupt a run \(got 1\)"):
        interruptions(1)
    with pytest.raises(ValueError, match=r"stops must lie in 1\.\.4 \(got \[0, 5\]\)"):
        assert_resume_equivalent(lambda c, d: None, lambda r, i: None, None, steps=5, stops=[5, 0], workdir=tmp_path)


# --------------------------------------------------------------- a command, SIGKILLed and resumed

STEPS = 14
_TRAIN = [sys.executable, "-m", "ckptkit", "train", "--run-dir", "{run_dir}", *TINY_FLAGS, "--quiet"]
_TRAIN += ["--steps", str(STEPS), "--ckpt-every", "5"]


@pytest.mark.slow
@settings(max_examples=examples(0.05), deadline=None)
@given(kills=interruptions(steps=8, max_stops=2))
def test_the_hugging_face_example_killed_where_hypothesis_chooses_and_resumed_is_the_same_run(
    kills: list[int],
) -> None:
    """spec/replay.md R-P19 on a Trainer script (examples/hf_finetune.py: 8 steps, a checkpoint
    every 2), SIGKILLed before or after a checkpoint, even mid-save, and started again as it is."""
    example = [sys.executable, str(ROOT / "examples" / "hf_finetune.py"), "--output-dir", "{run_dir}"]
    assert_command_resumes(example, kills)


@pytest.mark.slow
def test_a_global_draw_fails_with_the_first_step_and_tensor_and_where_the_kill_landed(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as e:
        assert_command_resumes([*_TRAIN, "--global-draw-from", "6"], [8], resume_args=["--resume"], workdir=tmp_path)
    said = str(e.value).splitlines()
    assert said[0] == f"audit: a: {STEPS} steps uninterrupted; b: SIGKILLed at step(s) 8, resumed each time"
    assert "note: b: SIGKILLed once its history reached step 8; the next process resumes from checkpoint 5" in said
    assert "DIFFERS at step 6: the step row" in said
    assert "    model:model.wte  digest differs; values unavailable" in said
    assert (tmp_path / "a" / "history.jsonl").exists() and (tmp_path / "b" / "history.interrupted.jsonl").exists()


def test_kill_steps_outside_the_run_are_refused_after_run_a(tmp_path: Path) -> None:
    short = [*_TRAIN[: _TRAIN.index("--steps")], "--steps", "4", "--ckpt-every", "2"]
    with pytest.raises(AuditError, match=re.escape("kill steps [9] must lie in 1..3: run a ended at step 4")):
        assert_command_resumes(short, [9], resume_args=["--resume"], workdir=tmp_path)
    assert not (tmp_path / "b").exists()  # refused before run b
