"""The determinism audit: train the same short run twice and prove the two are bit-identical.

    ckptkit audit                         # two runs of 10 steps, each in a fresh process
    ckptkit audit --resume-at 4           # uninterrupted vs stopped at 4 and resumed in a fresh process
    ckptkit audit --steps 20 --quant int8 --rand-depth --json
    ckptkit audit --nproc-per-node 2 --resume-at 4   # each run a 2-rank torchrun job (spec/trainer.md R-T14)

Implements ``spec/replay.md`` R-P11..R-P13. Each run is ``python -m ckptkit train`` in
a fresh process, so whatever a process carries (thread pools, allocator, lazily
initialised kernels, global RNGs) starts over. The two run directories are compared
with the same machinery as ``ckptkit replay``: the first history row that differs
(step fingerprints, probes, the start row), the tensors that differ after that step
(the per-step ``digests`` rows; values from both runs' checkpoints when both have
one, via :func:`ckptkit.audit.compare.compare_checkpoints` -- what ``ckptkit diff
--tensors`` prints), the step re-run twice in this process, and finally every
checkpoint both runs wrote, byte for byte. Each run's ``environment.json`` is shown,
and any fact that differs between the two is listed.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..audit.compare import compare_checkpoints
from ..audit.recording import (
    checkpoint_difference,
    named_reports,
    row_fields,
    step_fields,
    tensor_reports,
)
from ..errors import AuditError, CheckpointError
from ..format.snapshot import read_snapshot, snapshot_path
from ..run import checkpoint_name, list_checkpoints, read_environment
from ..run.difference import Difference, FieldDiff
from ..run.drift import DEFAULT_EXEMPT, diff_keys
from ..run.environment import EnvDiff, diff_environment
from ..run.files import run_checkpoints
from ..run.fingerprint import differing_names, first_divergence, step_rows
from ..run.history import HISTORY_FILE, compared_rows, read_rows
from .config import TrainerConfig, flag_name, knobs
from .parallel import launcher
from .replay import config_of, rerun_step

__all__ = ["AUDIT_DEFAULTS", "AuditError", "AuditReport", "audit", "compare_runs", "knob_flags"]

Log = Callable[[str], None]

#: Knobs the audit sets unless the user gives them: short, and a checkpoint after every
#: step (all kept), so a divergence anywhere has values on both sides.
AUDIT_DEFAULTS: dict[str, Any] = {"train.steps": 10, "train.ckpt_every": 1, "train.log_every": 1000}

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


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` / :func:`compare_runs` found; ``ok`` when the runs are bit-identical."""

    a: str | None  # run directories; None when they were temporary (deleted)
    b: str | None
    steps: int
    resume_at: int | None
    environment: Mapping[str, Any]
    environment_differences: tuple[EnvDiff, ...]
    checkpoints_compared: int
    divergence: Difference | None = None
    fresh_processes: bool = False  # each run trained in its own process (audit), or given (compare_runs)

    @property
    def ok(self) -> bool:
        """The runs are bit-identical (environment differences are shown, not judged)."""
        return self.divergence is None

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object (spec/replay.md R-P13)."""
        return {
            "schema_version": 1,
            "ok": self.ok,
            "a": self.a,
            "b": self.b,
            "steps": self.steps,
            "resume_at": self.resume_at,
            "environment": dict(sorted(self.environment.items())),
            "environment_differences": [
                {"key": d.key, "a": d.recorded, "b": d.current} for d in self.environment_differences
            ],
            "checkpoints_compared": self.checkpoints_compared,
            "divergence": None if self.divergence is None else self.divergence.to_json("a", "b"),
        }

    def describe(self, limit: int = 12) -> str:
        """The human report (what ``ckptkit audit`` prints on stdout)."""
        fresh = ", each in a fresh process" if self.fresh_processes else ""
        how = (
            f"a: {self.steps} steps uninterrupted; b: stopped at {self.resume_at}, resumed in a fresh process"
            if self.resume_at is not None
            else f"a, b: {self.steps} steps each{fresh}"
        )
        lines = [f"audit: {how}"]
        if self.a is not None:
            lines.append(f"runs: {self.a} {self.b}")
        env = ", ".join(
            f"{k} {self.environment[k]}" for k in _SHOWN if k in self.environment and self.environment[k] != "none"
        )
        lines.append(f"environment: {env}")
        if self.environment_differences:
            lines.append(f"environment differs between the runs in {len(self.environment_differences)} fact(s):")
            lines += [f"  {d.key}: a {d.recorded}, b {d.current}" for d in self.environment_differences]
        d = self.divergence
        if d is None:
            if self.ok:
                lines.append(
                    f"IDENTICAL: {self.steps} steps, every history fingerprint and "
                    f"{self.checkpoints_compared} checkpoint(s) bit for bit"
                )
            return "\n".join(lines)
        where = {"start": "the start row", "probe": "a probe before step 0"}.get(d.kind)
        if d.kind == "checkpoint":
            lines.append(f"DIVERGED at step {d.step}: {d.file} differs between the runs (every history row matched)")
        else:
            lines.append(f"DIVERGED at {where or f'step {d.step}'}")
        lines += d.lines("a", "b", limit=limit)
        return "\n".join(lines)


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


_POLL_S = 0.25  # how often a waiting audit reads the child's history for the progress callback


def _train_process(
    run_dir: str,
    cfg: TrainerConfig,
    *,
    steps: int,
    resume: bool,
    nproc: int,
    log: Log,
    on_step: Callable[[int], None],
) -> None:
    argv = [
        *launcher(nproc),
        "train",
        "--run-dir",
        run_dir,
        "--quiet",
        *knob_flags(cfg.replace(**{"train.steps": steps})),
    ]
    if resume:
        argv.append("--resume")
    what = "fresh process" if nproc == 1 else f"a fresh torchrun job of {nproc} ranks"
    log(f"{'resume' if resume else 'train'} {os.path.basename(run_dir)} to step {steps} ({what})")
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        while True:
            try:
                _out, err = proc.communicate(timeout=_POLL_S)  # a retry after a timeout loses no output
                break
            except subprocess.TimeoutExpired:
                rows = [r for r in read_rows(os.path.join(run_dir, HISTORY_FILE))[0] if r["kind"] == "step"]
                on_step(rows[-1]["step"] + 1 if rows else 0)
    if proc.returncode != 0:
        tail = "\n".join(err.strip().splitlines()[-5:])
        raise AuditError(f"`ckptkit train` for run {os.path.basename(run_dir)} exited {proc.returncode}:\n{tail}")


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
        work_dir: where runs ``a`` and ``b`` go (kept); a temporary directory if None.
        resume_at: run ``b`` stops at this step and is resumed in another fresh process.
        nproc: ranks per run: above 1 each training process is a torchrun job of that many
            ranks (spec/trainer.md R-T14); the step is then not re-run in this process.
        log: progress notes.
        on_step: called with (steps trained by both runs so far, their total) while a
            training process runs, and once each ends (a progress bar).

    Returns:
        An :class:`AuditReport` (its paths name ``work_dir``'s runs, or a deleted temporary).

    Raises:
        AuditError: a training process failed.
        ValueError: ``resume_at`` is not in ``1 .. steps - 1``.

    Example::

        report = audit(TrainerConfig().replace(**{"train.steps": 10, "train.ckpt_every": 1}))
        print(report.describe())
    """
    log = log or (lambda _m: None)
    steps = cfg.train.steps
    if resume_at is not None and not 1 <= resume_at < steps:
        raise ValueError(f"--resume-at must be in 1 ..= {steps - 1} (--steps {steps}) (got {resume_at})")
    with tempfile.TemporaryDirectory(prefix="ckptkit-audit-") as tmp:
        root = os.fspath(work_dir) if work_dir is not None else tmp
        a, b = os.path.join(root, "a"), os.path.join(root, "b")

        def trained(before: int) -> Callable[[int], None]:  # run b's steps count after run a's
            return lambda done: None if on_step is None else on_step(before + done, 2 * steps)

        _train_process(a, cfg, steps=steps, resume=False, nproc=nproc, log=log, on_step=trained(0))
        trained(0)(steps)
        if resume_at is None:
            _train_process(b, cfg, steps=steps, resume=False, nproc=nproc, log=log, on_step=trained(steps))
        else:
            _train_process(b, cfg, steps=resume_at, resume=False, nproc=nproc, log=log, on_step=trained(steps))
            _train_process(b, cfg, steps=steps, resume=True, nproc=nproc, log=log, on_step=trained(steps))
        trained(steps)(steps)
        report = compare_runs(a, b, rerun=nproc == 1, log=log)
    kept = work_dir is not None
    return AuditReport(
        report.a if kept else None,
        report.b if kept else None,
        steps,
        resume_at,
        report.environment,
        report.environment_differences,
        report.checkpoints_compared,
        report.divergence,
        fresh_processes=True,
    )


# ----------------------------------------------------------------------------- comparing


def _environment(run_dir: str) -> dict[str, Any]:
    """The run's recorded facts; {} when it has no readable record (every fact then shows as a difference)."""
    try:
        facts = read_environment(run_dir)
    except CheckpointError:
        return {}
    return facts if isinstance(facts, dict) else {}


def _first_row_difference(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], kind: str) -> Difference | None:
    a = [r for r in compared_rows(rows_a) if r["kind"] == kind]
    b = [r for r in compared_rows(rows_b) if r["kind"] == kind]
    for ra, rb in zip(a, b, strict=False):
        if ra != rb:
            return Difference(kind, ra["step"], fields=row_fields(ra, rb))
    if len(a) != len(b):
        return Difference(kind, 0, fields=(FieldDiff(f"{kind} rows", len(a), len(b)),))
    return None


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
        An :class:`AuditReport` whose ``divergence`` is the first difference, or None.

    Raises:
        FormatError: a history line is damaged.
    """
    log = log or (lambda _m: None)
    a, b = os.fspath(a), os.fspath(b)
    env_a, env_b = _environment(a), _environment(b)
    rows_a, _ = read_rows(os.path.join(a, HISTORY_FILE))
    rows_b, _ = read_rows(os.path.join(b, HISTORY_FILE))
    div, n_ckpt = _history_divergence(a, b, rows_a, rows_b, rerun, log), 0
    if div is None:  # every history row matched: the checkpoints both runs wrote must be the same bytes
        div, n_ckpt = _checkpoint_divergence(a, b)
    steps = len(step_rows(rows_a))
    return AuditReport(a, b, steps, None, env_a, tuple(diff_environment(env_a, env_b)), n_ckpt, div)


def _history_divergence(
    a: str, b: str, rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], rerun: bool, log: Log
) -> Difference | None:
    """The first history difference: ``start`` and ``probe`` rows, then step rows (explained)."""
    for kind in ("start", "probe"):
        div = _first_row_difference(rows_a, rows_b, kind)
        if div is not None:
            return div
    steps_a, steps_b = step_rows(rows_a), step_rows(rows_b)
    fields = step_fields(steps_a[0]) if steps_a else []
    d = first_divergence(steps_a, steps_b, fields)
    if d is None and len(steps_a) != len(steps_b):
        return Difference(
            "step", min(len(steps_a), len(steps_b)), fields=(FieldDiff("step rows", len(steps_a), len(steps_b)),)
        )
    if d is None:
        return None
    return _with_drift_hint(a, b, _explain(a, b, rows_a, rows_b, d.step, d.fields, rerun, log))


def _with_drift_hint(a: str, b: str, div: Difference) -> Difference:
    """``div`` with the runs' differing config keys named first among its hints (when they differ)."""
    drift = _config_drift(a, b)
    if not drift:
        return div
    return dataclasses.replace(
        div, hints=(f"the runs' configs differ in {', '.join(drift)}: the likely cause", *div.hints)
    )


def _checkpoint_divergence(a: str, b: str) -> tuple[Difference | None, int]:
    """The first checkpoint both runs wrote that is not the same checkpoint, and how many they share."""
    ca, cb = run_checkpoints(a), run_checkpoints(b)
    common = sorted(set(ca) & set(cb))
    for s in common:
        d = checkpoint_difference(s, ca[s], cb[s])
        if d is not None and d.tensors:
            hint = (
                "the container bytes differ while every fingerprint matched: state outside the "
                "fingerprints (see the tensors) was not reproduced"
            )
            return dataclasses.replace(d, hints=(hint, *d.hints)), len(common)
        if d is not None:
            return d, len(common)
    return None, len(common)


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


def _digests(rows: list[dict[str, Any]], kind: str, step: int) -> dict[str, int]:
    found = [r for r in rows if r["kind"] == kind and r["step"] == step]
    return dict(found[-1].get("tensors") or {}) if found else {}


def _explain(
    a: str,
    b: str,
    rows_a: list[dict[str, Any]],
    rows_b: list[dict[str, Any]],
    step: int,
    fields: tuple[FieldDiff, ...],
    rerun: bool,
    log: Log,
) -> Difference:
    done = step + 1
    da = {**_digests(rows_a, "digests", done), **_digests(rows_a, "checkpoint", done)}
    db = {**_digests(rows_b, "digests", done), **_digests(rows_b, "checkpoint", done)}
    bad = differing_names(da, db)
    pa, pb = os.path.join(a, checkpoint_name(done)), os.path.join(b, checkpoint_name(done))
    if os.path.isfile(pa) and os.path.isfile(pb):
        tensors = tensor_reports(compare_checkpoints(pa, pb), {n: (da.get(n), db.get(n)) for n in bad})
        values = f"both runs' {checkpoint_name(done)}, compared as ckptkit diff --tensors does"
    else:
        tensors = named_reports(bad, da, db, "values unavailable")
        values = (
            f"unavailable: the runs have no checkpoint after step {step} on both sides "
            "(the audit's default --ckpt-every 1 keeps one after every step)"
        )
    again = None
    hints: list[str] = []
    if rerun:
        before = [(s, p) for s, p in list_checkpoints(a) if s <= step]
        if before:
            start, ckpt = before[-1]
            with tempfile.TemporaryDirectory(prefix="ckptkit-audit-rerun-") as tmp:
                from .loop import deterministic_torch

                with deterministic_torch():
                    cfg = config_of(ckpt).replace(**{"train.steps": done})
                    again = rerun_step(cfg, ckpt, start, a, step, tmp, frozenset(DEFAULT_EXEMPT), log)
            hints.append(
                "the step is deterministic within one process: the runs differ by process state "
                "(thread pools, lazily initialised kernels, a global RNG seeded per process) or by the "
                "resume"
                if again.identical
                else "the step is not deterministic even within one process: see ReplayDivergence's "
                "docstring for the usual causes"
            )
    return Difference(
        "step", step, fields=fields, tensors=tuple(tensors), values=values, rerun=again, hints=tuple(hints)
    )
