"""``ckptkit train`` in a real terminal, 80 columns wide, read off the screen (spec/trainer.md R-T15).

tmux runs the trainer in a pseudo-terminal of 80x50 and renders what a user sees; the
test types Ctrl-C into it after a few steps and reads the screen back
(``capture-pane -J`` joins the rows the terminal wrapped, so a joined line wider than
80 columns is one the terminal wrapped).
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_FLAGS, kill_at_step

from ckptkit.cli._progress import Progress
from ckptkit.cli._width import fit, fit_command

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = 80


class Screen:
    """One tmux server of its own (its socket under the test's directory), one 80-column pane."""

    def __init__(self, sock: Path, command: str) -> None:
        self.base = ["tmux", "-S", str(sock)]
        self._tmux("new-session", "-d", "-x", str(COLUMNS), "-y", "50", command)

    def _tmux(self, *args: str) -> str:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, f"tmux {args[0]}: {done.stderr}"
        return done.stdout

    def lines(self) -> list[str]:
        return self._tmux("capture-pane", "-p", "-J", "-S", "-200").rstrip("\n").splitlines()

    def wait_for(self, text: str, timeout: float = 120.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines()
            if any(text in line for line in lines):
                return lines
            time.sleep(0.3)
        raise AssertionError(f"{text!r} not on the screen within {timeout}s:\n" + "\n".join(self.lines()))

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", *keys)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=10)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux, the terminal the test reads")
def test_ctrl_c_in_an_80_column_terminal_leaves_a_clean_screen_and_a_summary(tmp_path: Path) -> None:
    run = "runs/a"  # as the README spells it: a path too long for a line cannot be broken
    train = [sys.executable, "-m", "ckptkit", "train", "--run-dir", run, "--steps", "100000", *TINY_FLAGS]
    train += ["--ckpt-every", "1000", "--log-every", "2"]
    # The shell traps SIGINT (a trap, not an ignore: the trainer gets the default) so that
    # Ctrl-C, sent to the whole foreground group, ends the trainer and not the shell.
    command = f"trap : INT; cd {shlex.quote(str(tmp_path))} && PYTHONPATH={shlex.quote(str(ROOT))} {shlex.join(train)}"
    command += "; echo EXIT=$?"
    screen = Screen(tmp_path / "tmux.sock", f"sh -c {shlex.quote(command + '; sleep 600')}")
    try:
        screen.wait_for("step 4/100000")
        screen.keys("C-c")
        lines = screen.wait_for("EXIT=")
    finally:
        screen.close()
    shown = "\n".join(lines)
    assert "EXIT=75" in lines, shown
    wrapped = [line for line in lines if len(line) > COLUMNS]
    assert wrapped == [], shown  # the log lines, the bar, the stop message and the summary fit
    said = next(i for i, line in enumerate(lines) if "SIGINT: finishing the current step" in line)
    assert lines[said] == "ckptkit: SIGINT: finishing the current step, then saving it", shown  # a fresh line
    # the terminal echoes ^C where its cursor is: on the bar, or after a log line being printed
    assert lines[said - 1].endswith("^C") and lines[said - 1].startswith(("train: ", "ckptkit train: ", "^C")), shown
    assert lines[said + 1] == "(send SIGINT again to abort at once)", shown
    assert any(line.startswith("ckptkit train: step 4/100000 | loss ") for line in lines), shown
    assert any(line.startswith("               | ") for line in lines), shown  # a step line's continuation
    summary = lines.index("summary:")
    rows = [line.split()[0] for line in lines[summary + 1 :] if line.startswith("  ") and not line.startswith("   ")]
    assert rows == ["trained", "final", "spikes", "rollbacks", "checkpoints", "history", "resume"], shown
    resume = [line for line in lines[summary:] if line.startswith(("  resume", " " * 17))]
    command_text = " ".join(line.removesuffix(" \\").strip() for line in resume).removeprefix("resume ").strip()
    argv = shlex.split(command_text)
    assert argv[:4] == ["ckptkit", "train", "--run-dir", run] and argv[-1] == "--resume", shown


def test_a_line_is_broken_at_its_fields_and_a_command_between_its_arguments() -> None:
    line = "ckptkit train: step 10/200 | loss 3.3402 | lm 2.9108 | aux 0.8588 | gnorm 0.772 | lr 2.73e-03 | fp32"
    assert fit(line, 80, 15) == [
        "ckptkit train: step 10/200 | loss 3.3402 | lm 2.9108 | aux 0.8588 | gnorm 0.772",
        "               | lr 2.73e-03 | fp32",
    ]
    assert fit(line, None, 15) == [line]  # not a terminal: one message, one line
    assert fit("  history      h.jsonl: one row per step", 30, 15) == [
        "  history      h.jsonl: one",
        "               row per step",
    ]
    command = "ckptkit train --run-dir 'runs/my run' --steps 8 --resume --ckpt-every 2"
    lines = fit_command("  resume       ", command, 60, 17)
    assert lines == [
        "  resume       ckptkit train --run-dir 'runs/my run' \\",  # a flag stays with its (quoted) value
        "                 --steps 8 --resume --ckpt-every 2",
    ]
    assert shlex.split(" ".join(x.removesuffix("\\") for x in lines).replace("resume       ", "", 1)) == shlex.split(
        command
    )


def test_progress_to_a_file_writes_each_message_on_one_line() -> None:
    out = io.StringIO()
    Progress("train", stream=out).log("step 1/2 | " + " | ".join(["x" * 30] * 4))
    assert out.getvalue().count("\n") == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux, the terminal the test reads")
def test_a_resume_after_a_kill_says_verified_on_the_screen_and_in_its_summary(tmp_path: Path) -> None:
    """spec/determinism.md R-D23: the line and the summary row a person reads after kill -9 and a resume."""
    run = "runs/a"
    train = [sys.executable, "-m", "ckptkit", "train", "--run-dir", run, "--steps", "12", *TINY_FLAGS]
    train += ["--ckpt-every", "5", "--log-every", "100"]
    kill_at_step(train, tmp_path / run, 6, committed=5, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    command = f"cd {shlex.quote(str(tmp_path))} && PYTHONPATH={shlex.quote(str(ROOT))} {shlex.join(train)} --resume"
    screen = Screen(tmp_path / "tmux.sock", f"sh -c {shlex.quote(command + '; echo EXIT=$?; sleep 600')}")
    try:
        lines = screen.wait_for("EXIT=")
    finally:
        screen.close()
    shown = "\n".join(lines)
    assert "EXIT=0" in lines and [line for line in lines if len(line) > COLUMNS] == [], shown
    said = next(i for i, line in enumerate(lines) if line.startswith("ckptkit train: resume verified: steps 5.."))
    text = " ".join(line.strip() for line in lines[said : said + 2])  # broken at a word, continued indented
    assert re.search(r"steps 5\.\.\d+ reproduce the interrupted run bit for bit \(\d+ steps, \d+ tensors each\)", text)
    row = next(i for i, line in enumerate(lines) if line.startswith("  resume check "))
    assert lines[row].startswith("  resume check verified: steps 5.."), shown
