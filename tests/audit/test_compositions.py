"""The guard, the recording, a stop or a kill, and the audit compose (spec/replay.md "Any loop").

One property over the compositions a user builds from docs/adopting.md: SpikeGuard mode x
spike step x recording on/off x stopped or SIGKILLed at a step x a planted nondeterminism
(or none). Run ``a`` trains uninterrupted; run ``b`` is interrupted and resumed by the same
command, each process fresh; the runs are compared by the audit's own engine
(:func:`ckptkit.audit._recording.first_difference`), and run ``a`` is replayed from its
checkpoint by ``ckptkit replay``'s (:func:`ckptkit.audit._commands.replay_command`).

Invariants: the audit finds a difference exactly when the plant breaks "a function of
(seed, step)" for the resumed process (OS entropy always; the global generator when it
was drawn before the resume point), and then names the state after the planted step
(or the resume point) and the tensor; replay agrees; ``ckptkit verify`` is clean on every
run; ``ckptkit plot`` draws a recorded run with the rollbacks its history holds.

A resumed process under another intra-op thread count (``threads``) may or may not change a
tiny model's bits -- that is torch's business, not predictable -- so its invariant is the honest
one: a difference is named at the resume (or in the ring rebuild just before it), or the runs
compare identical *and* the report lists ``intra_op_threads`` with both values from the resume
step on (spec/replay.md R-P13); without that plant the report lists no environment difference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import examples
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from ckptkit.audit._commands import AuditReport, EnvironmentDifference, ReplayPlan, compare_runs, replay_command
from ckptkit.audit._plot import plot_run
from ckptkit.audit._recording import RunRecording, first_difference, rebuild_difference
from ckptkit.cli import main
from ckptkit.run._difference import Difference
from ckptkit.run._preemption import EXIT_STOPPED, STOP_AT_ENV

pytestmark = pytest.mark.slow

LOOP = Path(__file__).resolve().parents[1] / "_composition_loop.py"
STEPS, EVERY = 30, 10  # the loop's checkpoints: every 10 steps (spike_guard.Config.ckpt_every)


@dataclass(frozen=True)
class Case:
    mode: str
    spike_at: int | None
    record: bool
    kill: bool  # SIGKILL as step `at` begins; else a stop request (CKPTKIT_STOP_AT) after step at - 1
    at: int
    plant: str | None
    plant_from: int

    def argv(self, run_dir: Path) -> list[str]:
        out = [sys.executable, str(LOOP), "--run-dir", str(run_dir), "--steps", str(STEPS), "--mode", self.mode]
        if self.spike_at is not None:
            out += ["--spike-at", str(self.spike_at)]
        if not self.record:
            out.append("--no-record")
        if self.plant is not None:
            out += ["--plant", self.plant, "--plant-from", str(self.plant_from)]
        return out

    def resumed_at(self) -> int:
        """The step run b's second process starts from: the stop's checkpoint, or the last one before the kill."""
        return self.at if not self.kill else EVERY * (self.at // EVERY)

    def differs(self, resumed_at: int) -> bool | None:
        """Whether a run resumed at ``resumed_at`` in a fresh process differs from one that was not
        (None: it may or may not -- a global stream first drawn after the resume point)."""
        if self.plant == "global" and self.plant_from >= resumed_at:
            return None  # whether it lines up again depends on every other draw from the stream
        if self.plant == "threads":
            return None  # whether a reduction splits differently is torch's business
        return self.plant is not None

    def first_bad(self, resumed_at: int) -> int:
        """The first step whose update the resumed run could not reproduce (when it differs)."""
        if self.plant == "global" and self.plant_from < resumed_at:
            return resumed_at  # drawn before: the resumed process's stream starts over there
        return self.plant_from


def _train(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def _interrupted_then_resumed(case: Case, run_dir: Path) -> Difference | None:
    """Run b: interrupted at ``case.at``, then resumed by the same command. Returns the
    difference its history's last row records when its ring rebuild missed, else None."""
    env = {k: v for k, v in os.environ.items() if k != STOP_AT_ENV}
    if case.kill:
        first = _train([*case.argv(run_dir), "--die-at", str(case.at)], env)
        assert first.returncode == -9, first.stderr
    else:
        first = _train(case.argv(run_dir), {**env, STOP_AT_ENV: str(case.at)})
        assert first.returncode == EXIT_STOPPED, first.stderr
    # The ring rebuild's own check is what this test reads; the resume's check of the steps it re-runs
    # (spec/determinism.md R-D20) would stop a planted resume first: tests/run/test_resume_check.py.
    second = _train(case.argv(run_dir), {**env, "CKPTKIT_RESUME_CHECK": "off"})
    if second.returncode != 0:
        assert "ReplayDivergence: " in second.stderr, second.stderr  # the only way a resume may fail here
        last = [r for r in RunRecording(run_dir).all_rows if r["kind"] != "resume_check"][-1]
        assert last["kind"] == "rebuild", last  # the divergence, where audit and replay read it
        return rebuild_difference(last)
    return None


def _at_or_after(d: Difference, resumed_at: int) -> bool:
    """A difference the resumed process made: after the resume, or in the ring rebuild it ran
    first (steps before the resume, re-run from a checkpoint under its thread count)."""
    return d.step <= resumed_at if d.kind == "rebuild" else d.step >= resumed_at


def _check_environment(case: Case, report: AuditReport) -> None:
    """The report lists an environment difference exactly when a resume accepted one: the fact,
    both runs' values and the step from which (the threads plant adds one thread)."""
    got = report.environment_differences
    if case.plant != "threads":
        assert got == (), (case, got)
        return
    threads = report.environment["intra_op_threads"]
    assert got == (EnvironmentDifference("intra_op_threads", threads, threads + 1, case.resumed_at()),), (case, got)
    line = f"  intra_op_threads: a {threads}, b {threads + 1} from step {case.resumed_at()} (a resume accepted"
    assert line in report.describe(), report.describe()


def _check_named(case: Case, d: Difference, resumed_at: int) -> None:
    """The difference names the state after the first step whose update the resume could not reproduce."""
    first_bad = case.first_bad(resumed_at)
    if case.record:  # the digests row after that step is the first row that differs, by tensor
        assert (d.kind, d.step) == ("digests", first_bad + 1), d
        assert d.tensor_names == ("model:net.0.weight",), d
    elif d.kind == "spike":  # no step rows, but the guard's row of a spike after it: its grad norm differs
        assert d.step > first_bad and "grad_norm" in d.field_names, d
    else:  # no rows to name it: the first checkpoint both runs saved after it
        assert d.kind == "checkpoint" and d.step > first_bad and "model:net.0.weight" in d.tensor_names, d


def _check_rebuild_named(case: Case, d: Difference, rebuilt_from: int, resumed_at: int) -> None:
    """A ring rebuild that missed names the first state it re-ran to that the run did not record
    (its recorded digests; without them, the resumed checkpoint's), and the tensor. It re-ran from
    the ring's base: at or before resumed_at - K, earlier after a rollback (R-R12)."""
    assert d.kind == "rebuild" and "model:net.0.weight" in d.tensor_names, d
    assert 0 <= rebuilt_from <= resumed_at - 10, (case, rebuilt_from)
    first = max(case.plant_from + 1, rebuilt_from) if case.plant == "entropy" else rebuilt_from
    assert (first <= d.step <= resumed_at) if case.record else d.step == resumed_at, (case, d)


# Each example trains four short runs in fresh processes: a few under the ci profile, more under
# thorough; a failure is reported as found (shrinking one costs minutes of training).
@settings(max_examples=examples(0.04), phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    mode=st.sampled_from(["off", "warn", "on"]),
    spike_at=st.one_of(st.none(), st.integers(12, 24)),
    record=st.booleans(),
    kill=st.booleans(),
    at=st.integers(11, STEPS - 2),
    plant=st.sampled_from([None, "entropy", "global", "threads"]),
    plant_from=st.integers(0, STEPS - 1),
)
# After the rollback at 14 the resumed ring is rebuilt from step 10, not resumed_at - K = 15.
@example(mode="on", spike_at=14, record=True, kill=False, at=25, plant="entropy", plant_from=5)
def test_the_audit_finds_a_planted_nondeterminism_and_only_that(
    mode: str, spike_at: int | None, record: bool, kill: bool, at: int, plant: str | None, plant_from: int
) -> None:
    case = Case(mode, spike_at, record, kill, at, plant, plant_from)
    with tempfile.TemporaryDirectory(prefix="ckptkit-compose-") as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        done = _train(case.argv(a))
        assert done.returncode == 0, done.stderr
        missed = _interrupted_then_resumed(case, b)
        d = missed or first_difference(RunRecording(a), RunRecording(b))
        expected = case.differs(case.resumed_at())
        assert expected is None or (d is not None) == expected, (case, d)
        if case.plant == "threads":
            assert d is None or _at_or_after(d, case.resumed_at()), (case, d)
        elif missed is not None:
            _check_rebuild_named(
                case,
                missed,
                next(r for r in reversed(RunRecording(b).all_rows) if r["kind"] == "rebuild")["from"],
                case.resumed_at(),
            )
        elif d is not None:
            _check_named(case, d, case.resumed_at())
        _check_environment(case, compare_runs("audit", [], str(a), str(b), resume_at=case.resumed_at()))
        assert main(["verify", str(a), "--quiet"]) == 0 and main(["verify", str(b), "--quiet"]) == 0
        _replay_agrees(case, a)
        _plot_draws_the_history(case, a, Path(tmp) / "a.png")


def _replay_agrees(case: Case, run_dir: Path) -> None:
    """Replaying run a from its checkpoint at or before ``at`` differs exactly as a resume there would."""
    start = EVERY * (case.at // EVERY)
    argv = [a if a != str(run_dir) else "{run_dir}" for a in case.argv(run_dir)]
    plan = ReplayPlan(run_dir=str(run_dir), from_step=start, command=argv, timeout=300)
    report = replay_command(plan)  # a ring rebuild that missed is a difference
    differs = not report.ok
    expected = case.differs(start)
    assert expected is None or differs == expected, (case, differs)
    if case.plant == "threads":  # the replay resumes under another thread count: named, or listed
        if report.divergence is not None:
            assert _at_or_after(report.divergence, start), (case, report.divergence)
        else:
            threads = report.environment["intra_op_threads"]
            want = EnvironmentDifference("intra_op_threads", threads, threads + 1, start)
            assert report.environment_differences == (want,), (case, report.environment_differences)


def _plot_draws_the_history(case: Case, run_dir: Path, png: Path) -> None:
    """The plot of run a counts what its history holds: a spike and its re-run are one spike."""
    if not case.record:  # nothing records a loss: the plot refuses, saying so
        with pytest.raises(ValueError, match="no step row records a loss"):
            plot_run(run_dir, png)
        return
    summary = plot_run(run_dir, png)
    spiked = case.spike_at is not None and case.mode != "off"
    assert (summary.spikes, summary.rollbacks, summary.resumes) == (int(spiked), int(spiked and case.mode == "on"), 0)
    assert png.stat().st_size > 0
