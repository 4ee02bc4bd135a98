"""Preemption and resume-or-start (spec/runstate.md "Stopping"): real signals to real processes.

A SIGTERM (how SLURM and Kubernetes preempt) or SIGINT (Ctrl-C) to a running loop
finishes the step in progress, saves it, exits 75 with the line that resumes it;
the resume is the same run bit for bit. A second signal aborts at once and damages
nothing. ``CKPTKIT_STOP_AT`` (what ``ckptkit audit`` sets) stops the same way.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_FLAGS

import ckptkit
from ckptkit.cli import main
from ckptkit.run import checkpoint_name, list_checkpoints
from ckptkit.run._history import compared_rows, read_rows
from ckptkit.run._preemption import EXIT_STOPPED, STOP_AT_ENV, RunStopped

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resumable_loop.py"
TINY = [*TINY_FLAGS, "--ckpt-every", "1000", "--log-every", "1"]


def _start(argv: list[str], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **env}
    )


def _wait_for_line(proc: subprocess.Popen[str], stream: str, pattern: str, timeout: float = 60.0) -> str:
    """Read ``proc``'s stream until a line matches (bounded); the process is killed on failure."""
    pipe = getattr(proc, stream)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = pipe.readline()
        if not line:
            break
        if re.search(pattern, line):
            return line
    proc.kill()
    proc.wait()
    raise AssertionError(f"no line matching {pattern!r} within {timeout}s")


def _finish(proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out, err


def _stop(proc: subprocess.Popen[str], stream: str, ready: str, sig: int, line: str) -> re.Match[str]:
    """Once ``proc`` prints ``ready``, send ``sig``; it must exit 75 with a stderr line matching ``line``."""
    _wait_for_line(proc, stream, ready)
    proc.send_signal(sig)
    code, _out, err = _finish(proc)
    assert code == EXIT_STOPPED, err
    m = re.search(line, err)
    assert m, err
    return m


def _train(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ckptkit", "train", "--run-dir", str(run_dir), "--steps", str(steps), *TINY, *extra]


def test_ctrl_c_saves_the_current_step_prints_the_resume_command_and_the_resume_is_bit_exact(tmp_path: Path) -> None:
    m = _stop(
        _start(_train(tmp_path / "cut", 100000)),
        "stderr",
        r"step 3/100000 ",
        signal.SIGINT,
        r"ckptkit train: stopped at step (\d+) \(SIGINT\): saved (\S+)\nresume with: (.+)",
    )
    stop = int(m.group(1))
    assert m.group(2) == str(tmp_path / "cut" / checkpoint_name(stop))
    assert list_checkpoints(tmp_path / "cut")[-1][0] == stop  # the step in progress was finished and saved
    resume = m.group(3).split()
    assert resume[:4] == ["ckptkit", "train", "--run-dir", str(tmp_path / "cut")] and resume[-1] == "--resume"
    # The printed command, with --steps set to where the reference stops, continues the same run.
    end = stop + 3
    argv = [sys.executable, "-m", "ckptkit", *resume[1:]]
    argv[argv.index("--steps") + 1] = str(end)
    assert subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=120).returncode == 0
    assert main(["train", "--run-dir", str(tmp_path / "ref"), "--steps", str(end), *TINY, "--quiet"]) == 0
    name = checkpoint_name(end)
    assert (tmp_path / "ref" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes()
    rows = [compared_rows(read_rows(tmp_path / d / "history.jsonl")[0]) for d in ("ref", "cut")]
    assert [r for r in rows[0] if r["kind"] == "step"] == [r for r in rows[1] if r["kind"] == "step"]


SLOW_LOOP = """
import dataclasses, sys, time
import ckptkit

@dataclasses.dataclass
class Cfg:
    steps: int = 1000

n = {"v": 0}
state = ckptkit.RunState(sys.argv[1], config=Cfg())
state.add_value("n", get=lambda: n["v"], set=lambda v: n.update(v=v))
with state.preemptible():
    for step in range(state.resume_or_start(), 1000):
        print(f"step {step}", flush=True)
        time.sleep(0.5)  # a long step: the second signal lands inside it
        n["v"] += 1
        if (step + 1) % 2 == 0:
            state.save(step + 1)
        state.step_done(step + 1)
"""


def test_a_second_ctrl_c_aborts_at_once_and_damages_nothing(tmp_path: Path) -> None:
    script = tmp_path / "slow_loop.py"
    script.write_text(SLOW_LOOP)
    proc = _start([sys.executable, str(script), str(tmp_path / "run")])
    _wait_for_line(proc, "stdout", r"^step 3$")
    proc.send_signal(signal.SIGINT)
    _wait_for_line(proc, "stderr", r"finishing the current step")
    proc.send_signal(signal.SIGINT)
    code, _out, err = _finish(proc)
    assert code == 128 + signal.SIGINT, err
    assert "ckptkit: second SIGINT: aborting now; the checkpoints on disk are intact" in err
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2]  # step 3 was never finished, never saved
    assert main(["verify", str(tmp_path / "run")]) == 0


def test_sigterm_to_a_plain_loop_leaves_a_checkpoint_at_the_current_step_and_the_same_command_resumes(
    tmp_path: Path,
) -> None:
    argv = [sys.executable, str(EXAMPLE), "--run-dir", str(tmp_path / "cut"), "--steps", "100000000"]
    m = _stop(
        _start(argv),
        "stdout",
        r"^step 50: loss ",
        signal.SIGTERM,
        r"ckptkit: stopped at step (\d+) \(SIGTERM\): saved (\S+); resume with: (.+)",
    )
    stop = int(m.group(1))
    assert stop >= 50 and list_checkpoints(tmp_path / "cut")[-1] == (stop, m.group(2))
    assert m.group(3).endswith(f"{EXAMPLE} --run-dir {tmp_path / 'cut'} --steps 100000000")
    # The same command resumes by itself (resume-or-start); here with the end moved close.
    end = str(stop + 7)
    for d in ("cut", "ref"):
        done = subprocess.run(
            [sys.executable, str(EXAMPLE), "--run-dir", str(tmp_path / d), "--steps", end],
            cwd=ROOT,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    name = checkpoint_name(int(end))
    assert (tmp_path / "ref" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes()


def test_the_stop_request_of_ckptkit_audit_stops_at_that_step(tmp_path: Path) -> None:
    proc = _start([sys.executable, str(EXAMPLE), "--run-dir", str(tmp_path), "--steps", "40"], **{STOP_AT_ENV: "17"})
    code, _out, err = _finish(proc)
    assert code == EXIT_STOPPED and f"ckptkit: stopped at step 17 ({STOP_AT_ENV}=17)" in err
    assert [s for s, _ in list_checkpoints(tmp_path)] == [17]


@dataclasses.dataclass
class _Cfg:
    steps: int = 4


def test_resume_or_start_starts_an_empty_directory_and_resumes_a_full_one(tmp_path: Path) -> None:
    state = ckptkit.RunState(tmp_path, config=_Cfg())
    state.add_value("n", get=lambda: 1, set=lambda _v: None)
    assert state.resume_or_start() == 0
    state.save(3)
    assert state.resume_or_start() == 3


def test_step_done_saves_and_raises_run_stopped_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state = ckptkit.RunState(tmp_path, config=_Cfg())
    state.start()
    monkeypatch.setenv(STOP_AT_ENV, "2")
    state.step_done(1)
    with pytest.raises(RunStopped) as e:
        state.step_done(2)
    assert (e.value.code, e.value.step, e.value.reason) == (EXIT_STOPPED, 2, f"{STOP_AT_ENV}=2")
    assert os.path.isfile(e.value.path) and "resume with:" in capsys.readouterr().err
    monkeypatch.setenv(STOP_AT_ENV, "soon")
    with pytest.raises(
        ckptkit.CheckpointError,
        match=re.escape("CKPTKIT_STOP_AT='soon': must be a step count (digits only), e.g. CKPTKIT_STOP_AT=20"),
    ):
        state.step_done(3)


def test_preemptible_restores_the_previous_handlers(tmp_path: Path) -> None:
    state = ckptkit.RunState(tmp_path, config=_Cfg())
    before = signal.getsignal(signal.SIGTERM)
    with state.preemptible():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_stop_releases_the_lease_though_the_loop_never_reaches_close(tmp_path: Path) -> None:
    """spec/lease.md R-LS08: the resume after a clean stop takes over nothing (the loop is
    docs/adopting.md's, no ``state.close()`` after its ``with state.preemptible()`` block)."""
    script = tmp_path / "slow_loop.py"
    script.write_text(SLOW_LOOP)
    proc = _start([sys.executable, str(script), str(tmp_path / "run")])
    _wait_for_line(proc, "stdout", r"^step 0$")
    proc.send_signal(signal.SIGTERM)
    code, _out, err = _finish(proc)
    assert code == EXIT_STOPPED and "ckptkit: stopped at step " in err, err
    assert not (tmp_path / "run" / "lease.json").exists()
    said: list[str] = []
    state = ckptkit.RunState(tmp_path / "run", config=_Cfg(), log=said.append)
    state.add_value("n", get=lambda: 0, set=lambda _v: None)
    assert state.resume().step >= 1
    state.close()
    assert not [s for s in said if "took over" in s], said
