"""``ckptkit train`` SIGKILLed and resumed proves itself (spec/determinism.md R-D20..R-D26): real
processes, real SIGKILLs; the verdict line, the final bytes, ``ckptkit verify``; a planted global
draw stops the resume with exit 1; the spike-guard example prints the same line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, TINY_FLAGS, artifacts, examples, history, kill_at_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.run import checkpoint_name
from ckptkit.run._history import INTERRUPTED_FILE, read_rows

pytestmark = pytest.mark.slow

STEPS = 14
EVERY = 5
GUARD = [
    "--auto-rollback", "on", "--spike-at", "9", "--spike-window", "8", "--spike-min-history", "4", "--rollback-k", "3",
]  # fmt: skip
TIMEOUT_S = 300


def _argv(run_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "ckptkit", "train", "--run-dir", str(run_dir), *TINY_FLAGS, "--quiet", *flags]


def _train(run_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_argv(run_dir, *flags), capture_output=True, text=True, timeout=TIMEOUT_S)


def _rows(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return read_rows(run_dir / name)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], Path]:
    """The uninterrupted run per guard mode, trained once per module."""
    runs: dict[bool, Path] = {}

    def get(guard: bool) -> Path:
        if guard not in runs:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            done = _train(run_dir, "--steps", str(STEPS), "--ckpt-every", str(EVERY), *(GUARD if guard else []))
            assert done.returncode == 0, done.stderr[-2000:]
            runs[guard] = run_dir
        return runs[guard]

    return get


# The checkpoint interval is the in-process property's axis (tests/run/test_resume_check.py); here the
# kill is a real SIGKILL at any step after the first checkpoint, with and without the spike guard.
@settings(max_examples=examples(0.04), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(guard=st.booleans(), at=st.integers(EVERY, STEPS - 2))
def test_a_run_sigkilled_after_a_checkpoint_and_resumed_is_verified_over_exactly_the_steps_it_re_ran(
    guard: bool, at: int, reference: Callable[[bool], Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    flags = ["--steps", str(STEPS), "--ckpt-every", str(EVERY), *(GUARD if guard else [])]
    kill_at_step(_argv(run_dir, *flags), run_dir, at, committed=EVERY)
    resumed = _train(run_dir, *flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (verdict,) = [r for r in history(run_dir) if r["kind"] == "resume_check"]
    aside = _rows(run_dir, INTERRUPTED_FILE)
    re_run = sorted({r["step"] for r in aside if r["kind"] == "step"})
    if verdict["verdict"] == "verified":
        assert (verdict["from"], verdict["to"]) == (verdict["resumed_at"], re_run[-1])
        line = f"resume verified: steps {verdict['from']}..{verdict['to']} reproduce the interrupted run bit for bit"
        assert line in resumed.stderr  # said under --quiet too
    else:  # killed right after its checkpoint, or (guarded) after a rollback left the checkpoint's timeline
        assert verdict["verdict"] == "not verifiable", verdict
        assert guard or not re_run, verdict
    final = checkpoint_name(STEPS)
    assert artifacts(run_dir, STEPS)[final] == artifacts(reference(guard), STEPS)[final]


def test_the_issue_s_kill_and_resume_says_verified_in_the_summary_and_in_verify(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    flags = ["--steps", "12", "--ckpt-every", "5"]
    kill_at_step(_argv(run_dir, *flags), run_dir, 6, committed=5)  # well before checkpoint 10: steps take ms
    resumed = _train(run_dir, *flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    said = re.search(r"resume verified: steps 5\.\.(\d+) reproduce the interrupted run bit for bit", resumed.stderr)
    assert said is not None, resumed.stderr
    assert f"  resume check verified: steps 5..{said[1]} reproduce the interrupted run bit for bit" in resumed.stdout
    verify = subprocess.run([sys.executable, "-m", "ckptkit", "verify", str(run_dir)], capture_output=True, text=True)
    assert verify.returncode == 0
    assert f"      resume verified: steps 5..{said[1]} reproduce" in verify.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "ckptkit", "verify", str(run_dir), "--json"], capture_output=True, text=True
    )
    (listed,) = json.loads(as_json.stdout)["history"][0]["resumes"]
    assert listed["verdict"] == "verified" and listed["from"] == 5


def test_a_planted_global_draw_stops_the_resume_at_its_first_re_run_step_with_exit_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    flags = ["--steps", "12", "--ckpt-every", "5", "--global-draw-from", "3"]
    kill_at_step(_argv(run_dir, *flags), run_dir, 6, committed=5)
    resumed = _train(run_dir, *flags, "--resume")
    assert resumed.returncode == 1
    said = [line for line in resumed.stderr.splitlines() if not line.startswith("ckptkit train: took over")]
    (line,) = said  # one line (after the killed run's lease taken over, lease.md R-LS04)
    assert line.startswith(
        f"ckptkit train: {run_dir}: the resumed run differs from the interrupted run at step 5: tensor model:"
    ), line
    assert line.endswith(f"investigate with: ckptkit replay {run_dir} --from 5 (R-D25)")
    # both processes' rows are kept
    assert [r["step"] for r in history(run_dir) if r["kind"] == "step"][-1] == 5
    assert 5 in {r["step"] for r in _rows(run_dir, INTERRUPTED_FILE) if r["kind"] == "step"}


def test_the_spike_guard_example_killed_and_resumed_prints_the_same_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = [sys.executable, str(ROOT / "examples" / "spike_guard.py"), "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kill_at_step([*script, "--steps", "40"], run_dir, 23, committed=20, env=env)  # checkpoint 20, rows after it
    resumed = subprocess.run([*script, "--steps", "40"], capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert re.search(r"resume verified: steps \d+\.\.\d+ reproduce the interrupted run bit for bit", resumed.stderr)
