"""The determinism audit of the reference trainer: the command audit run on ``python -m ckptkit train``.

    ckptkit audit                         # two runs of 10 steps, each in a fresh process
    ckptkit audit --resume-at 4           # uninterrupted vs stopped at 4 and resumed in a fresh process
    ckptkit audit --steps 20 --quant int8 --rand-depth --json
    ckptkit audit --nproc-per-node 2 --resume-at 4   # each run a 2-rank torchrun job (spec/trainer.md R-T14)

Implements ``spec/replay.md`` R-P11..R-P13 with the one audit engine of any loop
(:func:`ckptkit.audit.commands.audit_command`): each run is ``python -m ckptkit train``
in a fresh process, so whatever a process carries (thread pools, allocator, lazily
initialised kernels, global RNGs) starts over, and the two run directories are compared
as any two recorded runs are. What the trainer adds is the hook that explains a
divergent step (:func:`explain`): the tensors' values from both runs' checkpoints after
it (what ``ckptkit diff --tensors`` prints), the runs' strict config differences, and
the step re-run twice in this process.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import tempfile
from collections.abc import Callable
from typing import Any

from ..audit.commands import PLACEHOLDER, AuditReport, audit_command
from ..audit.commands import compare_runs as audit_compare
from ..audit.compare import compare_checkpoints
from ..audit.recording import tensor_reports
from ..errors import AuditError, CheckpointError
from ..format.snapshot import read_snapshot, snapshot_path
from ..run import checkpoint_name, list_checkpoints
from ..run.difference import Difference
from ..run.drift import DEFAULT_EXEMPT, diff_keys
from ..run.files import run_checkpoints
from .config import TrainerConfig, flag_name, knobs
from .parallel import launcher
from .replay import config_of, rerun_step

__all__ = ["AUDIT_DEFAULTS", "AuditError", "AuditReport", "audit", "compare_runs", "explain", "knob_flags"]

Log = Callable[[str], None]

#: Knobs the audit sets unless the user gives them: short, and a checkpoint after every
#: step (all kept), so a divergence anywhere has values on both sides.
AUDIT_DEFAULTS: dict[str, Any] = {"train.steps": 10, "train.ckpt_every": 1, "train.log_every": 1000}

# ----------------------------------------------------------------------------- running


def knob_flags(cfg: TrainerConfig) -> list[str]:
    """``ckptkit train`` flags that reproduce ``cfg`` (only keys that differ from the defaults).

    Raises:
        ValueError: a key is unset (None) where its default is not: no flag can say that.
    """
    defaults = TrainerConfig()
    out: list[str] = []
    for key, f in knobs():
        table, _, name = key.partition(".")
        value, default = getattr(getattr(cfg, table), name), getattr(getattr(defaults, table), name)
        if type(value) is type(default) and value == default:
            continue
        flag = flag_name(key, f)
        if value is None:
            raise ValueError(f"{flag}: an unset value has no command-line spelling")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, enum.Enum):
            out += [flag, str(value.value)]
        elif isinstance(value, float):
            out += [flag, repr(value)]
        else:
            out += [flag, str(value)]
    return out


def audit(
    cfg: TrainerConfig,
    work_dir: str | os.PathLike[str] | None = None,
    *,
    resume_at: int | None = None,
    nproc: int = 1,
    log: Log | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> AuditReport:
    """Train ``cfg`` twice, each in a fresh process, and compare the two runs bit for bit.

    Args:
        cfg: the config (its ``train.steps`` is the length of each run).
        work_dir: where runs ``a`` and ``b`` go (kept; empty or new); a temporary directory if None.
        resume_at: run ``b`` stops at this step and is resumed in another fresh process.
        nproc: ranks per run: above 1 each training process is a torchrun job of that many
            ranks (spec/trainer.md R-T14); the step is then not re-run in this process.
        log: progress notes.
        on_step: called with (steps trained by both runs so far, their total) while a
            training process runs, and once each ends (a progress bar).

    Returns:
        An :class:`~ckptkit.audit.commands.AuditReport` (its paths name ``work_dir``'s runs,
        or None for a deleted temporary).

    Raises:
        AuditError: a training process failed, or ``work_dir`` is not empty.
        ValueError: ``resume_at`` is not in ``1 .. steps - 1``.

    Example::

        report = audit(TrainerConfig().replace(**{"train.steps": 10, "train.ckpt_every": 1}))
        print(report.describe())
    """
    steps = cfg.train.steps
    if resume_at is not None and not 1 <= resume_at < steps:
        raise ValueError(f"--resume-at must be in 1 ..= {steps - 1} (--steps {steps}) (got {resume_at})")
    argv = [*launcher(nproc), "train", "--run-dir", PLACEHOLDER, "--quiet", *knob_flags(cfg)]
    return audit_command(
        argv,
        stop_at=resume_at,
        interrupt=resume_at is not None,
        stop_with=lambda k: ["--steps", str(k)],  # torchrun reports the stop request's exit 75 as a failure
        resume_args=["--resume"],
        steps=steps,
        explain=functools.partial(explain, rerun=nproc == 1, log=log or (lambda _m: None)),
        on_step=on_step,
        keep_dir=None if work_dir is None else os.fspath(work_dir),
        log=log,
    )


def compare_runs(
    a: str | os.PathLike[str], b: str | os.PathLike[str], *, rerun: bool = True, log: Log | None = None
) -> AuditReport:
    """Compare two run directories of the same config: are they bit-identical?

    Args:
        a, b: run directories (``history.jsonl``, ``environment.json``, checkpoints).
        rerun: on a step divergence, re-run that step twice in this process from
            ``a``'s nearest checkpoint (is the step deterministic within one process?).
        log: progress notes.

    Returns:
        An :class:`~ckptkit.audit.commands.AuditReport` whose ``divergence`` is the first
        difference, or None.

    Raises:
        FormatError: a history line is damaged.
    """
    hook = functools.partial(explain, rerun=rerun, log=log or (lambda _m: None))
    return audit_compare("audit", (), os.fspath(a), os.fspath(b), resume_at=None, explain=hook)


# ----------------------------------------------------------------------------- explaining


def explain(d: Difference, a: str, b: str, *, rerun: bool, log: Log) -> Difference:
    """The trainer's hook (:data:`ckptkit.audit.commands.Explain`): a step divergence with the
    tensors' values from both runs' checkpoints after the step, the step re-run twice in this
    process (``rerun``) and the runs' strict config differences as the likely cause; a
    checkpoint whose tensors differ while every row matched, with what that means."""
    if d.kind == "checkpoint" and d.tensors:
        hint = (
            "the container bytes differ while every fingerprint matched: state outside the "
            "fingerprints (see the tensors) was not reproduced"
        )
        return dataclasses.replace(d, hints=(hint, *d.hints))
    if d.kind != "step":
        return d
    d = _with_values(d, a, b)
    if rerun:
        d = _with_rerun(d, a, log)
    drift = _config_drift(a, b)
    if drift:
        d = dataclasses.replace(
            d, hints=(f"the runs' configs differ in {', '.join(drift)}: the likely cause", *d.hints)
        )
    return d


def _with_values(d: Difference, a: str, b: str) -> Difference:
    """The tensors that differ after step ``d.step``, with values when both runs have a checkpoint there."""
    done = d.step + 1
    ca, cb = run_checkpoints(a), run_checkpoints(b)
    if done in ca and done in cb and not os.path.isdir(ca[done]):
        digests = {t.name: (t.recorded_digest, t.actual_digest) for t in d.tensors}
        return dataclasses.replace(
            d,
            tensors=tuple(tensor_reports(compare_checkpoints(ca[done], cb[done]), digests)),
            values=f"both runs' {checkpoint_name(done)}, compared as ckptkit diff --tensors does",
        )
    return dataclasses.replace(
        d,
        values=f"unavailable: the runs have no checkpoint after step {d.step} on both sides "
        "(the audit's default --ckpt-every 1 keeps one after every step)",
    )


def _with_rerun(d: Difference, a: str, log: Log) -> Difference:
    """``d`` with its step re-run twice in this process from run ``a``'s nearest checkpoint."""
    before = [(s, p) for s, p in list_checkpoints(a) if s <= d.step]
    if not before:
        return d
    start, ckpt = before[-1]
    with tempfile.TemporaryDirectory(prefix="ckptkit-audit-rerun-") as tmp:
        from .loop import deterministic_torch

        with deterministic_torch():
            cfg = config_of(ckpt).replace(**{"train.steps": d.step + 1})
            again = rerun_step(cfg, ckpt, start, a, d.step, tmp, frozenset(DEFAULT_EXEMPT), log)
    hint = (
        "the step is deterministic within one process: the runs differ by process state "
        "(thread pools, lazily initialised kernels, a global RNG seeded per process) or by the resume"
        if again.identical
        else "the step is not deterministic even within one process: see ReplayDivergence's "
        "docstring for the usual causes"
    )
    return dataclasses.replace(d, rerun=again, hints=(*d.hints, hint))


def _config_drift(a: str, b: str) -> list[str]:
    """Strict config keys in which the two runs' newest snapshots differ."""
    ca, cb = list_checkpoints(a), list_checkpoints(b)
    if not ca or not cb:
        return []
    try:
        diffs = diff_keys(read_snapshot(snapshot_path(ca[-1][1])), read_snapshot(snapshot_path(cb[-1][1])))
    except (CheckpointError, OSError):
        return []
    return [d.key for d in diffs if d.strict]
