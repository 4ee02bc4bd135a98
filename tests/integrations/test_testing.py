"""ckptkit.testing's checks fail when they should: a helper that cannot fail
would certify a broken trainer. (Its passing side runs in examples/.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given

from ckptkit import torch_generator
from ckptkit.testing import assert_resume_equivalent, assert_step_leaves_global_rng_alone, interruptions


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
