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
import signal
import sys
from collections.abc import Iterable, Iterator
from types import FrameType

from ..errors import EXIT_STOPPED, CheckpointError, RunStopped

__all__ = ["EXIT_STOPPED", "STOP_AT_ENV", "RunStopped", "StopRequests"]

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
        sys.stderr.write(
            f"ckptkit: {name}: finishing the current step, then saving it (send {name} again to abort at once)\n"
        )
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
