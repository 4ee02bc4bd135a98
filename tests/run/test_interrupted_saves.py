"""What an interrupted save or deletion leaves is never a checkpoint (spec/runstate.md R-023).

One process, real SIGKILLs (``tests/die_in_save``): a run killed in its first save leaves
companions without a container; one killed in retention, companions whose container is
gone. ``ckptkit verify RUN`` says WARN for each and exits 0; a fresh start and a resume
both remove them, saying so, and continue the same run. (The 2-rank torchrun cases are in
``test_trainer_distributed.py``.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_FLAGS, Flat, assert_same_run, history

from ckptkit.cli import main
from ckptkit.run import RunState, checkpoint_name
from ckptkit.run._files import debris

FLAGS = [*TINY_FLAGS, "--ckpt-every", "5", "--steps", "10", "--threads", "1"]
HOOKS = Path(__file__).resolve().parents[1] / "die_in_save"


def _killed(run_dir: Path, *flags: str, **env: str) -> None:
    """``ckptkit train`` in a process that SIGKILLs itself where ``env`` says."""
    path = os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "ckptkit", "train", "--run-dir", str(run_dir), "--quiet", *FLAGS, *flags]
    done = subprocess.run(argv, env={**os.environ, "PYTHONPATH": path, **env}, capture_output=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]


def _train(run_dir: Path, *flags: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``ckptkit train`` here, to its end; what it said on stderr."""
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_dir), *FLAGS, *flags]) == 0
    return capsys.readouterr().err


def _warns(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    capsys.readouterr()
    assert main(["verify", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], lines
    return [line.split(": incomplete")[0] for line in lines if line.startswith("WARN")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert main(["train", "--run-dir", str(run_dir), "--quiet", *FLAGS]) == 0
    return run_dir


@pytest.mark.slow
def test_a_run_killed_in_its_first_save_is_started_and_resumed_over_what_it_left(
    straight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    _killed(run_dir, CKPTKIT_TEST_DIE_IN_FILE_SAVE="5")
    first = checkpoint_name(5)
    assert not (run_dir / first).exists() and (run_dir / f"{first}.config.json").exists()
    assert _warns(run_dir, capsys) == [f"WARN  {run_dir / first}.config.json", f"WARN  {run_dir / first}.ngram"]
    again = tmp_path / "again"
    shutil.copytree(run_dir, again)
    said = _train(run_dir, capsys=capsys)
    removed = f"removed what interrupted saves left (none of it a checkpoint): {first}.config.json, {first}.ngram"
    assert removed in said
    said = _train(again, "--resume", capsys=capsys)
    assert "no checkpoint was committed before the run stopped: starting it again from step 0" in said
    assert removed in said
    for done in (run_dir, again):
        assert_same_run(straight, done, 10)
        assert _warns(done, capsys) == []


@pytest.mark.slow
def test_a_run_killed_in_retention_verifies_and_resumes_without_a_fallback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    _killed(run_dir, "--keep", "1", CKPTKIT_TEST_DIE_IN_FILE_DELETE="5")
    gone = checkpoint_name(5)
    assert (run_dir / checkpoint_name(10)).exists() and not (run_dir / gone).exists()
    assert _warns(run_dir, capsys) == [f"WARN  {run_dir / gone}.config.json", f"WARN  {run_dir / gone}.ngram"]
    _train(run_dir, "--keep", "1", "--steps", "12", "--resume", capsys=capsys)
    (resume,) = [r for r in history(run_dir) if r["kind"] == "resume"]
    assert resume["step"] == 10
    took_over, removed = resume["notes"][:2]  # the killed job's lease first (lease.md R-LS04)
    assert took_over.startswith("took over the run directory's lease from pid ")
    assert removed == f"removed what interrupted saves left (none of it a checkpoint): {gone}.config.json, {gone}.ngram"
    assert _warns(run_dir, capsys) == []


def test_an_uncommitted_distributed_step_is_debris_and_a_start_removes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "step-00000010.dcp").mkdir()
    (tmp_path / "step-00000010.dcp" / "rank-00000.ckdcp").write_bytes(b"half")
    (tmp_path / "step-00000010.dcp.config.json").write_text("{}")
    assert [name for name, _ in debris(tmp_path, ".dcp")] == ["step-00000010.dcp", "step-00000010.dcp.config.json"]
    assert main(["verify", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["files"] == []
    assert doc["incomplete"] == [
        {
            "path": str(tmp_path / "step-00000010.dcp"),
            "why": "an uncommitted checkpoint (no metadata.ckdcp): its save or its deletion was cut off",
        },
        {
            "path": str(tmp_path / "step-00000010.dcp.config.json"),
            "why": "a companion without its checkpoint (step-00000010.dcp is not a whole checkpoint)",
        },
    ]
    said: list[str] = []
    state = RunState(tmp_path, config=Flat(), log=said.append)
    assert state.start() == 0
    removed = "step-00000010.dcp, step-00000010.dcp.config.json"
    assert said == [f"removed what interrupted saves left (none of it a checkpoint): {removed}"]
    assert sorted(os.listdir(tmp_path)) == ["environment.json", "lease.json"]  # the run holds its directory


def test_a_name_with_a_digit_int_cannot_read_is_no_checkpoint(tmp_path: Path) -> None:
    """One rule names a checkpoint (run/_files.py's, which the CLI uses too): a name whose
    "digits" are a superscript is a stray file, not a step that crashes the listing."""
    from ckptkit.run._files import list_checkpoints, step_of

    (tmp_path / "step-0000000\u00b2.ckpt").write_bytes(b"")
    (tmp_path / checkpoint_name(7)).write_bytes(b"")
    assert step_of("step-0000000\u00b2.ckpt") is None
    assert list_checkpoints(tmp_path) == [(7, str(tmp_path / checkpoint_name(7)))]
