"""What a user sees from ``ckptkit train``: the bar, the log lines, --quiet, the summary, --threads.

The bar is checked in a real terminal: the trainer runs in a child process whose
stdout and stderr are a pseudo-terminal (stdlib ``pty``), and the test reads the
screen's bytes. Nothing here asserts a wall-clock time: the rate and ETA are
matched by their shape only.
"""

from __future__ import annotations

import io
import os
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_FLAGS

from ckptkit.cli import main
from ckptkit.cli._progress import Progress
from ckptkit.run import read_environment
from ckptkit.run._history import read_rows

pytestmark = pytest.mark.slow

# The tiny model of tests/trainer/test_trainer_resume.py, as flags.
KNOBS = [*TINY_FLAGS]
# A bar line: "train:  50%|█████     | 20/40 [00:01<00:01, 19.73step/s, loss=2.9411]" (or "s/step" when slow).
BAR = re.compile(
    r"train: +(\d+)%\|[^|]*\| (\d+)/(\d+) \[(\d\d:)?\d\d:\d\d<(\d\d:)?\d\d:\d\d, +[\d.]+(step/s|s/step), "
    r"loss=[\d.]+\]"
)


def train(run: Path, *argv: str) -> list[str]:
    return ["train", "--run-dir", str(run), *KNOBS, *argv]


def step_rows(run: Path) -> list[dict]:
    return [r for r in read_rows(run / "history.jsonl")[0] if r["kind"] == "step"]


# ----------------------------------------------------------------------------- lines and quiet


def test_lines_mode_off_a_terminal_prints_the_log_lines_and_no_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train(tmp_path, "--steps", "4", "--log-every", "2")) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert re.fullmatch(
        r"ckptkit train: warm-up probe: start loss \d\.\d{4} \(ln 256 = 5\.5452\), "
        r"forward deterministic",
        lines[0],
    )
    assert [line.split(" | ")[0] for line in lines[1:]] == ["ckptkit train: step 2/4", "ckptkit train: step 4/4"]
    assert "\r" not in err and "\x1b" not in err and "step/s" not in err  # a log file gets lines, not a bar


def test_quiet_silences_stderr_and_keeps_the_result_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train(tmp_path, "--steps", "2", "--quiet")) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines()[0] == f"step 2: {tmp_path / 'step-00000002.ckpt'}"
    assert out.splitlines()[1] == "summary:"


# ----------------------------------------------------------------------------- the summary


def summary(out: str) -> dict[str, str]:
    """The summary's rows by name (``  final loss   2.4 ...`` -> {"final loss": "2.4 ..."})."""
    lines = out.splitlines()
    start = lines.index("summary:")
    return {line[2:14].strip(): line[15:] for line in lines[start + 1 :]}


def test_summary_says_what_the_run_wrote_and_its_extend_command_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(train(run, "--steps", "6", "--ckpt-every", "2", "--keep", "2", "--lr", "0.002", "--quiet")) == 0
    rows = summary(capsys.readouterr().out)
    last = step_rows(run)[-1]
    assert list(rows) == ["trained", "final loss", "spikes", "rollbacks", "checkpoints", "history", "extend"]
    assert re.fullmatch(r"6 step\(s\) \(0 -> 6\) in [\d.]+ s, [\d.]+ steps/s", rows["trained"])
    assert rows["final loss"] == (
        f"{last['loss']:.4f} (lm {last['lm_loss']:.4f}, aux {last['aux_loss']:.4f}) at step 6"
    )
    assert rows["spikes"] == "none" and rows["rollbacks"] == "none"
    assert rows["checkpoints"] == f"2 kept in {run}: step 4, 6 (--keep 2: the newest 2 stay, older ones are deleted)"
    assert rows["history"] == (
        f"{run / 'history.jsonl'}: one row per step (loss, grad norm, lr, spike verdict), 6 step rows"
    )
    # The command carries the run's own flags (no drift), --steps spelled out, and it works as printed.
    extend = shlex.split(rows["extend"])
    assert extend[:7] == ["ckptkit", "train", "--run-dir", str(run), "--steps", "12", "--resume"]
    assert {"--lr", "0.002", "--keep", "2", "--ckpt-every", "--d-model", "32"} <= set(extend)
    assert main([*extend[1:], "--quiet"]) == 0
    rows = summary(capsys.readouterr().out)
    assert re.fullmatch(r"6 step\(s\) \(resumed at step 6, now at 12\) in [\d.]+ s, [\d.]+ steps/s", rows["trained"])
    assert rows["checkpoints"].startswith(f"2 kept in {run}: step 10, 12 ")
    assert rows["history"].endswith("12 step rows")
    assert rows["extend"].startswith(f"ckptkit train --run-dir {run} --steps 24 --resume ")


def test_summary_names_spikes_and_rollbacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The rollback scenario of tests/trainer/test_trainer_rollback.py: a spike injected at step 9,
    # re-run, rolled back to 6.
    assert (
        main(
            train(
                tmp_path,
                "--steps",
                "14",
                "--auto-rollback",
                "on",
                "--spike-at",
                "9",
                "--rollback-k",
                "3",
                "--spike-window",
                "8",
                "--spike-min-history",
                "4",
                "--ckpt-every",
                "3",
                "--keep",
                "100",
                "--quiet",
            )
        )
        == 0
    )
    rows = summary(capsys.readouterr().out)
    assert rows["spikes"] == "1, at step 9"
    assert rows["rollbacks"] == "1: step 9 back to 6, lr x0.5 from then on"
    # Steps 0..9, the re-run of step 9, then steps 6..13 of the timeline after the rollback: 10 + 1 + 8 rows.
    assert re.fullmatch(r"19 step\(s\) \(0 -> 14\) in .*", rows["trained"])
    assert rows["checkpoints"].startswith(f"5 kept in {tmp_path}: step 3, 6, 9, 12, 14 ")


# ----------------------------------------------------------------------------- the bar, in process


class Terminal(io.StringIO):
    """A text stream that says it is a terminal, so Progress picks the bar."""

    def isatty(self) -> bool:
        return True


def test_progress_picks_its_mode_from_the_stream() -> None:
    assert Progress("train", stream=Terminal()).mode == "bar"
    assert Progress("train", stream=io.StringIO()).mode == "lines"
    assert Progress("train", quiet=True, stream=Terminal()).mode == "quiet"


def test_the_bar_writes_lines_above_itself_and_follows_a_rollback_back() -> None:
    screen = Terminal()
    with Progress("train", stream=screen) as progress:
        progress.log("before the bar")
        for done in (1, 2, 3, 4, 5, 3):  # a rollback from 5 back to 3
            progress.at(done, 10, loss="2.5000")
        progress.log("above the bar")
    text = screen.getvalue()
    assert text.startswith("ckptkit train: before the bar\n")
    assert "ckptkit train: above the bar" in text
    final = re.split(r"[\r\n]", text.rstrip())[-1]
    assert re.search(r"\| 3/10 \[.*loss=2\.5000\]$", final)


def test_quiet_progress_writes_nothing() -> None:
    screen = Terminal()
    with Progress("train", quiet=True, stream=screen) as progress:
        progress.log("hidden")
        progress.at(1, 2)
    assert screen.getvalue() == ""


# ----------------------------------------------------------------------------- the bar, in a real terminal


def run_in_terminal(argv: list[str], cwd: Path, timeout: float = 240) -> tuple[int, str]:
    """Run ``argv`` with stdin, stdout and stderr on a new 40x120 pseudo-terminal; its exit code and screen bytes."""
    import fcntl
    import pty
    import termios

    try:
        master, slave = pty.openpty()
    except OSError as e:  # a container without /dev/ptmx or devpts
        pytest.skip(f"no pseudo-terminal can be opened here ({e}); the bar needs a terminal to be seen")
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        argv,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        start_new_session=True,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", "replace")


def test_a_terminal_shows_the_bar_with_rate_and_eta_and_the_summary_ends_the_output(tmp_path: Path) -> None:
    pytest.importorskip("pty", reason="the pseudo-terminal module is POSIX-only")
    code, screen = run_in_terminal(
        [
            sys.executable,
            "-m",
            "ckptkit",
            "train",
            "--run-dir",
            str(tmp_path / "run"),
            "--steps",
            "40",
            "--log-every",
            "20",
            *KNOBS,
        ],
        cwd=tmp_path,
    )
    assert code == 0, screen
    pieces = [p.strip() for p in re.split(r"[\r\n]", screen) if p.strip()]
    bars = [m for m in map(BAR.search, pieces) if m]
    assert bars, screen
    final = bars[-1]
    assert (final.group(1), final.group(2), final.group(3)) == ("100", "40", "40")
    # The log lines still come, above the bar, on their own lines.
    assert any(p.startswith("ckptkit train: step 20/40 | loss ") for p in pieces), screen
    # After the bar: the result line, then the summary, which ends the output.
    after = pieces[pieces.index(final.string) + 1 :]
    assert after[0] == f"step 40: {tmp_path / 'run' / 'step-00000040.ckpt'}"
    assert after[1] == "summary:"
    # A row wider than the terminal's 120 columns continues on the next lines; a command with " \\".
    extend = next(i for i, p in enumerate(after) if p.startswith("extend "))
    command = " ".join(p.removesuffix(" \\") for p in after[extend:])
    assert command.startswith(f"extend       ckptkit train --run-dir {tmp_path / 'run'} --steps 80 --resume ")
    assert all(len(p) <= 120 - 2 for p in after)  # stripped of their indent: no row wider than the terminal


def test_replay_and_verify_show_their_bars_in_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pty", reason="the pseudo-terminal module is POSIX-only")
    run = tmp_path / "run"
    assert main(train(run, "--steps", "6", "--ckpt-every", "2", "--quiet")) == 0
    code, screen = run_in_terminal([sys.executable, "-m", "ckptkit", "replay", str(run), "--from", "2"], cwd=tmp_path)
    assert code == 0, screen
    pieces = [p.strip() for p in re.split(r"[\r\n]", screen) if p.strip()]
    # The bar starts where the replay starts: 4 of the 6 steps are replayed.
    assert any(
        re.search(r"replay: 100%\|[^|]*\| 6/6 \[\d\d:\d\d<00:00, +[\d.]+(step/s|s/step)\]", p) for p in pieces
    ), screen
    assert (
        pieces[-1]
        == "IDENTICAL: steps 2..5, every history fingerprint and 2 checkpoint(s) bit for bit (9 recorded rows)"
    )
    # verify: a bar in bytes for two or more files, before the result lines (which go to stdout).
    code, screen = run_in_terminal([sys.executable, "-m", "ckptkit", "verify", str(run)], cwd=tmp_path)
    assert code == 0, screen
    pieces = [p.strip() for p in re.split(r"[\r\n]", screen) if p.strip()]
    bar = next(i for i, p in enumerate(pieces) if re.search(r"verify: 100%\|[^|]*\| [\d.]+[kMG]?/[\d.]+[kMG]? \[", p))
    assert all(p.startswith("OK    ") for p in pieces[bar + 1 :]) and len(pieces[bar + 1 :]) == 11
    # 3 checkpoints + 3 sidecars, then their companions (3 snapshots, environment.json) and history.jsonl
    # Off a terminal, verify prints its results only: nothing on stderr.
    assert main(["verify", str(run)]) == 0
    assert capsys.readouterr().err == ""


def test_audit_reports_the_steps_both_runs_trained(tmp_path: Path) -> None:
    from ckptkit.trainer import TrainerConfig
    from ckptkit.trainer._audit import audit

    cfg = TrainerConfig().replace(
        **{
            "model.d_model": 32,
            "model.block_size": 16,
            "data.seq_len": 16,
            "data.batch": 4,
            "train.steps": 3,
            "train.ckpt_every": 1,
            "train.keep": 4,
        }
    )
    seen: list[tuple[int, int]] = []
    assert audit(cfg, tmp_path / "audit", on_step=lambda done, total: seen.append((done, total))).ok
    assert {total for _, total in seen} == {6}
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)  # never goes back
    assert (3, 6) in seen and seen[-1] == (6, 6)  # run a's end, then run b's


# ----------------------------------------------------------------------------- --threads


def test_threads_is_part_of_the_run_and_another_count_on_resume_is_an_environment_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    default = torch.get_num_threads()
    mine = default + 1  # differs from what a call without --threads runs under
    assert main(train(tmp_path, "--steps", "2", "--threads", str(mine), "--quiet")) == 0
    assert torch.get_num_threads() == default  # restored: the count is the run's, not the process's
    assert read_environment(tmp_path)["intra_op_threads"] == mine
    assert read_rows(tmp_path / "history.jsonl")[0][0]["intra_op_threads"] == mine  # the start row
    assert shlex.split(summary(capsys.readouterr().out)["extend"])[-2:] == ["--threads", str(mine)]
    # A resume under another count -- torch's default here -- is refused as the environment check says ...
    refusal = (
        f"ckptkit train: the environment differs from the run's recording in 1 fact(s):\n"
        f"  intra_op_threads: recorded {mine}, now {default}\n"
        "pass --allow-env-change to resume anyway (the override is recorded in the run history)\n"
    )
    assert main(train(tmp_path, "--steps", "3", "--resume")) == 1
    assert capsys.readouterr().err == refusal
    assert main(train(tmp_path, "--steps", "3", "--resume", "--threads", str(default))) == 1
    assert capsys.readouterr().err == refusal
    # ... the recorded count resumes ...
    assert main(train(tmp_path, "--steps", "3", "--resume", "--threads", str(mine), "--quiet")) == 0
    capsys.readouterr()
    # ... and --allow-env-change accepts another one, recorded in the history; the extend command keeps both.
    assert main(train(tmp_path, "--steps", "4", "--resume", "--allow-env-change", "--quiet")) == 0
    resumes = [r for r in read_rows(tmp_path / "history.jsonl")[0] if r["kind"] == "resume"]
    assert resumes[-1]["env_overrides"] == [f"intra_op_threads: recorded {mine}, now {default}"]
    extend = shlex.split(summary(capsys.readouterr().out)["extend"])
    assert extend[-3:] == ["--threads", str(default), "--allow-env-change"]
    assert main([*extend[1:], "--quiet"]) == 0  # the printed command works as printed
    assert torch.get_num_threads() == default


def test_threads_below_one_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(train(tmp_path, "--threads", "0")) == 2
    assert capsys.readouterr().err == "ckptkit train: --threads must be >= 1 (got 0)\n"


@pytest.mark.parametrize(
    ("world", "per_node", "launcher"),
    [
        (1, None, "ckptkit"),
        (2, "2", "torchrun --nproc_per_node 2 -m ckptkit"),
        (2, None, "torchrun --nproc_per_node 2 -m ckptkit"),
        (
            2,
            "1",
            "torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m ckptkit",
        ),
        (8, "4", "torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m ckptkit"),
    ],
)
def test_the_extend_and_resume_commands_repeat_how_many_nodes_the_job_ran_on(
    monkeypatch: pytest.MonkeyPatch, world: int, per_node: str | None, launcher: str
) -> None:
    """spec/trainer.md R-T16: a two-node job's summary never suggests a one-node command."""
    from ckptkit.cli import _train
    from ckptkit.trainer import _parallel

    monkeypatch.setattr(_parallel, "ranks", lambda: _parallel.Ranks(0, world))
    if per_node is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", per_node)
    assert " ".join(_train._launcher()) == launcher
