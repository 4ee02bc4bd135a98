"""Every resume proves itself: the steps a crash lost are re-run, and compared (spec/determinism.md R-D20..R-D27).

A process killed after its checkpoint at step S went on to record steps S, S+1, ... in
``history.jsonl``. The resume at S re-runs exactly those steps, so instead of deleting the
interrupted process's rows, the history sets them aside (:data:`INTERRUPTED_FILE`, beside it)
and an :class:`Overlap` compares each compared row the resumed process writes (``step``,
``digests``, ``spike``, ``rollback``; wall-clock fields left out) with the interrupted
process's, in order, by the one search the audit uses (:func:`first_row_difference`). When the
overlap ends it writes one ``resume_check`` row: ``verified`` over steps a..b, ``differed``
(and, under the ``error`` setting, the run stops: :class:`~ckptkit.errors.ReplayDivergence`),
or why there was nothing to compare.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ReplayDivergence, UnsupportedOption
from ._difference import Difference, first_row_difference

__all__ = [
    "CHECK_ENV",
    "CHECK_KIND",
    "CHECK_MODES",
    "INTERRUPTED_FILE",
    "Overlap",
    "ResumeCheck",
    "check_mode",
    "is_verdict",
    "replay_command",
    "verdict_line",
]

#: The rows an interrupted process wrote after the checkpoint a resume continues from, kept
#: (R-D21): each resume appends an ``interrupted`` header row, then those rows as they were.
INTERRUPTED_FILE = "history.interrupted.jsonl"
#: The history row that gives a resume's verdict (R-D23).
CHECK_KIND = "resume_check"
#: What a difference does (R-D24): stop the run (the default), say it and go on, or compare nothing.
CHECK_MODES = ("error", "warn", "off")
#: The environment variable a replay sets so that the command it re-runs does not judge itself.
CHECK_ENV = "CKPTKIT_RESUME_CHECK"
_COMPARED = frozenset({"step", "digests", "spike", "rollback"})  # a resume re-lives these, in order
_WALL = frozenset({"time", "step_ms"})


def check_mode(value: str | None) -> str:
    """The setting: ``value``, else ``$CKPTKIT_RESUME_CHECK``, else ``"error"``.

    Raises:
        UnsupportedOption: a value other than ``error``, ``warn`` or ``off``.
    """
    mode = value if value is not None else os.environ.get(CHECK_ENV) or "error"
    if mode not in CHECK_MODES:
        source = "resume_check" if value is not None else CHECK_ENV
        raise UnsupportedOption(f"{source}={mode!r}: the resume check is one of error, warn, off (R-D24)")
    return mode


@dataclass(frozen=True)
class ResumeCheck:
    """How a resume judges itself (:meth:`ckptkit.RunState.resume` builds it).

    Attributes:
        mode: ``error``, ``warn`` or ``off`` (R-D24).
        run: the run directory (or ``s3://`` prefix), as messages name it.
        replay: the command that investigates a difference, with ``{step}`` for its step.
        not_comparable: why the two processes cannot be compared (the resume accepted another
            environment), or None.
        say: where the verdict line goes (the run's log, else stderr).
    """

    mode: str
    run: str
    replay: str
    not_comparable: str | None = None
    say: Callable[[str], None] | None = None

    def line(self, text: str) -> None:
        if self.say is not None:
            self.say(text)
        else:
            print(text, file=sys.stderr, flush=True)


def _compared(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in _WALL}


class Overlap:
    """The interrupted process's rows after the resumed checkpoint, and the resumed process's
    rows compared with them as they are written (:meth:`see`); the verdict row at the end."""

    def __init__(self, step: int, aside: Sequence[Mapping[str, Any]], torn: bool, check: ResumeCheck) -> None:
        self.step, self.check = step, check
        self.expected = [_compared(r) for r in aside if r["kind"] in _COMPARED]
        self.seen: list[dict[str, Any]] = []
        self.differs_at: int | None = None
        self.done = False
        self._verdict: dict[str, Any] | None = self._at_start(torn)

    def _at_start(self, torn: bool) -> dict[str, Any] | None:
        """The verdict when there is nothing to compare, decided at the resume (R-D23)."""
        first = self.expected[0] if self.expected else None
        if self.check.mode == "off":
            return self._row("not checked", self.step, reason="the resume check is off")
        if self.check.not_comparable is not None:
            return self._row("not comparable", self.step, reason=self.check.not_comparable)
        if first is None:
            why = "a torn last line only" if torn else "no rows after the checkpoint"
            return self._row("not verifiable", self.step, reason=why)
        if (first["kind"], first["step"]) != ("step", self.step):
            why = "the rows after the checkpoint are of another timeline"
            return self._row("not verifiable", self.step, reason=why)
        return None

    def _row(self, verdict: str, step: int, **fields: Any) -> dict[str, Any]:
        return {"kind": CHECK_KIND, "step": step, "resumed_at": self.step, "verdict": verdict, **fields}

    def see(self, row: Mapping[str, Any], write: Callable[[dict[str, Any]], None]) -> None:
        """Compare the row just written with its counterpart; write the verdict row when the
        overlap is decided. A decided verdict that is known at the resume goes in after the
        first row written (the ``resume`` row).

        Raises:
            ReplayDivergence: the rows differ and the setting is ``error`` (both processes' rows
                are on disk: the interrupted one's in :data:`INTERRUPTED_FILE`).
        """
        if self.done:
            return
        if self._verdict is not None:
            self._finish(write, self._verdict)
            return
        if row["kind"] not in _COMPARED:
            return
        i = len(self.seen)
        self.seen.append(_compared(row))
        if self.differs_at is None:
            if first_row_difference(self.expected[i : i + 1], self.seen[i:]) is not None:
                self.differs_at = i
                nxt = self.expected[i + 1] if i + 1 < len(self.expected) else None
                if row["kind"] == "step" and nxt is not None and nxt["kind"] == "digests":
                    return  # the digests row after it names the tensors
            elif len(self.seen) == len(self.expected):
                self._finish(write, self._verified())
                return
            else:
                return
        self._differed(write)

    def end(self, write: Callable[[dict[str, Any]], None]) -> None:
        """The resumed process stops writing (its history closes): a difference waiting for its
        digests row is decided; a run that stopped inside the overlap is verified as far as it went."""
        if self.done:
            return
        if self._verdict is not None:
            self._finish(write, self._verdict)
        elif self.differs_at is not None:
            self._differed(write, raise_=False)
        elif self.seen:
            self._finish(write, self._verified(partial=True))

    def _verified(self, *, partial: bool = False) -> dict[str, Any]:
        steps = [r["step"] for r in self.seen if r["kind"] == "step"]
        tensors = max((len(r.get("tensors") or {}) for r in self.seen if r["kind"] == "digests"), default=0)
        last = max(steps, default=self.step)
        fields: dict[str, Any] = {"from": self.step, "to": last, "steps": len(set(steps)), "tensors": tensors}
        if partial:
            fields["reason"] = f"the resumed run stopped at step {last + 1}, inside the overlap"
        return self._row("verified", last + 1, **fields)

    def _differed(self, write: Callable[[dict[str, Any]], None], *, raise_: bool = True) -> None:
        n = len(self.seen)
        d = first_row_difference(self.expected[:n], self.seen)
        assert d is not None, "a row differed"
        message = difference_message(d, self.check, self.step)
        at = _step_index(d)
        self._finish(write, self._row("differed", at, at=at, what=_what(d), message=message))
        if self.check.mode == "error" and raise_:
            raise ReplayDivergence(message)

    def _finish(self, write: Callable[[dict[str, Any]], None], row: dict[str, Any]) -> None:
        self.done = True
        write(row)
        # said: a proof, or a difference the run goes on after (under error the exception says it); the
        # verdicts without a comparison are in the row, the summary and verify, not on every clean resume
        if row["verdict"] == "verified" or (row["verdict"] == "differed" and self.check.mode == "warn"):
            self.check.line(verdict_line(row))


def _step_index(d: Difference) -> int:
    """The step (0-based) whose row differs: a ``digests`` row counts the steps done after it."""
    return d.step - 1 if d.kind == "digests" else d.step


def _what(d: Difference) -> str:
    """What differs first: ``data``, a field, or the first tensor."""
    if d.fields and d.fields[0].field == "data":
        return "data"
    if d.tensors:
        return f"tensor {d.tensors[0].name}"
    return f"field {d.fields[0].field}" if d.fields else f"the {d.kind} row"


def _cause(d: Difference) -> str:
    if _what(d) == "data":
        return (
            "the step consumed other data than the interrupted run (the data position or the shuffle order "
            "was not restored)"
        )
    if d.kind == "digests":
        return "the state after the step differs while its scalars agree (state not restored, or a global RNG draw)"
    return (
        "a draw from the global RNG or OS entropy, a nondeterministic kernel, or another intra-op thread count "
        "inside the step"
    )


def difference_message(d: Difference, check: ResumeCheck, resumed_at: int) -> str:
    """The one message of a resume that differs (R-D25); its replay starts at the resumed checkpoint."""
    step = _step_index(d)
    first = d.fields[0] if d.fields else None
    shown = first is not None and (not d.tensors or first.field == "data")
    detail = f" (recorded {first.recorded!r}, re-run {first.replayed!r})" if first is not None and shown else ""
    return (
        f"{check.run}: the resumed run differs from the interrupted run at step {step}: {_what(d)}{detail}; "
        f"likely cause: {_cause(d)}; both processes' rows are kept (history.jsonl, {INTERRUPTED_FILE}); "
        f"investigate with: {check.replay.format(step=resumed_at)} (R-D25)"
    )


def is_verdict(line: str) -> bool:
    """A resume's verdict line (printed even under ``--quiet``: it is the proof, R-D23)."""
    return line.startswith(("resume verified:", "resume at step "))


def verdict_line(row: Mapping[str, Any]) -> str:
    """A ``resume_check`` row as the one line a person reads (stderr, the summary, ``verify``)."""
    verdict, at = row.get("verdict"), row.get("resumed_at")
    if verdict == "verified":
        tensors = row.get("tensors") or 0
        each = f"{tensors} tensors each" if tensors else "no digests recorded"
        tail = f"; {row['reason']}" if row.get("reason") else ""
        return (
            f"resume verified: steps {row.get('from')}..{row.get('to')} reproduce the interrupted run bit for bit "
            f"({row.get('steps')} step{'' if row.get('steps') == 1 else 's'}, {each}){tail}"
        )
    if verdict == "differed":
        return f"resume at step {at} DIFFERED from the interrupted run at step {row.get('at')}: {row.get('what')}"
    return f"resume at step {at} {verdict}: {row.get('reason')}"


def replay_command(run: str, argv: Sequence[str] | None = None) -> str:
    """The command that investigates a difference of this process's resume (``{step}`` left to
    fill): ``ckptkit replay RUN --from S`` for ``ckptkit train``, else the replay of this process's
    own command line (``-- CMD``, the run directory given as ``{run_dir}``)."""
    args = list(sys.argv if argv is None else argv)
    first = os.path.basename(args[0]) if args else ""
    quoted = shlex.quote(run).replace("{", "{{").replace("}", "}}")
    if first in ("ckptkit", "__main__.py") and args[1:2] == ["train"]:
        return f"ckptkit replay {quoted} --from {{step}}"
    cmd = [sys.executable, *args] if first != "ckptkit" else args
    shown = " ".join("{run_dir}" if a == run else shlex.quote(a) for a in cmd)
    return f"ckptkit replay {quoted} --from {{step}} -- " + shown.replace("{", "{{").replace("}", "}}")
