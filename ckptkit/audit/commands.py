"""Audit and replay for any loop: run the user's command, compare what it recorded.

    ckptkit audit -- python train.py --run-dir {run_dir} --steps 40
    ckptkit audit --stop-at 17 -- python train.py --run-dir {run_dir} --steps 40
    ckptkit replay runs/a --from 20 -- python train.py --run-dir {run_dir} --steps 40

The command is the user's own training script. It must use :class:`ckptkit.RunState`
on the directory ``{run_dir}`` stands for, start-or-resume with
:meth:`RunState.resume_or_start` (so the same arguments continue a stopped run), and
call :meth:`RunState.step_done` after every step (so it honours the stop request,
``CKPTKIT_STOP_AT``). :meth:`RunState.record` adds per-step rows, which let the
report name the first step that differs; without them checkpoints are compared.

* audit: the command runs once uninterrupted (run ``a``) and once stopped at step
  ``K`` and resumed in a new process with the same arguments (run ``b``); the
  recordings and every checkpoint both saved at the same step are compared bit for bit.
* replay: RUN's checkpoint at (or before) ``S`` and its companions are copied into
  a fresh directory, the command resumes from it, and its recording from ``S`` on
  is compared with RUN's.

Every process is bounded by ``timeout`` (its whole process group is killed), and
temporary directories are removed whatever happens. spec/replay.md "Any loop".
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AuditError, CheckpointNotFound, ReplayDivergence, ReplayError
from ..run import ENVIRONMENT_FILE, checkpoint_name
from ..run.difference import Difference
from ..run.history import HISTORY_FILE
from ..run.preemption import EXIT_STOPPED, STOP_AT_ENV
from .recording import LAYOUT_ONLY, RunRecording, first_difference

__all__ = ["PLACEHOLDER", "CommandReport", "audit_command", "replay_command"]

PLACEHOLDER = "{run_dir}"
DEFAULT_TIMEOUT = 600.0  # seconds per process
_HINT = (
    "the command must use ckptkit.RunState on {run_dir}, start with state.resume_or_start(), and call "
    "state.step_done(step + 1) after every step (SpikeGuard.run does); docs/adopting.md"
)
Log = Callable[[str], None]


@dataclass(frozen=True)
class CommandReport:
    """What an audit or a replay of a command found; ``ok`` when nothing differs."""

    what: str  # "audit" or "replay"
    command: tuple[str, ...]
    end: int  # the step the run ended at
    stop_at: int | None  # audit: where run b stopped; replay: the checkpoint it started from
    rows_compared: int
    checkpoints_compared: int
    difference: Difference | None
    kept: str | None = None  # where the runs were kept (--keep-dir), else None

    @property
    def ok(self) -> bool:
        return self.difference is None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "ok": self.ok,
            "what": self.what,
            "command": list(self.command),
            "end": self.end,
            "stop_at": self.stop_at,
            "rows_compared": self.rows_compared,
            "checkpoints_compared": self.checkpoints_compared,
            "kept": self.kept,
            "difference": None if self.difference is None else _difference_json(self.difference),
        }

    def describe(self) -> str:
        if self.what == "audit":
            head = (
                f"audit: a: {self.end} steps uninterrupted; b: stopped at {self.stop_at}, resumed in a new "
                "process with the same arguments"
            )
            sides = ("a", "b")
        else:
            head = f"replay: from the checkpoint at step {self.stop_at} to step {self.end}"
            sides = ("the recording", "the replay")
        lines = [head]
        if self.kept:
            lines.append(f"runs kept in {self.kept}")
        if self.rows_compared == 0:
            lines.append(
                "note: the command records no rows; add state.record(step, loss=...) to name the first "
                "step that differs (checkpoints are compared either way)"
            )
        if self.difference is None:
            lines.append(
                f"IDENTICAL: {self.rows_compared} recorded row(s) and {self.checkpoints_compared} "
                "checkpoint(s) bit for bit"
            )
        else:
            lines += _difference_lines(self.difference, *sides)
            if self.difference.layout_only:
                return "\n".join(lines)
            lines.append(
                "  usual causes: a draw from the global generator in the step (wrap it in ckptkit.step_rng), "
                "a data position or scheduler not registered, nondeterministic kernels "
                "(see ckptkit.ReplayDivergence)"
            )
        return "\n".join(lines)


def _difference_lines(d: Difference, a: str, b: str, limit: int = 12) -> list[str]:
    """The difference as the command report prints it: the step, what differs, the tensors."""
    if d.layout_only:
        return [f"DIFFERS at step {d.step}: {d.file} differs between {a} and {b} in bytes only: {LAYOUT_ONLY}"]
    if d.kind == "checkpoint":
        lines = [f"DIFFERS at step {d.step}: {d.file} differs between {a} and {b} (every recorded row matched)"]
    elif d.kind == "rows":
        counts = [f for f in d.fields if f.field == "rows"]
        if counts:
            return [
                f"DIFFERS after step {d.step}: {a} and {b} recorded a different number of rows",
                f"  {a}: {counts[0].recorded} rows, {b}: {counts[0].replayed} rows",
            ]
        lines = [f"DIFFERS at step {d.step}: {a} and {b} recorded different rows there"]
    else:
        lines = [f"DIFFERS at step {d.step}: the {d.kind} row"]
    lines += d.lines(a, b, limit=limit)
    return lines


def _difference_json(d: Difference) -> dict[str, Any]:
    """The command report's ``difference`` object: what differs, by name (spec/replay.md "Any loop")."""
    return {
        "step": d.step,
        "kind": d.kind,
        "fields": list(d.field_names),
        "tensors": list(d.tensor_names),
        "file": d.file,
    }


def _substitute(argv: Sequence[str], run_dir: str, error: type[Exception]) -> list[str]:
    if not argv:
        raise error(f"no command given: put it after --, with {PLACEHOLDER} where its run directory goes")
    if not any(PLACEHOLDER in a for a in argv):
        raise error(
            f"the command has no {PLACEHOLDER}: write {PLACEHOLDER} where its run directory goes, "
            f"e.g. -- python train.py --run-dir {PLACEHOLDER}"
        )
    return [a.replace(PLACEHOLDER, run_dir) for a in argv]


def _run(argv: list[str], label: str, timeout: float, stop_at: int | None, log: Log) -> int:
    """Run ``argv`` in its own process group, bounded by ``timeout``; returns its exit code."""
    env = {k: v for k, v in os.environ.items() if k != STOP_AT_ENV}
    if stop_at is not None:
        env[STOP_AT_ENV] = str(stop_at)
    log(f"{label}: {' '.join(argv)}" + (f" ({STOP_AT_ENV}={stop_at})" if stop_at is not None else ""))
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AuditError(
                f"{label}: the command did not finish within {timeout:g} s (--timeout); a loop that "
                f"ignores the stop request or never ends runs until killed: {_HINT}"
            ) from None
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if code not in (0, EXIT_STOPPED):
            err.seek(0)
            tail = err.read().decode("utf-8", "replace").strip().splitlines()[-15:]
            found = [m.group(1) for m in map(_DIVERGED.match, tail) if m]
            if found:  # the command itself found it is not the same run (a ring rebuild that missed)
                raise ReplayDivergence(f"{label}: the command found its run differs: {found[-1]}")
            raise AuditError(f"{label}: the command exited {code}:\n" + "\n".join(tail))
    return code


#: The last line of a traceback of the ckptkit error a loop raises when its own replay misses.
_DIVERGED = re.compile(r"^(?:ckptkit\.errors\.)?ReplayDivergence: (.+)$")


@contextlib.contextmanager
def _workdir(keep_dir: str | None, prefix: str) -> Iterator[str]:
    if keep_dir is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as d:
            yield d
        return
    if os.path.isdir(keep_dir) and os.listdir(keep_dir):
        raise AuditError(f"--keep-dir {keep_dir} is not empty")
    os.makedirs(keep_dir, exist_ok=True)
    yield keep_dir


def audit_command(
    argv: Sequence[str],
    *,
    stop_at: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    keep_dir: str | None = None,
    log: Log | None = None,
) -> CommandReport:
    """Run the command uninterrupted and stopped-at-``stop_at``-then-resumed; compare.

    Args:
        argv: the command, with ``{run_dir}`` in its arguments.
        stop_at: the step run b stops at (default: half of run a's end).
        timeout: seconds each process may take.
        keep_dir: keep the runs in ``keep_dir/a`` and ``keep_dir/b`` (empty or new).
        log: progress lines.

    Raises:
        AuditError: no ``{run_dir}``, a process failed or timed out, the command saved no
            checkpoint or ignored the stop request, ``stop_at`` outside the run.
        ReplayDivergence: the command raised one itself (its ring rebuild missed): a difference.
    """
    log = log or (lambda _m: None)
    _substitute(argv, "", AuditError)
    with _workdir(keep_dir, "ckptkit-audit-") as base:
        a, b = os.path.join(base, "a"), os.path.join(base, "b")
        _run(_substitute(argv, a, AuditError), "a (uninterrupted)", timeout, None, log)
        rec_a = RunRecording(a)
        end = rec_a.last_step
        if end is None:
            raise AuditError(f"a: the command saved no checkpoint in {PLACEHOLDER} ({a}): {_HINT}")
        k = max(1, end // 2) if stop_at is None else stop_at
        if not 1 <= k < end:
            raise AuditError(f"--stop-at {k} is outside the run: run a ended at step {end}; pick 1..{end - 1}")
        if _run(_substitute(argv, b, AuditError), f"b (stopped at {k})", timeout, k, log) != EXIT_STOPPED:
            raise AuditError(f"b: the command ignored the stop request ({STOP_AT_ENV}={k}) and ran to its end: {_HINT}")
        if not os.path.isfile(os.path.join(b, checkpoint_name(k))):
            raise AuditError(f"b: the command stopped at {k} but left no {checkpoint_name(k)}: {_HINT}")
        _run(_substitute(argv, b, AuditError), "b (resumed)", timeout, None, log)
        rec_b = RunRecording(b)
        return CommandReport(
            "audit",
            tuple(argv),
            end,
            k,
            min(len(rec_a.rows), len(rec_b.rows)),
            len(set(rec_a.checkpoints) & set(rec_b.checkpoints)),
            first_difference(rec_a, rec_b),
            keep_dir,
        )


def replay_command(
    run_dir: str,
    from_step: int,
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    keep_dir: str | None = None,
    log: Log | None = None,
) -> CommandReport:
    """Re-run an outside loop's run from its checkpoint at (or before) ``from_step``; compare.

    RUN is only read: the checkpoint, its companions, ``environment.json`` and
    ``history.jsonl`` are copied into a fresh directory the command resumes from.

    Raises:
        CheckpointNotFound: no checkpoint at or before ``from_step``.
        ReplayError: no ``{run_dir}`` in the command.
        AuditError: the command failed or timed out.
        ReplayDivergence: the command raised one itself (its ring rebuild missed): a difference.
    """
    log = log or (lambda _m: None)
    _substitute(argv, "", ReplayError)
    rec = RunRecording(run_dir)
    before = [s for s in rec.checkpoints if s <= from_step]
    if not before:
        have = ", ".join(map(str, sorted(rec.checkpoints))) or "none"
        raise CheckpointNotFound(f"{run_dir}: no checkpoint at or before step {from_step} (checkpoints: {have})")
    start = max(before)
    with _workdir(keep_dir, "ckptkit-replay-") as base:
        work = os.path.join(base, "replay")
        os.makedirs(work)
        name = checkpoint_name(start)
        for f in sorted(os.listdir(run_dir)):
            if f.startswith(name) or f in (ENVIRONMENT_FILE, HISTORY_FILE):
                shutil.copy2(os.path.join(run_dir, f), os.path.join(work, f))
        _run(_substitute(argv, work, ReplayError), f"replay from step {start}", timeout, None, log)
        got = RunRecording(work)
        compared = [r for r in got.rows if r["step"] >= start]
        return CommandReport(
            "replay",
            tuple(argv),
            got.last_step or start,
            start,
            len(compared),
            len({s for s in set(rec.checkpoints) & set(got.checkpoints) if s > start}),
            first_difference(rec, got, from_step=start),
            keep_dir,
        )
