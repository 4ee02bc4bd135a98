"""The example loop's own CI: ckptkit.testing proves its resume is the same run."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

import ckptkit
from ckptkit.testing import assert_resume_equivalent, assert_step_leaves_global_rng_alone, interruptions

sys.path.insert(0, str(Path(__file__).parent))
from resumable_loop import Config, make_run, train_step

STEPS = 12


# Each example trains twice: a third of the active hypothesis profile's count (8 under CI's),
# so a thorough profile (HYPOTHESIS_PROFILE=thorough in this repository) widens it too.
@settings(max_examples=max(1, settings().max_examples // 3))
@given(stops=interruptions(STEPS))
def test_interrupted_and_resumed_equals_uninterrupted(
    tmp_path_factory: pytest.TempPathFactory, stops: list[int]
) -> None:
    assert_resume_equivalent(
        make_run,
        train_step,
        Config(steps=STEPS, ckpt_every=4),
        steps=STEPS,
        stops=stops,
        workdir=tmp_path_factory.mktemp("resume"),
    )


def test_a_training_step_leaves_global_rng_alone(tmp_path):
    run = make_run(Config(), tmp_path)
    assert_step_leaves_global_rng_alone(lambda: train_step(run, 0))


def test_every_config_field_reaches_the_drift_check():
    ckptkit.assert_field_coverage(Config)


def test_the_example_runs_and_resumes_from_the_command_line(tmp_path, capsys):
    from resumable_loop import main

    main(["--run-dir", str(tmp_path), "--steps", "60"])
    main(["--run-dir", str(tmp_path), "--steps", "100", "--resume"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("step 100: loss ")


def test_without_the_data_position_the_resume_is_caught_as_a_different_run(tmp_path, monkeypatch):
    """The helper is not a test that cannot fail: drop the example's
    ``add_data_position`` line and the resumed run re-reads examples it already
    trained on, which assert_resume_equivalent reports tensor by tensor."""
    monkeypatch.setattr(ckptkit.RunState, "add_data_position", lambda self, *a, **kw: None)
    with pytest.raises(AssertionError) as e:
        assert_resume_equivalent(make_run, train_step, Config(steps=STEPS), steps=STEPS, stops=[5], workdir=tmp_path)
    msg = str(e.value)
    assert msg.startswith("resumed at [5] differs from the uninterrupted run in .ckpt\n")
    assert re.search(r"model:net\.0\.weight: \d+/256 elements differ", msg), msg
    assert "optim:optimizers.adamw.state.0.exp_avg" in msg
