"""The torchtitan CPU example runs as documented: 2 gloo ranks, killed in a step, resumed by the same command."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from ckptkit.cli import main as ckptkit_main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata's, not ours
]

sys.path.insert(0, str(Path(__file__).parent))
from torchtitan_cpu import main  # noqa: E402


def test_killed_in_step_5_the_same_command_resumes_at_4_and_a_changed_lr_is_refused(tmp_path: Path) -> None:
    # The ranks are forked from a forkserver, whose output pytest may not capture: the files say it all.
    run, folder = ["--dump-folder", str(tmp_path), "--steps", "6"], tmp_path / "checkpoint"
    assert main([*run, "--kill-at", "5"]) == signal.SIGKILL  # both ranks, in step 5, as a crash would
    assert sorted(p.name for p in folder.iterdir()) == ["environment.json", "history.jsonl", "step-2", "step-4"]
    kept = {name: (folder / name / "metadata.ckdcp").stat().st_ino for name in ("step-2", "step-4")}
    assert main(run) == 0
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2", "step-4", "step-6"]
    assert {name: (folder / name / "metadata.ckdcp").stat().st_ino for name in kept} == kept  # resumed at 4
    assert ckptkit_main(["verify", str(folder / "step-6")]) == 0
    done = (folder / "step-6" / "metadata.ckdcp").read_bytes()
    assert main([*run, "--lr", "1e-3"]) == 3  # ConfigDrift: refused before a step
    assert (folder / "step-6" / "metadata.ckdcp").read_bytes() == done
