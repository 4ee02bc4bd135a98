"""Stopping a run cleanly: preemption signals and requested stops (spec/runstate.md "Stopping").

SLURM and Kubernetes preempt a job with SIGTERM (a person with Ctrl-C, SIGINT).
With :meth:`RunState.preemptible` on, the first signal only *requests* a stop:
the loop finishes the step it is in, and :meth:`RunState.step_done` then saves
that step and ends the process with :data:`EXIT_STOPPED` and a line saying how
to resume. A second signal aborts at once (exit ``128 + signal``): every write is
atomic, so the checkpoints on disk stay intact and the next resume removes the
temporary file of a save it interrupted.

``ckptkit audit`` asks for a stop the same way, without a signal: the
environment variable :data:`STOP_AT_ENV` names the step count at which
``step_done`` saves and stops.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

from ..errors import EXIT_STOPPED, CheckpointError, RunStopped

__all__ = ["EXIT_STOPPED", "STOP_AT_ENV", "RunStopped", "StopRequests", "Stopping"]

STOP_AT_ENV = "CKPTKIT_STOP_AT"  # save and stop once this many steps are done (ckptkit audit)
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Where a stop request is noticed: a signal caught by :meth:`install`, or :data:`STOP_AT_ENV`."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    @contextlib.contextmanager
    def installed(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> Iterator[None]:
        """Catch ``signals`` while the block runs; the previous handlers come back after it.

        Raises:
            CheckpointError: not in the main thread (Python delivers signals only there).
        """
        try:
            for s in signals:
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError as e:
            self._restore()
            raise CheckpointError(f"preemptible(): {e}; call it from the main thread of the training process") from None
        try:
            yield
        finally:
            self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            sys.stderr.write(
                f"ckptkit: second {name}: aborting now; the checkpoints on disk are intact "
                "(the next resume removes the temporary file of an interrupted save)\n"
            )
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signal = signum
        sys.stderr.write(_on_a_fresh_line(f"ckptkit: {name}: finishing the current step, then saving it", name))
        sys.stderr.flush()

    def reason(self, steps_done: int) -> str | None:
        """Why the run must stop after ``steps_done`` steps, or None.

        Raises:
            CheckpointError: :data:`STOP_AT_ENV` is set but is not a step count.
        """
        if self.signal is not None:
            return signal.Signals(self.signal).name
        raw = os.environ.get(STOP_AT_ENV)
        if raw is None:
            return None
        if not raw.isdigit():
            raise CheckpointError(f"{STOP_AT_ENV}={raw!r}: must be a step count (digits only), e.g. {STOP_AT_ENV}=20")
        return f"{STOP_AT_ENV}={raw}" if int(raw) == steps_done else None


class Stopping:
    """The stopping half of :class:`~ckptkit.RunState`: preemption opted into, requested stops,
    and the save-print-exit of :meth:`step_done`."""

    _stops: StopRequests
    _resume_hint: str | None
    save: Callable[[int], str]  # RunState's
    close: Callable[[], None]  # RunState's

    def preemptible(
        self, signals: Iterable[int] = DEFAULT_SIGNALS, *, resume_hint: str | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Opt in to preemption while the returned context is open: the first SIGTERM or
        SIGINT requests a stop (the loop finishes its step, :meth:`step_done` saves it and
        exits with ``EXIT_STOPPED``, 75); a second aborts at once, leaving every checkpoint
        on disk intact.

        Args:
            signals: the signals that request a stop.
            resume_hint: the command the stop line tells the user to run (default: this
                process's command line, which resumes by itself through :meth:`resume_or_start`).

        Example::

            with state.preemptible():
                for step in range(state.resume_or_start(), steps):
                    train_step(step)
                    state.step_done(step + 1)
        """
        self._resume_hint = resume_hint
        return self._stops.installed(signals)

    def stop_requested(self, steps_done: int) -> str | None:
        """What asks the run to stop after ``steps_done`` steps (a signal caught by
        :meth:`preemptible`, or ``CKPTKIT_STOP_AT``), or None. For a loop that saves
        its own way; :meth:`step_done` is this plus the save and the exit.

        Raises:
            CheckpointError: ``CKPTKIT_STOP_AT`` is not a step count.
        """
        return self._stops.reason(steps_done)

    def step_done(self, steps_done: int) -> None:
        """Call once after every step with the number of steps done: when a stop was
        requested, saves that step, prints how to resume and raises :class:`RunStopped`
        (a ``SystemExit`` with code 75: uncaught, the process ends there).

        Raises:
            RunStopped: a stop was requested; the checkpoint at ``steps_done`` is committed, the
                run closed (every row written, on ``s3://`` uploaded) and then its lease released.
            SaveFailed: the save failed (earlier checkpoints are intact).
        """
        why = self._stops.reason(steps_done)
        if why is None:
            return
        path = self.save(steps_done)
        self.close()  # the run ends here, whether or not the loop reaches close(): every row, then the lease (R-LS08)
        hint = self._resume_hint or shlex.join(
            [sys.executable, *sys.argv] if sys.argv and sys.argv[0].endswith(".py") else sys.argv
        )
        print(
            f"ckptkit: stopped at step {steps_done} ({why}): saved {path}; resume with: {hint}",
            file=sys.stderr,
            flush=True,
        )
        raise RunStopped(steps_done, path, why)


def _on_a_fresh_line(said: str, name: str) -> str:
    """The first signal's message. On a terminal it starts on a line of its own (the terminal
    has echoed ``^C`` after the progress bar) and its advice goes on a second line when one
    line would be wider than the terminal; in a log file it is one line."""
    advice = f"(send {name} again to abort at once)"
    if not sys.stderr.isatty():
        return f"{said} {advice}\n"
    columns = shutil.get_terminal_size((0, 0)).columns or len(said) + 1 + len(advice)  # 0: a size never set
    return f"\n{said}{' ' if len(said) + 1 + len(advice) <= columns else chr(10)}{advice}\n"
