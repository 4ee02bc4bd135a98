"""Audit and replay of a command: run it, compare what it recorded. One engine, for any loop.

    ckptkit audit -- python train.py --run-dir {run_dir} --steps 40
    ckptkit audit --stop-at 17 -- python train.py --run-dir {run_dir} --steps 40
    ckptkit replay runs/a --from 20 -- python train.py --run-dir {run_dir} --steps 40

The command is the user's own training script -- or the reference trainer, whose
``ckptkit audit`` and ``ckptkit replay`` are this engine run on ``python -m ckptkit train``
(:mod:`ckptkit.trainer._audit`, :mod:`ckptkit.trainer._replay`). It must use :class:`ckptkit.RunState` on the directory
``{run_dir}`` stands for, start-or-resume with :meth:`RunState.resume_or_start` (so the
same arguments continue a stopped run). :meth:`RunState.step_done` after every step makes
it honour the stop request, ``CKPTKIT_STOP_AT``: the precise, cooperative stop; a command
that ignores the request is SIGKILLed as a crash would stop it, once it has committed a
checkpoint at or after the step asked for. :meth:`RunState.record` adds per-step rows,
which let the report name the first step that differs; without them checkpoints are
compared.

* audit: the command runs once uninterrupted (run ``a``) and once stopped at (or, killed,
  after) step ``K`` and resumed in a new process (run ``b``); the recordings and every
  checkpoint both saved at the same step are compared bit for bit.
* replay: RUN's checkpoint at (or before) ``S`` and its companions are copied into
  a fresh directory, the command resumes from it, and its recording from ``S`` on
  is compared with RUN's.

Either way the answer is one :class:`AuditReport`. Every process is bounded by
``timeout`` (the whole job is killed, torchrun's ranks included), and temporary
directories are removed whatever happens. spec/replay.md "Any loop" (R-P16, R-P18).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import AuditError, CheckpointError, CheckpointNotFound, ReplayDivergence, ReplayError
from ..format._checkpoint import load
from ..format._io import open_regular
from ..run import ENVIRONMENT_FILE, read_environment
from ..run._difference import Difference, FieldDiff, differing_names, named_reports, show
from ..run._environment import Fact, diff_environment
from ..run._files import run_checkpoints
from ..run._fingerprint import checkpoint_digests
from ..run._history import HISTORY_FILE, read_rows
from ..run._preemption import EXIT_STOPPED, STOP_AT_ENV
from ..run._resume_check import CHECK_ENV, CHECK_KIND
from ._recording import LAYOUT_ONLY, RunRecording, first_difference, rebuild_difference

__all__ = [
    "PLACEHOLDER",
    "AuditPlan",
    "AuditReport",
    "EnvironmentDifference",
    "ReplayPlan",
    "audit_command",
    "compare_runs",
    "replay_command",
    "replay_start",
    "stop_job",
]

PLACEHOLDER = "{run_dir}"
DEFAULT_TIMEOUT = 600.0  # seconds per process
_POLL_S = 0.25  # how often a waiting audit reads the command's history for the progress callback
_WATCH_S = 0.005  # how often it looks whether a command that ignores the stop request may be killed (R-P18)
_HINT = (
    "the command must use ckptkit.RunState on {run_dir}, start with state.resume_or_start(), and call "
    "state.step_done(step + 1) after every step (SpikeGuard.run does); docs/adopting.md"
)
#: How run b was stopped before its resume (R-P18): it stopped itself at the step asked for, or it
#: ignored the stop request and was SIGKILLed after a checkpoint at or after that step; or it was
#: SIGKILLed at steps a test chose, checkpoint or not (:func:`audit_crashes`, R-P19).
COOPERATIVE, KILLED, CRASHED = "cooperative", "killed", "crashed"
_CAUSES = (
    "usual causes: a draw from the global generator in the step (wrap it in ckptkit.step_rng), "
    "a data position or scheduler not registered, nondeterministic kernels (see ckptkit.ReplayDivergence)"
)
#: Environment facts worth a line in the report (all are compared).
_SHOWN = (
    "torch",
    "python",
    "numpy",
    "intra_op_threads",
    "inter_op_threads",
    "deterministic_algorithms",
    "platform_system",
    "platform_machine",
    "cuda_device",
    "world_size",
)
Log = Callable[[str], None]
#: A hook that explains a difference (``difference, run a, run b`` -> the difference, with more said).
Explain = Callable[[Difference, str, str], Difference]
#: Progress: (steps both runs recorded so far, their total).
OnStep = Callable[[int, int], None]


@dataclass(frozen=True)
class EnvironmentDifference:
    """A fact the two runs' processes differed in, from ``from_step`` on: the runs' first compared
    step (their ``environment.json`` files), or a step a resume accepted another environment at
    (its ``resume`` row, R-D12), so that half a run under another thread count is never reported
    as if it ran under the recorded one (spec/replay.md R-P13)."""

    key: str
    a: Fact | None  # None: run a's process did not record the fact
    b: Fact | None
    from_step: int


@dataclass(frozen=True, kw_only=True)
class AuditReport:
    """What an audit or a replay found; ``ok`` when nothing differs (spec/replay.md R-P13).

    ``a`` and ``b`` are the two run directories when they were kept (a replay's ``a`` is
    the recorded run), else None. ``resume_at`` is the step run ``b`` resumed at: where an
    audit stopped it (None: two uninterrupted runs), or the checkpoint a replay started from.
    ``stopped`` says how an audit stopped run ``b`` (:data:`COOPERATIVE` or :data:`KILLED`,
    R-P18) when asked to stop at ``stop_at``; a replay's are None.
    """

    what: str  # "audit" or "replay"
    command: tuple[str, ...]
    steps: int  # the step the runs ended at
    resume_at: int | None
    rows_compared: int
    checkpoints_compared: int
    divergence: Difference | None
    a: str | None = None
    b: str | None = None
    environment: Mapping[str, Any] = field(default_factory=dict)  # run a's facts
    environment_differences: tuple[EnvironmentDifference, ...] = ()
    overrides: tuple[FieldDiff, ...] = ()  # what a replay changed from the recorded config, on purpose
    notes: tuple[str, ...] = ()
    stopped: str | None = None
    stop_at: int | None = None
    kills: tuple[int, ...] = ()  # the steps run b's processes were SIGKILLed at (:data:`CRASHED`)

    @property
    def ok(self) -> bool:
        """The runs are bit-identical (environment differences are shown, not judged)."""
        return self.divergence is None

    def raise_for_divergence(self) -> None:
        """Raise :class:`~ckptkit.errors.ReplayDivergence` (message: :meth:`describe`) unless ``ok``.

        Raises:
            ReplayDivergence: the runs differ.
        """
        if self.divergence is not None:
            raise ReplayDivergence(self.describe())

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object (spec/replay.md R-P13)."""
        return {
            "schema_version": 2,  # 1: the trainer's audit and the command report had objects of their own
            "ok": self.ok,
            "what": self.what,
            "command": list(self.command),
            "a": self.a,
            "b": self.b,
            "steps": self.steps,
            "resume_at": self.resume_at,
            "stop": None if self.stopped is None else self._stop_json(),
            "rows_compared": self.rows_compared,
            "checkpoints_compared": self.checkpoints_compared,
            "environment": dict(sorted(self.environment.items())),
            "environment_differences": [
                {"key": d.key, "a": d.a, "b": d.b, "from_step": d.from_step} for d in self.environment_differences
            ],
            "overrides": [{"field": f.field, "recorded": f.recorded, "replay": f.replayed} for f in self.overrides],
            "notes": list(self.notes),
            "divergence": None if self.divergence is None else self.divergence.to_json("a", "b"),
        }

    def _stop_json(self) -> dict[str, Any]:
        if self.stopped == CRASHED:
            return {"how": self.stopped, "kills": list(self.kills)}
        return {"how": self.stopped, "requested": self.stop_at}

    def describe(self, limit: int = 12) -> str:
        """The human report (what ``ckptkit audit`` and ``ckptkit replay`` print on stdout)."""
        a, b = ("a", "b") if self.what == "audit" else ("the recording", "the replay")
        lines = [self._headline()]
        if self.a is not None:
            lines.append(f"runs: {self.a} {self.b}")
        lines += [
            f"override: {f.field}: recorded {show(f.recorded)}, replay {show(f.replayed)}" for f in self.overrides
        ]
        lines += self._environment_lines()
        lines += [f"note: {n}" for n in self.notes]
        if self.rows_compared == 0 and self.checkpoints_compared:
            lines.append(
                "note: the command records no rows; add state.record(step, loss=...) to name the first "
                "step that differs (checkpoints are compared either way)"
            )
        d = self.divergence
        if d is None:
            span = f"{self.steps} steps" if self.what == "audit" else f"steps {self.resume_at}..{self.steps - 1}"
            lines.append(
                f"IDENTICAL: {span}, every history fingerprint and {self.checkpoints_compared} checkpoint(s) "
                f"bit for bit ({self.rows_compared} recorded rows)"
            )
            return "\n".join(lines)
        lines += _difference_lines(d, a, b, limit)
        if not d.hints and not d.layout_only:  # a layout-only difference says its own cause
            lines.append(f"  {_CAUSES}")
        return "\n".join(lines)

    def _headline(self) -> str:
        if self.what == "replay":
            return f"replay: from the checkpoint at step {self.resume_at} to step {self.steps}"
        if self.stopped == CRASHED:
            at = ", ".join(map(str, self.kills))
            return f"audit: a: {self.steps} steps uninterrupted; b: SIGKILLed at step(s) {at}, resumed each time"
        if self.resume_at is None:
            return f"audit: a, b: {self.steps} steps each, each in a fresh process"
        if self.stopped == KILLED:
            ignored = f"the command ignored the stop request at step {self.stop_at}"
            how = f"killed after checkpoint {self.resume_at} ({ignored})"
        else:
            how = f"cooperative stop at step {self.resume_at}"
        return f"audit: a: {self.steps} steps uninterrupted; b: {how}, resumed in a fresh process"

    def _environment_lines(self) -> list[str]:
        env = self.environment
        shown = ", ".join(f"{k} {env[k]}" for k in _SHOWN if k in env and env[k] != "none")
        lines = [f"environment: {shown}"] if shown else []
        diffs = self.environment_differences
        if diffs:
            lines.append(f"environment differs between the runs in {len({d.key for d in diffs})} fact(s):")
            first = self.resume_at if self.what == "replay" and self.resume_at is not None else 0
            a, b = ("a", "b") if self.what == "audit" else ("the recording", "the replay")
            for d in diffs:
                since = f" from step {d.from_step} (a resume accepted the change there)" if d.from_step > first else ""
                lines.append(f"  {d.key}: {a} {d.a}, {b} {d.b}{since}")
        return lines


def _difference_lines(d: Difference, a: str, b: str, limit: int) -> list[str]:
    """The difference as the report prints it: the step, what differs, the tensors."""
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
    elif d.kind == "rebuild":
        why = "re-running steps for its rollback ring did not reproduce the state recorded after step"
        lines = [f"DIFFERS at step {d.step}: {b} stopped as it resumed: {why} {d.step}"]
    elif d.kind in ("start", "probe"):
        lines = [f"DIFFERS at {'the start row' if d.kind == 'start' else 'a probe before step 0'}"]
    else:
        lines = [f"DIFFERS at step {d.step}: the {d.kind} row"]
    return lines + d.lines(a, b, limit=limit)


# ----------------------------------------------------------------------------- comparing


def _environment(run_dir: str) -> dict[str, Any]:
    """The run's recorded facts; {} when it has no readable record (every fact then shows as a difference)."""
    try:
        facts = read_environment(run_dir)
    except CheckpointError:
        return {}
    return facts if isinstance(facts, dict) else {}


def compare_runs(
    what: str,
    command: Sequence[str],
    a: str,
    b: str,
    *,
    resume_at: int | None,
    to_step: int | None = None,
    kept: bool = True,
    explain: Explain | None = None,
) -> AuditReport:
    """Two recorded runs compared (:func:`~ckptkit.audit.first_difference`): the
    report ``what`` makes of them. A replay (``b``, from ``resume_at``) is compared from its
    start, up to ``to_step`` when it stopped short of run ``a``'s end. ``explain`` says more
    about a difference (the trainer's re-run of the step); ``kept``: the report names the
    directories.

    Raises:
        FormatError: a history line is damaged, or a checkpoint that differs does not verify.
    """
    rec_a, rec_b = RunRecording(a), RunRecording(b)
    start = resume_at if what == "replay" and resume_at is not None else 0
    if to_step is not None:
        rec_a.stop_at(to_step)
    d = first_difference(rec_a, rec_b, from_step=start)
    if d is not None and d.kind == "checkpoint":
        d = _altered(rec_a, d) or d
    if d is not None and explain is not None:
        d = explain(d, a, b)
    env_a = _environment(a)
    env = _environment_differences(rec_a, env_a, rec_b, _environment(b), start)
    if d is not None:
        d = _blame_environment(d, env)
    shared = set(rec_a.checkpoints) & set(rec_b.checkpoints)
    return AuditReport(
        what=what,
        command=tuple(command),
        steps=(rec_a.last_step if what == "audit" else rec_b.last or rec_b.last_step)
        or start,  # a replay: where its rows end
        resume_at=resume_at,
        rows_compared=len([r for r in rec_b.rows if r["step"] >= start]),
        checkpoints_compared=len([s for s in shared if s > start]) if what == "replay" else len(shared),
        divergence=d,
        a=a if kept else None,
        b=b if kept else None,
        environment=env_a,
        environment_differences=env,
    )


#: The hint for a file that verifies but is not what its run wrote (spec/replay.md R-P06).
_ALTERED = (
    "the file verifies (its container checksums were re-sealed) but is not what the run wrote: it was "
    "altered after the fact; do not resume from it"
)


def _recorded_mismatch(rec: RunRecording, step: int) -> tuple[str, list[str], Mapping[str, int], dict[str, int]]:
    """The run's checkpoint at ``step`` against the digests its ``checkpoint`` row recorded when it
    was written: (path, the names that differ, recorded, the file's); nothing differs without a row.

    Raises:
        FormatError: the file does not verify.
    """
    path, recorded = rec.checkpoints[step], rec.checkpoint_digests.get(step)
    if recorded is None or os.path.isdir(path):  # a .dcp directory's state is not read here
        return path, [], {}, {}
    digests = checkpoint_digests(load(path))
    return path, differing_names(recorded, digests), recorded, digests


def _altered(rec_a: RunRecording, d: Difference) -> Difference | None:
    """A checkpoint difference where run a's own file is not what run a recorded writing: said so."""
    path, bad, _, _ = _recorded_mismatch(rec_a, d.step)
    return dataclasses.replace(d, file=path, hints=(_ALTERED, *d.hints)) if bad else None


def _blame_environment(d: Difference, env: Sequence[EnvironmentDifference]) -> Difference:
    """``d`` with the environment as its likely cause, said first, when the runs differed in one before it."""
    before = [e for e in env if e.from_step <= d.step]
    if not before:
        return d
    keys = ", ".join(sorted({e.key for e in before}))
    since = min(e.from_step for e in before)
    hint = f"the runs ran under different environments from step {since} ({keys}): the likely cause"
    return dataclasses.replace(d, hints=(hint, *d.hints))


def _environment_differences(
    rec_a: RunRecording, env_a: Mapping[str, Any], rec_b: RunRecording, env_b: Mapping[str, Any], start: int
) -> tuple[EnvironmentDifference, ...]:
    """Every fact the runs' processes differ in from ``start`` on, and from which step: their
    ``environment.json`` files, then at each step a ``resume`` row of either run is at, the
    environment that process ran under (R-D12). A difference is listed where it begins."""
    steps = sorted({start} | {s for s, _ in rec_a.resumes + rec_b.resumes if s > start})
    out: list[EnvironmentDifference] = []
    before: dict[str, tuple[Any, Any]] = {}
    for s in steps:
        now = {
            d.key: (d.recorded, d.current) for d in diff_environment(rec_a.facts_at(env_a, s), rec_b.facts_at(env_b, s))
        }
        out += [EnvironmentDifference(k, *v, s) for k, v in now.items() if before.get(k) != v]
        before = now
    return tuple(out)


# ----------------------------------------------------------------------------- running


def _substitute(argv: Sequence[str], run_dir: str, error: type[Exception]) -> list[str]:
    if not argv:
        raise error(f"no command given: put it after --, with {PLACEHOLDER} where its run directory goes")
    if not any(PLACEHOLDER in a for a in argv):
        raise error(
            f"the command has no {PLACEHOLDER}: write {PLACEHOLDER} where its run directory goes, "
            f"e.g. -- python train.py --run-dir {PLACEHOLDER}"
        )
    return [a.replace(PLACEHOLDER, run_dir) for a in argv]


def stop_job(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a command and every process it started -- a torchrun job's ranks too -- and reap it.

    torchrun starts each rank in a session of its own, so killing the agent's process
    group would leave the ranks running: every descendant is killed by its pid.
    """
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
            children.setdefault(parent, []).append(int(entry))
    job, todo = [proc.pid], [proc.pid]
    while todo:
        kids = children.get(todo.pop(), [])
        job += kids
        todo += kids
    for pid in reversed(job):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything that left the tree but kept the group
    proc.communicate()


def _steps_recorded(run_dir: str, since: float = 0.0) -> int:
    """Steps done by the run's ``step`` rows written at or after ``since`` (0 before the first)."""
    rows = [
        r
        for r in read_rows(os.path.join(run_dir, HISTORY_FILE))[0]
        if r["kind"] == "step" and r.get("time", since) >= since
    ]
    return rows[-1]["step"] + 1 if rows else 0


class _HistoryTail:
    """The newest ``step`` row's step in a history a running command appends to, read as it
    grows: only the bytes written since the last look (a long run's history is never re-read)."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.step, self.rest = path, 0, -1, b""

    def last_step(self) -> int:
        """-1 before the first ``step`` row (or while the file cannot be read)."""
        try:
            fd, size = open_regular(self.path, "history")
        except CheckpointError:
            return self.step
        try:
            if size < self.offset:  # rewritten: read it again
                self.offset, self.step, self.rest = 0, -1, b""
            new = os.pread(fd, size - self.offset, self.offset)
        finally:
            os.close(fd)
        self.offset += len(new)
        *lines, self.rest = (self.rest + new).split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and row.get("kind") == "step" and isinstance(row.get("step"), int):
                    self.step = max(self.step, row["step"])
        return self.step


@dataclass
class _KillWatch:
    """When to stop a command that ignores the stop request the way a crash would (R-P18): once a
    checkpoint at step ``k``..``end - 1`` is committed (read from the run directory: a ``.ckpt``
    file's container is renamed into place last, a ``.dcp`` directory's metadata written last), and
    the run has gone on past ``k`` -- a step row after step ``k``, or a later checkpoint -- which a
    command that takes the request (it saves ``k`` and exits 75) never does. A background save's
    history rows come before its commit: the commit is what is waited for."""

    run_dir: str
    k: int
    end: int
    killed: bool = False

    def __post_init__(self) -> None:
        self._tail = _HistoryTail(os.path.join(self.run_dir, HISTORY_FILE))

    def ready(self) -> bool:
        """The command has committed a checkpoint to resume from and gone on without stopping."""
        steps = run_checkpoints(self.run_dir)
        if not any(self.k <= s < self.end for s in steps):
            return False
        return max(steps) > self.k or self._tail.last_step() > self.k


@dataclass
class _StepWatch:
    """When to SIGKILL a command at a moment a test chose (:func:`audit_crashes`): once the history
    this process writes holds a ``step`` row of step ``k`` or later, checkpoint or not, as a crash
    lands. Every process of a run makes the history its own by replacing the file (a fresh start
    or a resume, spec/determinism.md R-D21), so the rows an earlier process left are not counted."""

    run_dir: str
    k: int
    killed: bool = False

    def __post_init__(self) -> None:
        self._path = os.path.join(self.run_dir, HISTORY_FILE)
        self._left = _inode(self._path)  # the file the process before this one left, if any
        self._tail: _HistoryTail | None = None

    def ready(self) -> bool:
        if self._tail is None:
            now = _inode(self._path)
            if now is None or now == self._left:
                return False
            self._tail = _HistoryTail(self._path)
        return self._tail.last_step() >= self.k


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@dataclass
class _Runner:
    """Runs the command, each time in a fresh process group bounded by ``timeout``."""

    argv: Sequence[str]
    error: type[Exception]
    timeout: float
    log: Log
    on_step: OnStep | None = None
    total: int | None = None  # the steps both runs train, when known (the progress callback's total)
    done: int = 0  # steps the runs before this one trained
    accept: Sequence[int] = ()  # exit codes that end the command as its recording may have ended
    since: float = 0.0  # progress counts rows written from then on (a replay's copied rows are not its own)
    stopped: str = ""  # what a command that exited with an accepted code said last (its exit code first)

    def run(
        self,
        run_dir: str,
        label: str,
        *,
        stop_at: int | None = None,
        extra: Sequence[str] = (),
        watch: _KillWatch | _StepWatch | None = None,
    ) -> int:
        """Run the command on ``run_dir``; returns its exit code (0, or 75 when it stopped as asked,
        or -9 when ``watch`` said to kill it).

        Raises:
            AuditError: it timed out or exited otherwise (its stderr's last lines).
            _Diverged: it failed after its ring rebuild missed (a difference, not trouble).
        """
        argv = [*_substitute(self.argv, run_dir, self.error), *extra]
        env = {k: v for k, v in os.environ.items() if k != STOP_AT_ENV}
        env[CHECK_ENV] = "off"  # the audit and the replay compare the runs, and report, themselves
        if stop_at is not None:
            env[STOP_AT_ENV] = str(stop_at)
        self.log(f"{label}: {' '.join(argv)}" + (f" ({STOP_AT_ENV}={stop_at})" if stop_at is not None else ""))
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
            try:
                code = self._wait(proc, run_dir, label, watch)
            except BaseException:
                stop_job(proc)
                raise
            if watch is not None and watch.killed:
                return code
            if code not in (0, EXIT_STOPPED):
                err.seek(0)
                text = err.read().decode("utf-8", "replace")
                if code not in self.accept:
                    _trouble(label, code, text, run_dir)
                self.stopped = f"exit {code}: {_last_message(text)}"
        return code

    def _wait(
        self, proc: subprocess.Popen[bytes], run_dir: str, label: str, watch: _KillWatch | _StepWatch | None
    ) -> int:
        """The command's exit code; with ``watch``, it is looked at every few milliseconds and the
        job killed (-9) as soon as it says so."""
        deadline = time.monotonic() + self.timeout
        tick, shown = (_POLL_S if watch is None else _WATCH_S), time.monotonic()
        while True:
            try:
                return proc.wait(timeout=min(tick, max(deadline - time.monotonic(), 0.001)))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise AuditError(
                        f"{label}: the command did not finish within {self.timeout:g} s (--timeout); a loop "
                        f"that never ends runs until killed: {_HINT}"
                    ) from None
                if watch is not None and watch.ready():
                    stop_job(proc)
                    watch.killed = proc.returncode == -signal.SIGKILL
                    return proc.returncode
                if time.monotonic() - shown >= _POLL_S:
                    self.progress(run_dir)
                    shown = time.monotonic()

    def progress(self, run_dir: str, *, finished: bool = False) -> None:
        """Tell ``on_step`` the steps trained so far (a run that ``finished`` counts whole)."""
        if self.on_step is None or self.total is None:
            return
        steps = _steps_recorded(run_dir, self.since)
        if steps:  # nothing new yet: the bar stays where it is (a replay's starts at its checkpoint)
            self.on_step(min(self.done + steps, self.total), self.total)
        if finished:
            self.done += steps


def _last_message(stderr: str) -> str:
    """The first line of the last message a command wrote (``ckptkit train: ...``), or its last line."""
    lines = stderr.strip().splitlines() or ["(nothing on stderr)"]
    heads = [i for i, line in enumerate(lines) if re.match(r"[\w.-]+( [\w.-]+)?: ", line)]
    return lines[heads[-1] if heads else -1]


class _Diverged(Exception):
    """The command stopped because it found itself not the same run: its ring rebuild missed."""

    def __init__(self, difference: Difference, step: int) -> None:
        super().__init__(difference.describe())
        self.difference, self.step = difference, step  # the step the rebuild was to reach


def _trouble(label: str, code: int, stderr: str, run_dir: str) -> None:
    """A failed process: the divergence its history's last row records (a guarded loop's ring
    rebuild that missed, spec/rollback.md R-R12), or trouble, with its stderr's last lines."""
    rows = read_rows(os.path.join(run_dir, HISTORY_FILE))[0] if os.path.isdir(run_dir) else []
    rows = [r for r in rows if r["kind"] != CHECK_KIND]  # a resume's verdict may follow (determinism.md R-D23)
    if rows and rows[-1]["kind"] == "rebuild":
        raise _Diverged(rebuild_difference(rows[-1]), rows[-1].get("to", rows[-1]["step"]))
    raise AuditError(f"{label}: the command exited {code}:\n" + "\n".join(_stderr_tail(stderr)))


#: The line torchrun's agent ends its own traceback with when a rank failed.
_TORCHRUN_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def _stderr_tail(stderr: str) -> list[str]:
    """What a person needs of a failed command's stderr: its last 15 lines; under ``torchrun``,
    whose own traceback and report box of exit codes fill those, the ranks' last 10 lines before
    the agent's traceback (the error itself: a Python exception, gloo's abort) and the report's
    root cause."""
    lines = stderr.strip().splitlines()
    failed = [i for i, line in enumerate(lines) if line.startswith(_TORCHRUN_FAILED)]
    if not failed:
        return lines[-15:]
    starts = [i for i in range(failed[-1]) if lines[i].startswith("Traceback (most recent call last):")]
    ranks = lines[: starts[-1] if starts else failed[-1]]
    cause = [i for i in range(failed[-1], len(lines)) if lines[i].startswith("Root Cause")]
    box = lines[cause[0] : cause[0] + 9] if cause else lines[failed[-1] :][:9]
    return [*ranks[-10:], *box]


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


# ----------------------------------------------------------------------------- audit


@dataclass(frozen=True, kw_only=True)
class AuditPlan:
    """What :func:`audit_command` runs: the command, how run b is stopped and resumed, and the hooks.

    Attributes:
        command: the command, with ``{run_dir}`` in its arguments.
        stop_at: the step run b stops at (default: half of run a's end).
        interrupt: False: run b is a second uninterrupted run (two fresh processes compared).
        stop_with: the arguments that make the command itself end at step ``k`` and exit 0
            (the trainer's ``--steps k``); None: the stop request ``CKPTKIT_STOP_AT=k``, which
            a command that takes it answers with exit 75, and for which one that ignores it is
            SIGKILLed after a committed checkpoint at or after ``k`` (R-P18). (torchrun reports a
            rank's exit 75 as a failure: a torchrun command that takes the request needs ``stop_with``.)
        resume_args: arguments the resuming process gets besides ``command`` (the trainer's
            ``--resume``; a loop that resumes-or-starts needs none).
        steps: the steps each run trains, when known (the progress callback's total).
        explain: says more about a difference (:data:`Explain`).
        on_step: progress: (steps both runs recorded so far, their total).
        timeout: seconds each process may take (``--timeout``), > 0.
        keep_dir: keep the runs in ``keep_dir/a`` and ``keep_dir/b`` (empty or new).
        log: progress lines.

    Raises:
        ValueError: ``timeout`` is not > 0.
        AuditError: no command, or no ``{run_dir}`` in it.
    """

    command: Sequence[str]
    stop_at: int | None = None
    interrupt: bool = True
    stop_with: Callable[[int], Sequence[str]] | None = None
    resume_args: Sequence[str] = ()
    steps: int | None = None
    explain: Explain | None = None
    on_step: OnStep | None = None
    timeout: float = DEFAULT_TIMEOUT
    keep_dir: str | None = None
    log: Log | None = None

    def __post_init__(self) -> None:
        _check_timeout(self.timeout)
        _substitute(self.command, "", AuditError)


def _check_timeout(timeout: float) -> None:
    if not timeout > 0:
        raise ValueError(f"--timeout must be > 0 (got {timeout:g})")


def audit_command(plan: AuditPlan) -> AuditReport:
    """Run the command uninterrupted and stopped-at-``stop_at``-then-resumed; compare.

    Raises:
        AuditError: a process failed or timed out, the command saved no checkpoint or
            ran to its end under the stop request with none to be killed after, ``stop_at``
            outside the run.
    """
    total = None if plan.steps is None else 2 * plan.steps
    runner = _Runner(plan.command, AuditError, plan.timeout, plan.log or (lambda _m: None), plan.on_step, total)
    with _workdir(plan.keep_dir, "ckptkit-audit-") as base:
        a, b = os.path.join(base, "a"), os.path.join(base, "b")
        kept = plan.keep_dir is not None
        k: int | None = None
        stop: _Stop | None = None
        try:
            runner.run(a, "a (uninterrupted)")
            end = RunRecording(a).last_step
            if end is None:
                raise AuditError(f"a: the command saved no checkpoint in {PLACEHOLDER} ({a}): {_HINT}")
            runner.total = runner.total or 2 * end
            runner.progress(a, finished=True)
            k = (max(1, end // 2) if plan.stop_at is None else plan.stop_at) if plan.interrupt else None
            if k is None:
                runner.run(b, "b (uninterrupted)")
            else:
                stop = _stop(runner, b, k, end, plan.stop_with)
                runner.run(b, "b (resumed)", extra=plan.resume_args)
        except _Diverged as e:  # run b found itself not the same run, and stopped
            at = k if stop is None else stop.at
            report = _stopped_report("audit", plan.command, e, at, (a, b) if kept else None)
        else:
            runner.progress(b)
            at = None if stop is None else stop.at
            report = compare_runs("audit", plan.command, a, b, resume_at=at, kept=kept, explain=plan.explain)
        return report if stop is None else dataclasses.replace(report, stopped=stop.how, stop_at=stop.requested)


@dataclass(frozen=True)
class _Stop:
    """How run b was stopped (:data:`COOPERATIVE` or :data:`KILLED`), at which step it was asked
    to, and the checkpoint it resumes from."""

    how: str
    requested: int
    at: int


def _stopped_report(
    what: str, command: Sequence[str], e: _Diverged, resume_at: int | None, runs: tuple[str, str] | None
) -> AuditReport:
    """The report of a run b that stopped as it found itself not the same run (nothing compared)."""
    a, b = runs or (None, None)
    return AuditReport(
        what=what,
        command=tuple(command),
        steps=e.step,
        resume_at=resume_at,
        rows_compared=0,
        checkpoints_compared=0,
        divergence=e.difference,
        a=a,
        b=b,
    )


def _stop(runner: _Runner, b: str, k: int, end: int, stop_with: Callable[[int], Sequence[str]] | None) -> _Stop:
    """Run b's first process, asked to stop at ``k``: with ``stop_with``, its own arguments end it
    there; else the stop request, which a command takes by saving ``k`` and exiting 75 and which
    one that ignores it is SIGKILLed for, after a committed checkpoint at or after ``k`` (R-P18)."""
    if not 1 <= k < end:
        raise AuditError(f"--stop-at {k} is outside the run: run a ended at step {end}; pick 1..{end - 1}")
    if stop_with is not None:
        runner.run(b, f"b (to step {k})", extra=stop_with(k))
    else:
        watch = _KillWatch(b, k, end)
        code = runner.run(b, f"b (stopped at {k})", stop_at=k, watch=watch)
        at = max(run_checkpoints(b), default=end)
        if watch.killed and at < end:
            runner.log(f"b: the command ignored the stop request ({STOP_AT_ENV}={k}): killed after checkpoint {at}")
            return _Stop(KILLED, k, at)
        if code != EXIT_STOPPED:
            raise AuditError(
                f"b: the command ignored the stop request ({STOP_AT_ENV}={k}) and ran to its end before the "
                f"audit could stop it as a crash would (after a committed checkpoint at step {k}..{end - 1}, once "
                f"a step row or checkpoint past {k} showed it went on): save checkpoints more often or pick an "
                f"earlier --stop-at; or call state.step_done(step + 1) after every step, and it stops at exactly "
                f"{k} itself (docs/adopting.md)"
            )
    if k not in run_checkpoints(b):
        raise AuditError(f"b: the command stopped at {k} but left no checkpoint at step {k}: {_HINT}")
    return _Stop(COOPERATIVE, k, k)


def audit_crashes(
    command: Sequence[str],
    kills: Sequence[int],
    *,
    resume_args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT,
    keep_dir: str | None = None,
    log: Log | None = None,
) -> AuditReport:
    """Run the command uninterrupted (run a), then again (run b) SIGKILLed as the history of each
    of its processes reaches the next step of ``kills`` -- a checkpoint committed or not, as a crash
    lands -- and resumed after each kill by the same command plus ``resume_args``; compare the two
    runs as :func:`audit_command` does (spec/replay.md R-P19). :func:`ckptkit.testing.assert_command_resumes`
    is its test-suite face.

    Raises:
        AuditError: no command or no ``{run_dir}`` in it; run a saved no checkpoint; a kill step
            outside ``1..`` run a's end ``- 1``; a process failed, timed out, or ended before its
            history reached its kill step.
    """
    _check_timeout(timeout)
    runner = _Runner(command, AuditError, timeout, log or (lambda _m: None))
    _substitute(command, "", AuditError)
    with _workdir(keep_dir, "ckptkit-crashes-") as base:
        a, b = os.path.join(base, "a"), os.path.join(base, "b")
        runner.run(a, "a (uninterrupted)")
        end = RunRecording(a).last_step
        if end is None:
            raise AuditError(f"a: the command saved no checkpoint in {PLACEHOLDER} ({a}): {_HINT}")
        order = sorted(set(kills))
        if not order or order[0] < 1 or order[-1] >= end:
            raise AuditError(f"kill steps {order} must lie in 1..{end - 1}: run a ended at step {end}")
        notes: list[str] = []
        try:
            for i, k in enumerate(order):
                notes.append(_crash(runner, b, k, resume_args if i else ()))
            runner.run(b, "b (resumed to its end)", extra=resume_args)
        except _Diverged as e:
            report = _stopped_report("audit", command, e, None, (a, b) if keep_dir is not None else None)
        else:
            report = compare_runs("audit", command, a, b, resume_at=None, kept=keep_dir is not None)
        return dataclasses.replace(report, stopped=CRASHED, kills=tuple(order), notes=(*notes, *report.notes))


def _crash(runner: _Runner, b: str, k: int, extra: Sequence[str]) -> str:
    """One process of run b, SIGKILLed at step ``k``; what the report says of it."""
    watch = _StepWatch(b, k)
    runner.run(b, f"b (killed at step {k})", extra=extra, watch=watch)
    if not watch.killed:
        raise AuditError(f"b: the command ended before its history reached step {k}, where it was to be killed")
    committed = [s for s in run_checkpoints(b) if s <= k]
    resumed = f"checkpoint {max(committed)}" if committed else "step 0 (no checkpoint committed yet)"
    return f"b: SIGKILLed once its history reached step {k}; the next process resumes from {resumed}"


# ----------------------------------------------------------------------------- replay


def replay_start(run_dir: str, from_step: int) -> tuple[int, str]:
    """RUN's checkpoint a replay from ``from_step`` starts at: the newest at or before it.

    Raises:
        CheckpointNotFound: none.
    """
    ckpts = run_checkpoints(run_dir)
    before = [s for s in ckpts if s <= from_step]
    if not before:
        have = ", ".join(map(str, sorted(ckpts))) or "none"
        raise CheckpointNotFound(f"{run_dir}: no checkpoint at or before step {from_step} (checkpoints: {have})")
    return max(before), ckpts[max(before)]


def copy_checkpoint(run_dir: str, ckpt: str, work: str) -> None:
    """A checkpoint of RUN (file or directory) and its companions, into ``work``."""
    name = os.path.basename(ckpt)
    for f in sorted(os.listdir(run_dir)):
        if f == name or f.startswith(name + "."):
            src, dst = os.path.join(run_dir, f), os.path.join(work, f)
            shutil.copytree(src, dst) if os.path.isdir(src) else shutil.copy2(src, dst)


def _copy_start(run_dir: str, ckpt: str, work: str) -> None:
    """The checkpoint (and its companions), the environment record and the history."""
    os.makedirs(work, exist_ok=True)
    copy_checkpoint(run_dir, ckpt, work)
    for f in (ENVIRONMENT_FILE, HISTORY_FILE):
        if os.path.isfile(os.path.join(run_dir, f)):
            shutil.copy2(os.path.join(run_dir, f), os.path.join(work, f))


def _start_difference(rec: RunRecording, start: int, notes: list[str]) -> Difference | None:
    """R-P06: the starting checkpoint against the digests recorded when it was written (a
    recording that keeps ``checkpoint`` rows), before anything is re-run from it."""
    path, bad, recorded, digests = _recorded_mismatch(rec, start)
    if rec.checkpoint_digests and start not in rec.checkpoint_digests:
        notes.append(
            f"the recording holds no digests for {os.path.basename(path)} (an older ckptkit wrote it): "
            "the starting checkpoint is trusted as it is"
        )
    if not bad:
        return None
    return Difference(
        "checkpoint",
        start,
        file=path,
        tensors=tuple(named_reports(bad, recorded, digests, "values unavailable")),
        values="the recording keeps digests, not values; replay from an earlier checkpoint "
        "(--from a smaller step) re-derives the recorded values and measures the difference",
        hints=(_ALTERED,),
    )


def _replay_dir(run_dir: str, keep_dir: str | None) -> str | None:
    """``--out`` made absolute: empty (or new) and outside RUN.

    Raises:
        ReplayError: naming the option.
    """
    if keep_dir is None:
        return None
    out, run = os.path.abspath(keep_dir), os.path.abspath(run_dir)
    if os.path.commonpath([out, run]) == run:
        raise ReplayError(f"--out {out} is inside the run directory; replay never writes into RUN")
    if os.path.isdir(out) and os.listdir(out):
        raise ReplayError(f"--out {out} is not empty")
    return out


@dataclass(frozen=True, kw_only=True)
class ReplayPlan:
    """What :func:`replay_command` re-runs: RUN from its checkpoint at (or before) ``from_step``
    with the command, up to ``to_step``, and the hooks.

    Attributes:
        run_dir: the recorded run (RUN); only read.
        from_step: the replay starts at RUN's newest checkpoint at or before it (``--from``).
        command: the command, with ``{run_dir}`` in its arguments.
        to_step: where the command stops (its own arguments say so; ``--to``); None: RUN's end.
        prepare: adjusts the copy before the command runs (the trainer binds its
            overrides' config snapshot to it and adds its rollback ring's base).
        accept: exit codes besides 0 that end the command as its recording may have
            ended (the trainer's "training is unstable"): the rows are compared all the same.
        explain: says more about a difference (:data:`Explain`).
        overrides, notes: what the caller changed on purpose, and what it has to say: reported.
        on_step: progress: (steps done, ``to_step``).
        timeout: seconds the replaying process may take (``--timeout``), > 0.
        keep_dir: the replay's run directory (``--out``: empty or new, outside RUN); None: a
            temporary one.
        log: progress lines.

    Raises:
        ValueError: ``timeout`` is not > 0.
        ReplayError: no command, or no ``{run_dir}`` in it.
    """

    run_dir: str
    from_step: int
    command: Sequence[str]
    to_step: int | None = None
    prepare: Callable[[str], None] | None = None
    accept: Sequence[int] = ()
    explain: Explain | None = None
    overrides: Sequence[FieldDiff] = ()
    notes: Sequence[str] = ()
    on_step: OnStep | None = None
    timeout: float = DEFAULT_TIMEOUT
    keep_dir: str | None = None
    log: Log | None = None

    def __post_init__(self) -> None:
        _check_timeout(self.timeout)
        _substitute(self.command, "", ReplayError)


def replay_command(plan: ReplayPlan) -> AuditReport:
    """Re-run a run from its checkpoint at (or before) ``plan.from_step`` with the command; compare.

    RUN is only read: the checkpoint, its companions, ``environment.json`` and
    ``history.jsonl`` are copied into a fresh directory (``keep_dir``, else a temporary
    one) the command resumes from; its rows and checkpoints from there on are compared
    with RUN's (up to ``to_step``, where the command stops: its own arguments say so).
    A starting checkpoint that is not what RUN recorded writing is the difference, and
    nothing is run (R-P06).

    Raises:
        CheckpointNotFound: no checkpoint at or before ``from_step``.
        ReplayError: ``to_step`` outside the recording, ``keep_dir`` inside RUN or not empty.
        AuditError: the command failed or timed out.
        FormatError: a checkpoint the comparison reads does not verify.
    """
    start, _ckpt = replay_start(plan.run_dir, plan.from_step)
    rec = RunRecording(plan.run_dir)
    said = list(plan.notes)
    out = _replay_dir(plan.run_dir, plan.keep_dir)
    altered = _start_difference(rec, start, said)
    if altered is None:
        report = _replayed(plan, rec, start, out, said)
    else:
        report = AuditReport(
            what="replay",
            command=tuple(plan.command),
            steps=start,
            resume_at=start,
            rows_compared=0,
            checkpoints_compared=0,
            divergence=altered,
        )
    return dataclasses.replace(report, overrides=tuple(plan.overrides), notes=tuple(said))


def _replayed(plan: ReplayPlan, rec: RunRecording, start: int, out: str | None, said: list[str]) -> AuditReport:
    """The command run on a copy of RUN's checkpoint at ``start`` (into ``out``), and compared;
    what it said as it stopped, into ``said``."""
    to_step = plan.to_step
    if to_step is not None and not start <= to_step <= max(rec.last, start):
        raise ReplayError(
            f"--to {to_step} is outside the replayable range: the checkpoint is at step {start} and the "
            f"recording ends at step {rec.last}"
        )
    to = to_step if to_step is not None else rec.last
    log = plan.log or (lambda _m: None)
    runner = _Runner(plan.command, ReplayError, plan.timeout, log, plan.on_step, to, accept=plan.accept)
    with _workdir(out, "ckptkit-replay-") as base:
        work = base if out is not None else os.path.join(base, "replay")
        _copy_start(plan.run_dir, rec.checkpoints[start], work)
        if plan.prepare is not None:
            plan.prepare(work)
        kept = out is not None
        runner.since = time.time()
        try:
            if runner.run(work, f"replay from step {start}") in plan.accept:
                said.append(f"the replay stopped: {runner.stopped}")
        except _Diverged as e:  # the replay found itself not the recorded run, and stopped
            return _stopped_report("replay", plan.command, e, start, (plan.run_dir, work) if kept else None)
        runner.progress(work)
        _log_resume_notes(work, runner.since, runner.log)
        return compare_runs(
            "replay",
            plan.command,
            plan.run_dir,
            work,
            resume_at=start,
            to_step=to_step,
            kept=kept,
            explain=plan.explain,
        )


def _log_resume_notes(work: str, since: float, log: Log) -> None:
    """What the replay said as it resumed (its ``resume`` row's notes: a rebuilt rollback ring, ...)."""
    for r in read_rows(os.path.join(work, HISTORY_FILE))[0]:
        if r["kind"] == "resume" and r.get("time", 0.0) >= since:
            for note in r.get("notes") or ():
                log(f"replay resumed at step {r['step']}: {note}")
