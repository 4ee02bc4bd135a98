"""``ckptkit audit -- CMD`` and ``ckptkit replay RUN --from S -- CMD``: any loop (spec/replay.md "Any loop").

Real processes: the user's command runs as a child, once uninterrupted and once
stopped at a step (CKPTKIT_STOP_AT; a command that ignores it is killed after a checkpoint)
and resumed in a new process.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from ckptkit.audit._commands import AuditPlan, audit_command
from ckptkit.cli import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LOOP = [sys.executable, str(ROOT / "examples" / "resumable_loop.py"), "--run-dir", "{run_dir}"]

# A loop without torch (but in mode "threads"), with a knob for each way a command can get the
# protocol wrong; in mode "threads" a process that resumes runs under another intra-op thread
# count and accepts the change, as a job rescheduled onto another machine does.
TOY = """
import dataclasses, sys, time
import ckptkit

mode, run_dir = sys.argv[1], sys.argv[2]

@dataclasses.dataclass
class Cfg:
    steps: int = 12

n = {"v": 0}
state = ckptkit.RunState(run_dir, config=Cfg())
state.add_value("n", get=lambda: n["v"], set=lambda v: n.update(v=v))
if mode == "threads" and state.checkpoints():
    import torch
    torch.set_num_threads(torch.get_num_threads() + 1)
start = state.resume_or_start(allow_env_change=mode == "threads")
while mode == "forever":
    time.sleep(0.2)
for step in range(start, 12):
    n["v"] += step
    state.record(step, n=n["v"])
    if mode != "ignore-stop":
        state.step_done(step + 1)
state.save(12)
"""


# A loop written from the earlier docs: resume_or_start, a save every 5 steps, a row each step and
# no step_done, so it ignores the stop request and the audit kills it after a checkpoint (R-P18).
# --global-dropout plants a draw from torch's global generator, which no checkpoint restores. A
# hand-written SGD step: torch.optim's first step imports torch._dynamo, a second per process.
PLAIN = """
import dataclasses, sys, time
import torch
import ckptkit

@dataclasses.dataclass
class Cfg:
    planted: bool = "--global-dropout" in sys.argv

cfg = Cfg()
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
state = ckptkit.RunState(sys.argv[1], config=cfg)
state.add_model("net", net)
for step in range(state.resume_or_start(), 20):
    x = torch.randn(8, 4, generator=ckptkit.torch_generator(0, step))
    if cfg.planted:
        x = x * (torch.rand(x.shape) >= 0.1)
    loss = (net(x) - x.sum(1, keepdim=True)).pow(2).mean()
    net.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.1 * p.grad
    state.record(step, loss=loss)
    if (step + 1) % 5 == 0:
        state.save(step + 1)
    time.sleep(0.02)  # a step takes milliseconds, as a real one does: the kill comes within a poll (5 ms)
state.close()
"""


@pytest.fixture(autouse=True)
def private_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit's work directories go under this test's own temp dir, so the leftover check
    sees only what this test made (other processes on the machine use the shared /tmp)."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))


def _leftovers() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ckptkit-audit-*")))


@pytest.fixture
def toy(tmp_path: Path) -> list[str]:
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    return [sys.executable, str(script)]


def test_the_example_loop_audits_identical(capsys: pytest.CaptureFixture[str]) -> None:
    before = _leftovers()
    assert main(["audit", "--quiet", "--", *LOOP, "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "audit: a: 40 steps uninterrupted; b: cooperative stop at step 20, resumed in a fresh process" in out
    assert "IDENTICAL: 40 steps, every history fingerprint and 1 checkpoint(s) bit for bit (80 recorded rows)" in out
    assert "environment: torch " in out  # the one report shows the runs' environment, for any loop
    assert _leftovers() == before  # nothing left behind


@pytest.fixture
def plain(tmp_path: Path) -> list[str]:
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    return [sys.executable, str(script), "{run_dir}"]


def test_a_loop_without_step_done_is_killed_after_its_checkpoint_and_audits_identical(
    plain: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = tmp_path / "keep"
    assert main(["audit", "--quiet", "--stop-at", "10", "--keep-dir", str(keep), "--", *plain]) == 0
    out = capsys.readouterr().out
    # killed once checkpoint 10 is committed and a step row after it is written: 15 only if stalled
    said = re.search(r"b: killed after checkpoint (\d+) \(the command ignored the stop request at step 10\)", out)
    assert said and said[1] in ("10", "15"), out
    assert "IDENTICAL: 20 steps, every history fingerprint and 3 checkpoint(s) bit for bit (40 recorded rows)" in out
    # a crash's resume: the killed process's lease taken over (and released at the end) and, killed
    # after its row of step 11, its rows after checkpoint 10 set aside
    assert not (keep / "b" / "lease.json").exists()
    assert (keep / "b" / "history.interrupted.jsonl").is_file() or said[1] == "15"


def test_a_global_dropout_in_a_loop_without_step_done_is_named_at_the_step_it_resumed_at(
    plain: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "--quiet", "--json", "--stop-at", "10", "--", *plain, "--global-dropout"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["stop"] == {"how": "killed", "requested": 10}
    assert doc["divergence"]["step"] == doc["resume_at"]  # the resumed process's first step draws otherwise
    assert "model:net.weight" in [t["name"] for t in doc["divergence"]["tensors"]]


def test_stop_at_picks_the_step_and_the_toy_loop_is_identical_after_a_cooperative_stop(toy: list[str]) -> None:
    report = audit_command(AuditPlan(command=[*toy, "ok", "{run_dir}"], stop_at=5))
    assert report.ok and report.resume_at == 5
    assert report.to_json()["stop"] == {"how": "cooperative", "requested": 5}
    assert report.describe().startswith("audit: a: 12 steps uninterrupted; b: cooperative stop at step 5, resumed in")


def test_a_resume_under_another_thread_count_is_reported_though_the_bits_agree(toy: list[str]) -> None:
    # environment.json records the process that started run b; its resume row, the one that
    # resumed at 5 under another thread count (R-D12): the report lists it from there
    report = audit_command(AuditPlan(command=[*toy, "threads", "{run_dir}"], stop_at=5))
    threads = report.environment["intra_op_threads"]
    assert report.ok  # the toy's integers do not care how many threads there are
    assert report.to_json()["environment_differences"] == [
        {"key": "intra_op_threads", "a": threads, "b": threads + 1, "from_step": 5}
    ]
    text = report.describe()
    assert "environment differs between the runs in 1 fact(s):\n" in text
    assert (
        f"  intra_op_threads: a {threads}, b {threads + 1} from step 5 (a resume accepted the change there)\n" in text
    )
    assert text.endswith(
        "IDENTICAL: 12 steps, every history fingerprint and 1 checkpoint(s) bit for bit (24 recorded rows)"
    )


def _trouble(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    before = _leftovers()
    assert main(argv) == 2
    assert _leftovers() == before
    return capsys.readouterr().err


def test_a_command_without_run_dir_is_refused(toy: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = _trouble(["audit", "--", *toy, "ok", "/tmp/x"], capsys)
    assert "ckptkit audit: the command has no {run_dir}: write {run_dir} where its run directory goes" in err


def test_a_command_that_never_uses_runstate_is_refused_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    err = _trouble(["audit", "--quiet", "--", sys.executable, "-c", "import sys", "{run_dir}"], capsys)
    assert re.search(
        r"a: the command saved no checkpoint in \{run_dir\} \(.*\): the command must use "
        r"ckptkit\.RunState on \{run_dir\}",
        err,
    )


def test_a_command_that_ignores_the_stop_request_and_saves_only_at_its_end_is_refused(
    toy: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _trouble(["audit", "--quiet", "--", *toy, "ignore-stop", "{run_dir}"], capsys)
    assert (
        "ckptkit audit: b: the command ignored the stop request (CKPTKIT_STOP_AT=6) and ran to its end before the "
        "audit could stop it as a crash would (after a committed checkpoint at step 6..11, once a step row or "
        "checkpoint past 6 showed it went on): save checkpoints more often or pick an earlier --stop-at; or call "
        "state.step_done(step + 1) after every step, and it stops at exactly 6 itself (docs/adopting.md)\n"
    ) in err


def test_a_torchrun_job_whose_rank_fails_is_refused_naming_the_rank_s_error_not_only_torchrun_s_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "job.py"
    failing = 'if os.environ["RANK"] == "1":\n    raise RuntimeError("rank 1 broke: the planted failure")\n'
    script.write_text("import os\n" + failing)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    err = _trouble(["audit", "--quiet", "--", *launcher, str(script), "{run_dir}"], capsys)
    assert "a (uninterrupted): the command exited 1:\n" in err
    assert "RuntimeError: rank 1 broke: the planted failure" in err  # above torchrun's traceback
    assert "Root Cause (first observed failure)" in err and "rank      : 1 (local_rank: 1)" in err
    assert "launch_agent" not in err  # torchrun's own traceback is left out


@pytest.mark.parametrize("tool", ["audit", "replay"])
def test_a_timeout_that_is_not_positive_is_refused_before_anything_runs(
    tool: str, toy: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = [str(tmp_path), "--from", "0"] if tool == "replay" else []
    err = _trouble([tool, *where, "--quiet", "--timeout", "0", "--", *toy, "ok", "{run_dir}"], capsys)
    assert f"ckptkit {tool}: --timeout must be > 0 (got 0)" in err


def test_a_command_that_never_ends_times_out_and_is_killed(toy: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = _trouble(["audit", "--quiet", "--timeout", "1", "--", *toy, "forever", "{run_dir}"], capsys)
    assert "a (uninterrupted): the command did not finish within 1 s (--timeout)" in err


def test_stop_at_past_the_end_is_refused(toy: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = _trouble(["audit", "--quiet", "--stop-at", "12", "--", *toy, "ok", "{run_dir}"], capsys)
    assert "--stop-at 12 is outside the run: run a ended at step 12; pick 1..11" in err


def test_trainer_flags_with_a_command_are_refused(toy: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = _trouble(["audit", "--steps", "4", "--", *toy, "ok", "{run_dir}"], capsys)
    assert "the trainer's flags (and --resume-at) audit `ckptkit train`" in err


def test_replay_of_an_outside_run_from_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = [a.replace("{run_dir}", str(run)) for a in LOOP]
    assert os.spawnv(os.P_WAIT, sys.executable, [*argv, "--steps", "60"]) == 0
    files = sorted(os.listdir(run))
    assert main(["replay", str(run), "--from", "55", "--quiet", "--", *LOOP, "--steps", "60"]) == 0
    out = capsys.readouterr().out
    assert "replay: from the checkpoint at step 50 to step 60" in out
    assert re.search(r"IDENTICAL: steps 50\.\.59, every history fingerprint and 1 checkpoint\(s\) bit for bit", out)
    assert sorted(os.listdir(run)) == files  # RUN is only read
    assert main(["replay", str(run), "--from", "50", "--quiet", "--", *LOOP, "--steps", "60", "--global-dropout"]) == 2
    assert "ckptkit replay: replay from step 50: the command exited 1" in capsys.readouterr().err  # config drift


def test_replay_without_a_checkpoint_before_from_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path), "--from", "3", "--", *LOOP]) == 2
    assert (
        f"ckptkit replay: {tmp_path}: no checkpoint at or before step 3 (checkpoints: none)" in capsys.readouterr().err
    )
