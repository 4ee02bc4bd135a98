"""The lines ``ckptkit train`` ends with, read back from what the run wrote.

Every figure but the wall time comes from the run directory after the run:
``history.jsonl`` (read with :mod:`ckptkit.run._history`) and the checkpoint files
on disk. So the summary cannot name a checkpoint that retention deleted, or a
step whose row never reached the file. "This call" is everything after the
history's last ``start`` or ``resume`` row. Counts say steps done (``now at
step 200``); a spike or rollback is named by its step index, the steps done
before it, as the trainer's spike lines and the history rows name it.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..format._place import Place, place_for
from ..run._files import CKPT_SUFFIX, DCP_SUFFIX, is_fallback_note, step_of
from ..run._history import HISTORY_FILE, read_rows
from ..run._resume_check import CHECK_KIND, verdict_line
from ._width import fit, fit_command

__all__ = ["TrainSummary", "extend_command", "summarize"]

_TEXT_AT = 15  # the column a row's text starts at: "  " + a 12-wide name + " "


@dataclass(frozen=True)
class TrainSummary:
    """What one ``ckptkit train`` call did, as the run directory records it."""

    run_dir: str
    began: int  # steps done when the call began (0 for a fresh run)
    resumed: bool
    done: int  # steps done at the end
    steps_run: int  # step rows this call wrote, re-runs and re-trained steps included
    seconds: float  # the call's wall time (the only figure not from the run directory)
    final: dict[str, Any] | None  # the last step row of the history
    spikes: tuple[int, ...]  # index of each step of this call that spiked (re-runs not counted again)
    spikes_in_run: int  # spiking steps in the whole history (re-runs not counted again)
    rollbacks: tuple[dict[str, Any], ...]  # this call's rollback rows
    rollbacks_in_run: int
    checkpoints: tuple[int, ...]  # steps of the checkpoint files on disk
    keep: int  # --keep
    history: str  # the history file
    step_rows: int  # step rows in the whole history
    extend: str  # the command that extends (or resumes) the run
    next_step: str = "extend"  # how the last row names that command: "resume" after a stop
    passed_over: tuple[str, ...] = ()  # the resume's lines about damaged checkpoints it skipped
    verdicts: tuple[dict[str, Any], ...] = ()  # this call's resume_check rows (spec/determinism.md R-D23)

    def lines(self, width: int | None = None) -> list[str]:
        """The summary as a user reads it (README "What you see" explains each line).

        ``width``: the terminal's columns; a longer row continues on the next line under its
        text, and the command is broken between arguments with ``" \\"`` (``_width``).
        """
        rate = f", {self.steps_run / self.seconds:.1f} steps/s" if self.seconds > 0 and self.steps_run else ""
        span = f"resumed at step {self.began}, now at {self.done}" if self.resumed else f"0 -> {self.done}"
        rows = [("trained", f"{self.steps_run} step(s) ({span}) in {_duration(self.seconds)}{rate}")]
        rows += [("resume", note) for note in self.passed_over]
        rows += [("resume check", verdict_line(r).removeprefix("resume ")) for r in self.verdicts]
        if self.final is not None:
            f = self.final
            parts = [f"lm {_num(f.get('lm_loss'))}"]
            if f.get("aux_loss") is not None:
                parts.append(f"aux {_num(f['aux_loss'])}")
            rows.append(("final loss", f"{_num(f.get('loss'))} ({', '.join(parts)}) at step {f['step'] + 1}"))
        spikes = f"{len(self.spikes)}, at step {', '.join(map(str, self.spikes))}" if self.spikes else "none"
        if self.spikes_in_run != len(self.spikes):
            spikes += f" ({self.spikes_in_run} in the whole run)"
        rows.append(("spikes", spikes))
        rollbacks = "none"
        if self.rollbacks:
            rollbacks = f"{len(self.rollbacks)}: " + "; ".join(
                f"step {r['step']} back to {r['to']}, lr x{r.get('lr_scale')} from then on" for r in self.rollbacks
            )
        if self.rollbacks_in_run != len(self.rollbacks):
            rollbacks += f" ({self.rollbacks_in_run} in the whole run)"
        rows.append(("rollbacks", rollbacks))
        kept = ", ".join(map(str, self.checkpoints)) or "none"
        rows.append(
            (
                "checkpoints",
                (
                    f"{len(self.checkpoints)} kept in {self.run_dir}: step {kept} "
                    f"(--keep {self.keep}: the newest {self.keep} stay, older ones are deleted)"
                ),
            )
        )
        rows.append(
            (
                "history",
                (f"{self.history}: one row per step (loss, grad norm, lr, spike verdict), {self.step_rows} step rows"),
            )
        )
        out = ["summary:"]
        for name, text in rows:
            out += fit(f"  {name:<12} {text}", width, _TEXT_AT)
        return out + fit_command(f"  {self.next_step:<12} ", self.extend, width, _TEXT_AT + 2)


def _read_rows(place: Place) -> tuple[list[dict[str, Any]], bool]:
    """The history's rows, read in the place's stage (an ``s3://`` run's: its object, brought there)."""
    place.bring(HISTORY_FILE)
    return read_rows(os.path.join(place.stage, HISTORY_FILE))


def _steps(place: Place) -> list[int]:
    """The step of every committed checkpoint at the place, of either store (R-O35)."""
    from ..distributed._format import METADATA_NAME

    found = {
        step_of(n, suffix)
        for suffix, marker in ((CKPT_SUFFIX, None), (DCP_SUFFIX, METADATA_NAME))
        for n, committed in place.names(suffix, marker=marker).items()
        if committed
    }
    return sorted(s for s in found if s is not None)


def summarize(run_dir: str, *, seconds: float, keep: int, extend: str, next_step: str = "extend") -> TrainSummary:
    """Read ``run_dir`` after a ``train`` call and say what the call did.

    Args:
        run_dir: the run directory, as the user spelled it.
        seconds: the call's wall time.
        keep: the run's ``--keep``.
        extend: the command line that extends the run (:func:`extend_command`), or resumes it.
        next_step: the last row's name for that command (``resume`` after a stop).

    Raises:
        FormatError: a complete line of ``history.jsonl`` is not a history row.
    """
    place = place_for(run_dir)
    history = place.child(HISTORY_FILE)
    try:
        rows, _torn = _read_rows(place)
        checkpoints = tuple(_steps(place))
    finally:
        place.close()
    marks = [i for i, r in enumerate(rows) if r["kind"] in ("start", "resume")]
    first = marks[-1] if marks else 0
    mine = rows[first:]
    steps = [r for r in rows if r["kind"] == "step"]
    my_steps = [r for r in mine if r["kind"] == "step"]
    began = mine[0]["step"] if mine else 0
    final = steps[-1] if steps else None
    return TrainSummary(
        run_dir=run_dir,
        began=began,
        resumed=bool(mine) and mine[0]["kind"] == "resume",
        done=final["step"] + 1 if final is not None else began,
        steps_run=len(my_steps),
        seconds=seconds,
        final=final,
        spikes=tuple(r["step"] for r in my_steps if _spiked(r)),
        spikes_in_run=sum(1 for r in steps if _spiked(r)),
        rollbacks=tuple(r for r in mine if r["kind"] == "rollback"),
        rollbacks_in_run=sum(1 for r in rows if r["kind"] == "rollback"),
        checkpoints=checkpoints,
        keep=keep,
        history=history,
        step_rows=len(steps),
        extend=extend,
        next_step=next_step,
        passed_over=tuple(n for n in (mine[0].get("notes", []) if mine else []) if is_fallback_note(str(n))),
        verdicts=tuple(r for r in mine if r["kind"] == CHECK_KIND),
    )


def extend_command(run_dir: str, steps: int, flags: Sequence[str], launcher: Sequence[str] = ("ckptkit",)) -> str:
    """``ckptkit train --run-dir RUN --steps N --resume FLAGS``: the run's own flags, so no drift.

    ``launcher`` replaces ``ckptkit`` (``torchrun --nproc_per_node 2 -m ckptkit`` for a distributed run).
    """
    return shlex.join([*launcher, "train", "--run-dir", run_dir, "--steps", str(steps), "--resume", *flags])


def _spiked(row: dict[str, Any]) -> bool:
    return bool(row.get("spike")) and not row.get("rerun")


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)  # "NaN"/"Infinity" are stored as strings


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m} min {s} s" if hours else f"{m} min {s} s"
