"""The determinism audit of the reference trainer: the command audit run on ``python -m ckptkit train``.

    ckptkit audit                         # two runs of 10 steps, each in a fresh process
    ckptkit audit --resume-at 4           # uninterrupted vs stopped at 4 and resumed in a fresh process
    ckptkit audit --steps 20 --quant int8 --rand-depth --json
    ckptkit audit --nproc-per-node 2 --resume-at 4   # each run a 2-rank torchrun job (spec/trainer.md R-T14)

Implements ``spec/replay.md`` R-P11..R-P13 with the one audit engine of any loop
(:func:`ckptkit.audit.audit_command`): each run is ``python -m ckptkit train``
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
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from ..audit._commands import PLACEHOLDER, AuditPlan, AuditReport, audit_command, copy_checkpoint
from ..audit._commands import compare_runs as audit_compare
from ..audit._compare import compare_checkpoints, compare_states
from ..audit._recording import step_fields, tensor_reports
from ..errors import AuditError, CheckpointError, ReplayError
from ..format._snapshot import read_snapshot, snapshot_path
from ..format._tree import checkpoint_state
from ..run import ENVIRONMENT_FILE, RunState, checkpoint_name, list_checkpoints
from ..run._difference import Difference, Rerun, first_row_difference
from ..run._drift import DEFAULT_EXEMPT, diff_keys
from ..run._files import run_checkpoints
from ._config import TrainerConfig, flag_name, knobs
from ._data import data_fingerprint, load_bytes
from ._digests import MODEL_PREFIX
from ._loop import Run, _after_resume, build, deterministic_torch, observed_step, run_state, spike_guard
from ._parallel import launcher

__all__ = [
    "AUDIT_DEFAULTS",
    "AuditError",
    "AuditReport",
    "audit",
    "compare_runs",
    "config_of",
    "explain",
    "knob_flags",
    "rerun_step",
]

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
        An :class:`~ckptkit.audit.AuditReport` (its paths name ``work_dir``'s runs,
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
    plan = AuditPlan(
        command=argv,
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
    return audit_command(plan)


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
        An :class:`~ckptkit.audit.AuditReport` whose ``divergence`` is the first
        difference, or None.

    Raises:
        FormatError: a history line is damaged.
    """
    hook = functools.partial(explain, rerun=rerun, log=log or (lambda _m: None))
    return audit_compare("audit", (), os.fspath(a), os.fspath(b), resume_at=None, explain=hook)


# ----------------------------------------------------------------------------- explaining


def explain(d: Difference, a: str, b: str, *, rerun: bool, log: Log, rerun_in: str = "a") -> Difference:
    """The trainer's hook (:data:`ckptkit.audit._commands.Explain`): a step divergence with the
    tensors' values from both runs' checkpoints after the step, the step re-run twice in this
    process (``rerun``; from run ``rerun_in``'s checkpoint before it: a replay's is ``b``, with
    the replay's config) and the runs' strict config differences as the likely cause; a
    checkpoint whose tensors differ while every row matched, with what that means."""
    if d.kind == "checkpoint" and d.tensors and not d.hints:  # a hint already says why (altered after the fact)
        hint = (
            "the container bytes differ while every fingerprint matched: state outside the "
            "fingerprints (see the tensors) was not reproduced"
        )
        return dataclasses.replace(d, hints=(hint, *d.hints))
    if d.kind != "step":
        return d
    d = _with_values(d, a, b)
    if rerun:
        d = _with_rerun(d, a if rerun_in == "a" else b, log)
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
        "(--ckpt-every 1, the audit's default, keeps one after every step)",
    )


def _with_rerun(d: Difference, a: str, log: Log) -> Difference:
    """``d`` with its step re-run twice in this process from run ``a``'s nearest checkpoint."""
    before = [(s, p) for s, p in list_checkpoints(a) if s <= d.step]
    if not before:
        return d
    start, ckpt = before[-1]
    with tempfile.TemporaryDirectory(prefix="ckptkit-audit-rerun-") as tmp, deterministic_torch():
        cfg = config_of(ckpt).replace(**{"train.steps": d.step + 1})
        again = rerun_step(cfg, ckpt, start, d.step, tmp, frozenset(DEFAULT_EXEMPT), log)
    hint = (
        "the step is deterministic within one process: the runs differ by what they ran (config, "
        "environment, code version), by process state (thread pools, lazily initialised kernels, a "
        "global RNG seeded per process) or by the resume"
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


# ----------------------------------------------------------------------------- re-running a step


def config_of(ckpt_path: str) -> TrainerConfig:
    """The trainer config a checkpoint's snapshot (``<ckpt>.config.json``) records.

    Raises:
        CheckpointNotFound: no snapshot next to the checkpoint.
        FormatError: the snapshot is damaged.
        ReplayError: the snapshot describes another trainer's config.
    """
    snap = read_snapshot(snapshot_path(ckpt_path))
    try:
        return TrainerConfig.from_table(snap.config)
    except (KeyError, ValueError) as e:
        raise ReplayError(f"{snap.path}: the snapshot does not describe this trainer's config ({e})") from None


def _restore(cfg: TrainerConfig, ckpt_path: str, work: str, exempt: frozenset[str], log: Log) -> tuple[Run, RunState]:
    """A :class:`Run` at the checkpoint's step, restored as ``ckptkit train --resume`` would, in
    ``work`` (a private copy of the checkpoint, its companions and its run's environment record)."""
    os.makedirs(work, exist_ok=True)
    for name in os.listdir(work):  # a second restore in the same place starts clean
        os.unlink(os.path.join(work, name))
    run_dir = os.path.dirname(ckpt_path) or "."
    copy_checkpoint(run_dir, ckpt_path, work)
    if os.path.isfile(os.path.join(run_dir, ENVIRONMENT_FILE)):
        shutil.copyfile(os.path.join(run_dir, ENVIRONMENT_FILE), os.path.join(work, ENVIRONMENT_FILE))
    data = load_bytes(cfg.data.path)
    run = build(cfg, data)
    rs = run_state(run, work, data_fingerprint(data), exempt=exempt)
    spike_guard(run, rs)  # registers what the guard keeps in a checkpoint; judges each step as train() does
    info = rs.resume(allow_env_change=True)  # judged by whoever asked; a scratch copy
    _after_resume(run, info, lambda _m: None)
    log(f"restored {os.path.basename(ckpt_path)} at step {info.step}; stream offset {run.stream.offset}")
    return run, rs


def _capture(run: Run, rs: RunState, steps_done: int) -> dict[str, Any]:
    """Everything after a step, cloned: the checkpoint's leaves and the gradients."""
    state = {
        k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
        for k, v in checkpoint_state(rs.checkpoint(steps_done)).items()
    }
    for name, p in run.model.named_parameters():
        if p.grad is not None:
            state["grad:" + MODEL_PREFIX.partition(":")[2] + name] = p.grad.detach().clone()
    return state


def rerun_step(
    cfg: TrainerConfig, ckpt_path: str, start: int, step: int, work: str, exempt: frozenset[str], log: Log
) -> Rerun:
    """Run ``step`` twice from the same state: each time restored from ``ckpt_path`` (at
    ``start``) and re-run up to it, then ``step`` with everything captured after it.

    Returns:
        A :class:`Rerun` comparing the two step rows and the two captured states
        (gradients, parameters, optimizer state, teacher, monitor) with
        :func:`ckptkit.audit.compare_states`.
    """
    captures, rows = [], []
    for _ in range(2):
        run, rs = _restore(cfg, ckpt_path, work, exempt, log)
        for s in range(start, step):
            observed_step(run, s)
        rows.append(observed_step(run, step).row())
        captures.append(_capture(run, rs, step + 1))
    d = first_row_difference([rows[0]], [rows[1]], step_fields(rows[0]))
    diffs = compare_states(captures[0], captures[1])
    return Rerun(d is None and not diffs, d.fields if d else (), tuple(tensor_reports(diffs, {})))
