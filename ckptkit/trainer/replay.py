"""Replay a recorded run from one of its checkpoints and name the first step and tensor that diverge.

    ckptkit replay runs/a --from 100                 # re-run 100..end, compare with history.jsonl
    ckptkit replay runs/a --from 100 --to 120 --json
    python -c "from ckptkit.trainer.replay import replay; print(replay('runs/a', 100).describe())"

Implements ``spec/replay.md`` R-P05..R-P09 and R-P15. The recording is the run's
``history.jsonl``: per step, exact loss / grad-norm / LR bits and ``params_digest``;
per step, per-parameter digests (``digests`` rows); per checkpoint, the digest of
every tensor and value it holds (``checkpoint`` rows). A replay:

1. picks the checkpoint at or nearest before ``--from`` and checks its file against
   the ``checkpoint`` row recorded when it was written: a tensor altered after the
   fact is a divergence *at that checkpoint's step*, named;
2. compares the environment with ``environment.json`` (refused on a difference unless
   ``allow_env_change``, exactly like a resume) and rebuilds the config from the
   checkpoint's snapshot (plus explicit overrides, which are reported);
3. restores the checkpoint through the trainer's own :func:`~ckptkit.trainer.loop.run_state`
   in a private directory (never RUN) and re-runs every step, comparing each step row
   with the recording and, wherever the recording checkpointed, the whole state and
   the file RUN still holds there;
4. on the first difference, explains it: which tensors differ from the recording
   (digests; values where a verified recorded copy exists), and whether the step is
   deterministic *here* -- it is re-run twice from the same state with per-tensor
   capture of parameters, gradients and optimizer state (gradients are never recorded,
   so they can only be compared replay against replay).

A range the recording re-ran or rolled back in (``--auto-rollback on``) is replayed by
the trainer's own guarded loop instead, comparing every history row in order (R-P15).

Names are those of :func:`ckptkit.audit.compare.checkpoint_state` (``model:model.wte``,
``optim:optimizers.adamw.state.3.exp_avg``); gradients are ``grad:model.<param>``.
Differences between values are computed by :func:`ckptkit.audit.compare.compare_states`, the
function behind ``ckptkit diff --tensors``, so the two always agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..audit.compare import compare_states
from ..audit.recording import (
    LAYOUT_ONLY,
    RunRecording,
    first_checkpoint_difference,
    named_reports,
    row_difference,
    step_fields,
    tensor_reports,
)
from ..errors import (
    CheckpointNotFound,
    EnvironmentDrift,
    FormatError,
    ReplayError,
    TrainingUnstable,
)
from ..format.checkpoint import load
from ..format.companions import rebind
from ..format.snapshot import read_snapshot, snapshot_path, write_snapshot
from ..format.tree import checkpoint_state
from ..run import ENVIRONMENT_FILE, RunState, checkpoint_name, list_checkpoints, read_environment
from ..run.difference import Difference, FieldDiff, Rerun, TensorReport
from ..run.drift import DEFAULT_EXEMPT
from ..run.environment import EnvDiff, capture, diff_environment
from ..run.files import run_checkpoints
from ..run.fingerprint import differing_names, first_divergence, leaf_digests
from ..run.history import HISTORY_FILE, compared_rows, read_rows
from .config import TrainerConfig
from .data import data_fingerprint, load_bytes
from .digests import MODEL_PREFIX
from .loop import (
    Run,
    _after_resume,
    build,
    deterministic_torch,
    intra_op_threads,
    observed_step,
    run_state,
    spike_guard,
    train,
)
from .replay_report import ReplayReport

# The replayer; what it finds is a :class:`ReplayReport` (``replay_report.py``), what it
# compares with is a :class:`~ckptkit.audit.recording.RunRecording`.
__all__ = [
    "ReplayError",
    "ReplayReport",
    "config_of",
    "replay",
    "rerun_step",
]

Log = Callable[[str], None]

ENV_REPLAY_HINT = "pass --allow-env-change to replay anyway (the differences are then listed with the result)"


# ----------------------------------------------------------------------------- restoring


def _copy_checkpoint(ckpt_path: str, run_dir: str, dest: str) -> None:
    """The checkpoint, its companions and the environment record, into ``dest`` (read-only use of RUN)."""
    base = os.path.basename(ckpt_path)
    for name in os.listdir(os.path.dirname(ckpt_path) or "."):
        if name == base or name.startswith(base + "."):
            shutil.copyfile(os.path.join(os.path.dirname(ckpt_path), name), os.path.join(dest, name))
    env = os.path.join(run_dir, ENVIRONMENT_FILE)
    if os.path.isfile(env):
        shutil.copyfile(env, os.path.join(dest, ENVIRONMENT_FILE))


def _restore(
    cfg: TrainerConfig, ckpt_path: str, run_dir: str, work: str, exempt: frozenset[str], log: Log
) -> tuple[Run, RunState]:
    """A :class:`Run` at the checkpoint's step, restored as ``ckptkit train --resume`` would,
    in ``work`` (a private copy: RUN is only read)."""
    os.makedirs(work, exist_ok=True)
    for name in os.listdir(work):  # a second restore in the same place starts clean
        os.unlink(os.path.join(work, name))
    _copy_checkpoint(ckpt_path, run_dir, work)
    data = load_bytes(cfg.data.path)
    run = build(cfg, data)
    rs = run_state(run, work, data_fingerprint(data), exempt=exempt)
    spike_guard(run, rs)  # registers what the guard keeps in a checkpoint; judges each step as train() does
    # The environment was compared with the recording already (R-P06), with replay's own
    # wording; this second check would only repeat it.
    info = rs.resume(allow_env_change=True)
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


# ----------------------------------------------------------------------------- comparing


def _verified_file_state(run_dir: str, steps_done: int, rec: RunRecording) -> tuple[dict[str, Any] | None, str]:
    """RUN's checkpoint at ``steps_done`` as a state, if it exists and matches its recorded digests."""
    path = os.path.join(run_dir, checkpoint_name(steps_done))
    if not os.path.isfile(path):
        return None, f"RUN holds no checkpoint at step {steps_done} (the recording keeps digests there, not values)"
    try:
        state = checkpoint_state(load(path))
    except FormatError as e:
        return None, f"{path} does not verify ({e})"
    recorded = rec.checkpoint_digests.get(steps_done)
    if recorded is not None and differing_names(recorded, leaf_digests(state)):
        return None, f"{path} itself differs from its recorded digests, so it cannot stand for the recording"
    return state, f"recorded values from {path} (its digests match the recording)"


def rerun_step(
    cfg: TrainerConfig, ckpt_path: str, start: int, run_dir: str, step: int, work: str, exempt: frozenset[str], log: Log
) -> Rerun:
    """Run ``step`` twice from the same state: each time restored from ``ckpt_path`` (at
    ``start``) and re-run up to it, then ``step`` with everything captured after it.

    Returns:
        A :class:`Rerun` comparing the two step rows and the two captured states
        (gradients, parameters, optimizer state, teacher, monitor) with
        :func:`ckptkit.audit.compare.compare_states`.
    """
    captures, rows = [], []
    for _ in range(2):
        run, rs = _restore(cfg, ckpt_path, run_dir, work, exempt, log)
        for s in range(start, step):
            observed_step(run, s)
        rows.append(observed_step(run, step).row())
        captures.append(_capture(run, rs, step + 1))
    d = first_divergence([rows[0]], [rows[1]], step_fields(rows[0]))
    diffs = compare_states(captures[0], captures[1])
    return Rerun(d is None and not diffs, d.fields if d else (), tuple(tensor_reports(diffs, {})))


# ----------------------------------------------------------------------------- replay


def _choose(run_dir: str, from_step: int) -> tuple[int, str]:
    ckpts = list_checkpoints(run_dir)
    before = [(s, p) for s, p in ckpts if s <= from_step]
    if not before:
        have = ", ".join(str(s) for s, _ in ckpts) or "none"
        raise CheckpointNotFound(f"{run_dir}: no checkpoint at or before step {from_step} (checkpoints: {have})")
    return before[-1]


def _env_check(run_dir: str, allow: bool) -> list[EnvDiff]:
    diffs = diff_environment(read_environment(run_dir), capture())
    fatal = [d for d in diffs if d.fatal]
    if fatal and not allow:
        lines = [f"the environment differs from the run's recording in {len(fatal)} fact(s):"]
        lines += [f"  {d}" for d in fatal]
        lines.append(ENV_REPLAY_HINT)
        raise EnvironmentDrift("\n".join(lines), diffs)
    return diffs


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


def _overrides(cfg: TrainerConfig, overrides: Mapping[str, Any]) -> tuple[TrainerConfig, tuple[FieldDiff, ...]]:
    try:
        new = cfg.replace(**overrides)
    except (KeyError, ValueError) as e:
        raise ReplayError(f"override: {e}") from None
    out = []
    for key in sorted(overrides):
        table, _, name = key.partition(".")
        old_v, new_v = getattr(getattr(cfg, table), name), getattr(getattr(new, table), name)
        if old_v != new_v:
            out.append(FieldDiff(key, _plain(old_v), _plain(new_v)))
    return new, tuple(out)


def _plain(v: Any) -> Any:
    return getattr(v, "value", v)


def replay(
    run_dir: str | os.PathLike[str],
    from_step: int,
    to_step: int | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    allow_env_change: bool = False,
    threads: int | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    log: Log | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Re-run ``run_dir`` from its checkpoint at (or nearest before) ``from_step`` and
    compare every step with the recording; explain the first difference.

    RUN is only read. The replay works in ``out_dir`` (which then keeps the replay's
    checkpoints at every step the recording checkpointed, and at the state after a
    diverging step, for ``ckptkit diff --tensors``) or in a temporary directory.

    Args:
        run_dir: the recorded run (``history.jsonl``, ``environment.json``, checkpoints).
        from_step: start at the checkpoint at or before this step (steps done).
        to_step: stop when this many steps are done (default: the end of the recording).
        overrides: config keys to change from the snapshot (``{"train.perturb_at": 3}``);
            reported in the result. Testing what a knob changes is their use.
        allow_env_change: replay even when the environment differs from ``environment.json``.
        threads: run with this intra-op thread count (an environment change: needs
            ``allow_env_change`` unless it equals the recording's).
        out_dir: keep the replay's files here (must not be inside ``run_dir``).
        log: progress notes.
        on_step: called with (steps done, ``to``) after each replayed step (a progress bar).

    Returns:
        A :class:`ReplayReport`; ``report.ok`` when every step matched bit for bit.

    Raises:
        CheckpointNotFound: no history, no checkpoint at or before ``from_step``, no
            environment record.
        EnvironmentDrift: the environment differs and ``allow_env_change`` is False.
        ConfigDrift, ResumeRefused: the checkpoint cannot be restored as the run's.
        FormatError: a file of the run is damaged.
        ReplayError: ``to_step`` outside the recording, a bad override, a rollback in range.

    Example::

        report = replay("runs/a", 100)
        print(report.describe()); sys.exit(0 if report.ok else 1)
    """
    log = log or (lambda _m: None)
    step_done = on_step or (lambda _done, _to: None)
    run_dir = os.fspath(run_dir)
    rec = RunRecording(run_dir, required=True)
    start, ckpt_path = _choose(run_dir, from_step)
    to = rec.last if to_step is None else to_step
    out_dir = _check_request(run_dir, rec, start, to, out_dir)
    # A re-run or rollback at or after the start supersedes rows of the range (R-P15), even when
    # the spike itself lies past --to: the plain loop would be compared with the wrong timeline.
    inside = sorted({s for s in rec.rollbacks if s >= start})
    notes = [
        f"the recording resumed at step {s} with an environment override ({'; '.join(envs)}); "
        "environment.json describes the steps before it"
        for s, envs in rec.env_overrides
        if s < to
    ]

    with deterministic_torch(), intra_op_threads(threads):
        env = _env_check(run_dir, allow_env_change)
        cfg = config_of(ckpt_path).replace(**{"train.steps": to})
        cfg, changed = _overrides(cfg, overrides or {})
        exempt = frozenset(DEFAULT_EXEMPT) | {f.field for f in changed}
        report = _Builder(run_dir, ckpt_path, start, to, changed, tuple(env), notes, rec.env_overrides)
        altered = _check_start(rec, ckpt_path, start, notes)  # R-P06
        if altered is not None:
            return report.done(0, altered)
        with contextlib.ExitStack() as stack:
            work = out_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptkit-replay-"))
            if inside:
                notes.append(
                    f"the recording re-ran or rolled back at step(s) {', '.join(map(str, inside))} "
                    "(--auto-rollback on): replayed by the trainer's own guarded loop, every history "
                    "row compared in order (R-P15)"
                )
                return _replay_guarded(cfg, rec, run_dir, ckpt_path, start, to, work, log, report, step_done)
            return _replay_plain(cfg, rec, (start, ckpt_path), to, work, exempt, log, report, out_dir, step_done)


#: The hint for a file that verifies but is not what the run wrote (R-P06, R-P07).
_ALTERED = (
    "the file verifies (its container checksums were re-sealed) but is not what the run wrote: it was "
    "altered after the fact; do not resume from it"
)


def _check_request(
    run_dir: str, rec: RunRecording, start: int, to: int, out_dir: str | os.PathLike[str] | None
) -> str | None:
    """``--to`` inside the recording, ``--out`` empty and outside RUN; returns ``--out`` made absolute.

    Raises:
        ReplayError: naming the option.
    """
    if to < start or to > max(rec.last, start):
        raise ReplayError(
            f"--to {to} is outside the replayable range: the checkpoint is at step {start} and the "
            f"recording ends at step {rec.last}"
        )
    if out_dir is None:
        return None
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.commonpath([out, os.path.abspath(run_dir)]) == os.path.abspath(run_dir):
        raise ReplayError(f"--out {out} is inside the run directory; replay never writes into RUN")
    if os.path.isdir(out) and os.listdir(out):
        raise ReplayError(f"--out {out} is not empty")
    return out


def _check_start(rec: RunRecording, ckpt_path: str, start: int, notes: list[str]) -> Difference | None:
    """R-P06: the starting checkpoint against the digests recorded when it was written."""
    recorded = rec.checkpoint_digests.get(start)
    if recorded is None:
        notes.append(
            f"the recording holds no digests for {os.path.basename(ckpt_path)} (an older ckptkit wrote "
            "it): the starting checkpoint is trusted as it is"
        )
        return None
    file_digests = leaf_digests(checkpoint_state(load(ckpt_path)))
    bad = differing_names(recorded, file_digests)
    if not bad:
        return None
    return Difference(
        "checkpoint",
        start,
        file=ckpt_path,
        tensors=tuple(named_reports(bad, recorded, file_digests, "values unavailable")),
        values="the recording keeps digests, not values; replay from an earlier checkpoint "
        "(--from a smaller step) re-derives the recorded values and measures the difference",
        hints=(_ALTERED,),
    )


def _replay_plain(
    cfg: TrainerConfig,
    rec: RunRecording,
    origin: tuple[int, str],
    to: int,
    work: str,
    exempt: frozenset[str],
    log: Log,
    report: _Builder,
    out_dir: str | None,
    step_done: Callable[[int, int], None],
) -> ReplayReport:
    """R-P07: re-run steps ``start..to-1`` from the checkpoint, each compared with its row,
    its ``digests`` row and, at a recorded checkpoint, the state and RUN's file."""
    start, ckpt_path = origin
    run_dir = report.run_dir
    run, rs = _restore(cfg, ckpt_path, run_dir, work, exempt, log)
    replayed = 0
    for step in range(start, to):
        result = observed_step(run, step)
        replayed += 1
        done = step + 1
        step_done(done, to)
        recorded_row = rec.steps.get(step)
        if recorded_row is None:
            report.notes.append(f"the recording has no row for step {step}: not compared")
            continue
        d = first_divergence([recorded_row], [result.row()], step_fields(recorded_row))
        rec_params = rec.digests.get(done)
        bad_params = (
            []
            if rec_params is None or result.param_digests is None
            else differing_names(rec_params, result.param_digests)
        )
        if d is not None or bad_params:
            return report.done(
                replayed, _explain_step(cfg, rec, run_dir, origin, exempt, log, run, rs, step, d, out_dir)
            )
        rec_state = rec.checkpoint_digests.get(done)
        if rec_state is None:
            continue
        state = {k: v for k, v in _capture(run, rs, done).items() if not k.startswith("grad:")}
        if out_dir is not None:
            rs.save(done)
        divergence = _state_divergence(run_dir, rec, done, rec_state, state) or _file_divergence(
            run_dir, done, rec_state, state, report.notes
        )
        if divergence is not None:
            return report.done(replayed, divergence)
    return report.done(replayed, None)


def _state_divergence(
    run_dir: str, rec: RunRecording, done: int, rec_state: Mapping[str, int], state: dict[str, Any]
) -> Difference | None:
    """The replayed state after ``done`` steps against the recorded checkpoint digests."""
    digests = leaf_digests(state)
    bad = differing_names(rec_state, digests)
    if not bad:
        return None
    values, why = _verified_file_state(run_dir, done, rec)
    tensors = (
        tensor_reports(
            [t for t in compare_states(values, state) if t.name in bad],
            {n: (rec_state.get(n), digests.get(n)) for n in bad},
        )
        if values is not None
        else named_reports(bad, rec_state, digests, "values unavailable")
    )
    return Difference(
        "state",
        done,
        tensors=tuple(tensors),
        values=why,
        hints=(
            (
                "every step row matched, yet the state differs: state outside the step "
                "fingerprints (optimizer moments, teacher, monitor) was not reproduced"
            ),
        ),
    )


def _file_divergence(
    run_dir: str, done: int, rec_state: Mapping[str, int], state: dict[str, Any], notes: list[str]
) -> Difference | None:
    """R-P07: the file RUN still holds at this step, against the same recording."""
    file = os.path.join(run_dir, checkpoint_name(done))
    if not os.path.isfile(file):
        return None
    try:
        fstate = checkpoint_state(load(file))
    except FormatError as e:
        notes.append(f"{file} does not verify ({e}); not compared")
        return None
    fdig = leaf_digests(fstate)
    fbad = differing_names(rec_state, fdig)
    if not fbad:
        return None
    tensors = tensor_reports(
        [t for t in compare_states(state, fstate) if t.name in fbad], {n: (rec_state.get(n), fdig.get(n)) for n in fbad}
    )
    return Difference(
        "checkpoint",
        done,
        file=file,
        tensors=tuple(tensors),
        values=f"the replayed state after {done} steps, whose digests match the recording",
        hints=(_ALTERED,),
    )


def _replay_guarded(
    cfg: TrainerConfig,
    rec: RunRecording,
    run_dir: str,
    ckpt_path: str,
    start: int,
    to: int,
    work: str,
    log: Log,
    report: _Builder,
    step_done: Callable[[int, int], None],
) -> ReplayReport:
    """R-P15: a range holding spike re-runs or rollbacks, replayed by :func:`train` itself.

    Re-running plain steps cannot reproduce a rollback (its state comes from the
    ring), so the trainer resumes a private copy of the checkpoint and history, as
    ``ckptkit train --resume`` would, and runs the guarded loop to ``to``. A
    deterministic run then writes the recording's compared rows again, in order
    (step, spike, rollback and digests rows: the resume invariant), so the first
    row that differs is the divergence.
    """
    _private_copy(cfg, run_dir, ckpt_path, start, work)
    executed = 0

    def count(result: Any) -> None:
        nonlocal executed
        executed += 1
        step_done(result.step + 1, to)

    try:  # the environment was compared with the recording already (R-P06)
        train(cfg, work, resume=True, allow_env_change=True, log=log, on_step=count)
    except TrainingUnstable as e:  # the recording may have stopped the same way: its rows say whether it did
        report.notes.append(f"the replay stopped: {str(e).splitlines()[0]}")
    return report.done(executed, _compare_guarded(rec, run_dir, start, to, work), guarded=True)


def _private_copy(cfg: TrainerConfig, run_dir: str, ckpt_path: str, start: int, work: str) -> None:
    """A run directory in ``work`` that ``train --resume`` continues as RUN did from ``ckpt_path``:
    the checkpoint (and the ring's base), bound to the replay's snapshot, and RUN's history."""
    os.makedirs(work, exist_ok=True)
    _copy_checkpoint(ckpt_path, run_dir, work)
    # The resume rebuilds the rollback ring by replaying from the newest checkpoint at or
    # before start - K (rollback.md R-R12): give it RUN's, or it replays from step 0.
    base = [p for s, p in list_checkpoints(run_dir) if s <= max(start - cfg.train.rollback_k, 0)]
    if base and base[-1] != ckpt_path:
        _copy_checkpoint(base[-1], run_dir, work)
    # The replay's plan (--to, overrides) is its own, not drift from the recorded snapshot.
    copy = os.path.join(work, os.path.basename(ckpt_path))
    write_snapshot(snapshot_path(copy), cfg)
    rebind(copy)  # the private copy's checkpoint binds the replay's snapshot (spec/companions.md)
    shutil.copyfile(os.path.join(run_dir, HISTORY_FILE), os.path.join(work, HISTORY_FILE))


def _compare_guarded(rec: RunRecording, run_dir: str, start: int, to: int, work: str) -> Difference | None:
    """The guarded replay in ``work`` against the recording: the compared rows in order,
    then, over the same timeline to the end, RUN's checkpoint files against the replay's."""
    recorded = rec.rows
    replayed = compared_rows(read_rows(os.path.join(work, HISTORY_FILE))[0])
    for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
        if a != b:
            return row_difference(recorded, replayed, i)
    if len(replayed) > len(recorded):
        extra = replayed[len(recorded)]
        return Difference(
            "rows",
            extra["step"],
            fields=(FieldDiff("row", None, extra),),
            hints=("the replay went on where the recording stopped",),
        )
    if to == rec.last and len(replayed) < len(recorded):
        missing = recorded[len(replayed)]
        return Difference(
            "rows",
            missing["step"],
            fields=(FieldDiff("row", missing, None),),
            hints=("the replay stopped where the recording went on (a rollback bound it did not reach?)",),
        )
    if len(replayed) == len(recorded):  # the same timeline to the end: RUN's files must be the replay's bytes
        return _guarded_file_divergence(run_dir, start, work)
    return None


_ALTERED = (
    "every history row matched, yet the file differs from the replay's: it was altered "
    "after the fact, or state outside the fingerprints was not reproduced"
)


def _guarded_file_divergence(run_dir: str, start: int, work: str) -> Difference | None:
    """The first checkpoint after ``start`` that RUN and the replay both hold and that is not the same checkpoint."""
    mine, theirs = run_checkpoints(work), run_checkpoints(run_dir)
    d = first_checkpoint_difference(mine, theirs, [s for s in set(mine) & set(theirs) if s > start])
    if d is None:
        return None
    path = theirs[d.step]
    return dataclasses.replace(
        d,
        file=path,
        values=f"the replayed {os.path.basename(path)}, compared as ckptkit diff --tensors does",
        hints=(f"every history row matched and {LAYOUT_ONLY}",) if d.layout_only else (_ALTERED,),
    )


def _explain_step(
    cfg: TrainerConfig,
    rec: RunRecording,
    run_dir: str,
    origin: tuple[int, str],
    exempt: frozenset[str],
    log: Log,
    run: Run,
    rs: RunState,
    step: int,
    d: Difference | None,
    out_dir: str | None,
) -> Difference:
    """Explain a step divergence: tensors vs the recording, then the step re-run twice here."""
    done = step + 1
    state = _capture(run, rs, done)
    model_state = {k: v for k, v in state.items() if not k.startswith("grad:")}
    if out_dir is not None:
        rs.save(done)  # the replayed state after the diverging step, for ckptkit diff --tensors
    tensors, values = _tensors_against_recording(rec, run_dir, step, model_state)
    # Re-run the step twice here (replay against replay): is it deterministic in this process?
    with tempfile.TemporaryDirectory(prefix="ckptkit-rerun-") as tmp:
        rerun = rerun_step(cfg, origin[1], origin[0], run_dir, step, tmp, exempt, lambda _m: None)
    hints = []
    if not rerun.identical:
        hints.append(
            "the step is not deterministic in this process: see ReplayDivergence's docstring for the "
            "usual causes (unseeded RNG, nondeterministic kernels, threads)"
        )
    else:
        hints.append(
            "the step is deterministic here, so the recording ran something else: another config, "
            "environment, code version, or a run that was itself nondeterministic"
        )
    return Difference(
        "step",
        step,
        fields=d.fields if d is not None else (),
        tensors=tuple(tensors),
        values=values,
        rerun=rerun,
        hints=tuple(hints),
    )


def _tensors_against_recording(
    rec: RunRecording, run_dir: str, step: int, model_state: dict[str, Any]
) -> tuple[list[TensorReport], str]:
    """The tensors of the state after ``step`` that differ from the recording's digests, and
    where their values came from (RUN's verified checkpoint there) or why there are none."""
    done = step + 1
    digests = leaf_digests(model_state)
    recorded = dict(rec.digests.get(done) or {})
    recorded.update(rec.checkpoint_digests.get(done) or {})
    if not recorded:
        return [], (
            f"the recording holds no digests after step {step}, so the tensors cannot be named "
            "against it (the history predates per-step digests)"
        )
    bad = differing_names(recorded, {k: v for k, v in digests.items() if k in recorded})
    file_state, why = _verified_file_state(run_dir, done, rec)
    if file_state is not None:  # every difference, exactly as ckptkit diff --tensors lists it
        return tensor_reports(
            compare_states(file_state, model_state), {n: (recorded.get(n), digests.get(n)) for n in bad}
        ), why
    return named_reports(bad, recorded, digests, "values unavailable"), (
        f"unavailable: {why}; record with a checkpoint after step {step} (--ckpt-every) to get "
        "max |diff|, or compare replay against replay below"
    )


class _Builder:
    def __init__(
        self,
        run_dir: str,
        ckpt: str,
        start: int,
        to: int,
        overrides: tuple[FieldDiff, ...],
        env: tuple[EnvDiff, ...],
        notes: list[str],
        recorded_env_overrides: Sequence[tuple[int, tuple[str, ...]]],
    ) -> None:
        self.args = (run_dir, ckpt, start, to)
        self.run_dir = run_dir
        self.overrides, self.env, self.notes = overrides, env, notes
        self.recorded_env_overrides = recorded_env_overrides

    def done(self, replayed: int, divergence: Difference | None, *, guarded: bool = False) -> ReplayReport:
        run_dir, ckpt, start, to = self.args
        d = divergence
        recorded_env = [(s, e) for s, e in self.recorded_env_overrides if d is not None and s <= d.step]
        if d is not None and (self.overrides or any(e.fatal for e in self.env) or recorded_env):
            extra = []
            for s, envs in recorded_env:
                extra.append(
                    f"the recording itself continued from step {s} under another environment "
                    f"({'; '.join(envs)}): the likely cause; replay under it (--threads, "
                    "--allow-env-change) to confirm"
                )
            if self.overrides:
                extra.append(
                    "this replay overrides " + ", ".join(o.field for o in self.overrides) + ": the likely cause"
                )
            if any(e.fatal for e in self.env):
                extra.append("the environment differs from the recording (listed above): a likely cause")
            d = dataclasses.replace(d, hints=tuple(extra) + d.hints)
        return ReplayReport(run_dir, ckpt, start, to, replayed, self.overrides, self.env, tuple(self.notes), d, guarded)
