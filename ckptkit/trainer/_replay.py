"""Replay of a recorded trainer run: the command replay of ``ckptkit train --resume``, plus the trainer's hooks.

    ckptkit replay runs/a --from 100                 # re-run 100..end, compare with history.jsonl
    ckptkit replay runs/a --from 100 --to 120 --json
    ckptkit replay runs/a --from 100 --no-perturb     # a config override, reported with the result
    python -c "from ckptkit.trainer._replay import replay; print(replay('runs/a', 100).describe())"

Implements ``spec/replay.md`` R-P05..R-P09 and R-P15 with the one replay engine of any
loop (:func:`ckptkit.audit.replay_command`): RUN's checkpoint at or before
``--from`` (its companions, ``environment.json``, ``history.jsonl``) is copied into a
fresh directory and ``python -m ckptkit train --resume`` -- torchrun with as many ranks
for a run trained under torchrun -- continues it to ``--to`` in a fresh process, with
the checkpoint's own config; every row it records from there on, rollbacks and re-runs
included, and every checkpoint both hold are compared with the recording. RUN is only read.

What the trainer adds: the environment compared with the recording before anything runs
(refused unless ``allow_env_change``, exactly like a resume), config overrides (the
copy's snapshot is rewritten to the replay's config, and the change is reported), the
rollback ring's base checkpoint copied too (so a guarded resume rebuilds it from RUN's
checkpoint, not from step 0), and the hook that explains a divergent step
(:func:`ckptkit.trainer._audit.explain`: values from both sides' checkpoints, the step
re-run twice in this process).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..audit._commands import PLACEHOLDER, AuditReport, ReplayPlan, copy_checkpoint, replay_command, replay_start
from ..audit._recording import RunRecording
from ..errors import EXIT_UNSTABLE, CheckpointError, EnvironmentDrift, ReplayError
from ..format._companions import rebind
from ..format._snapshot import snapshot_path, write_snapshot
from ..run import list_checkpoints, read_environment
from ..run._difference import FieldDiff
from ..run._environment import capture, diff_environment
from ._audit import config_of, explain, knob_flags
from ._config import TrainerConfig
from ._loop import deterministic_torch, intra_op_threads
from ._parallel import launcher

__all__ = ["ReplayError", "config_of", "recorded_world", "replay"]

Log = Callable[[str], None]

ENV_REPLAY_HINT = "pass --allow-env-change to replay anyway (the differences are then listed with the result)"


def recorded_world(run_dir: str | os.PathLike[str]) -> int:
    """The world size ``run_dir`` was trained at (1 when its environment record does not say)."""
    try:
        world = read_environment(run_dir).get("world_size", 1)
    except CheckpointError:
        return 1
    return world if isinstance(world, int) and world >= 1 else 1


def replay(
    run_dir: str | os.PathLike[str],
    from_step: int,
    to_step: int | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    allow_env_change: bool = False,
    threads: int | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    timeout: float = 600.0,
    log: Log | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> AuditReport:
    """Re-run ``run_dir`` from its checkpoint at (or nearest before) ``from_step`` and
    compare every row and checkpoint with the recording; explain the first difference.

    Args:
        run_dir: the recorded run (``history.jsonl``, ``environment.json``, checkpoints).
        from_step: start at the checkpoint at or before this step (steps done).
        to_step: stop when this many steps are done (default: the end of the recording).
        overrides: config keys to change from the snapshot (``{"testing.perturb_at": 3}``);
            reported in the result. Testing what a knob changes is their use.
        allow_env_change: replay even when the environment differs from ``environment.json``.
        threads: run with this intra-op thread count (an environment change: needs
            ``allow_env_change`` unless it equals the recording's).
        out_dir: keep the replay's run directory here (empty or new, outside ``run_dir``).
        timeout: seconds the replaying process may take.
        log: progress notes.
        on_step: called with (steps done, ``to``) as the replay records steps (a progress bar).

    Returns:
        An :class:`~ckptkit.audit.AuditReport` (``what`` "replay"); ``report.ok``
        when every row and checkpoint matched bit for bit.

    Raises:
        CheckpointNotFound: no history, no checkpoint at or before ``from_step``.
        EnvironmentDrift: the environment differs and ``allow_env_change`` is False.
        FormatError: a file of the run is damaged.
        ReplayError: ``to_step`` outside the recording, a bad override, ``out_dir`` inside
            RUN or not empty, flags a torchrun run's replay cannot honour.
        AuditError: the replaying process failed or ran out of time.

    Example::

        report = replay("runs/a", 100)
        print(report.describe()); sys.exit(0 if report.ok else 1)
    """
    run_dir = os.fspath(run_dir)
    world = recorded_world(run_dir)
    if world > 1 and (overrides or threads is not None or allow_env_change):
        raise ReplayError(
            f"{run_dir} was trained by {world} ranks: it is replayed by as many ranks with its own config "
            "and environment, so trainer flags, --threads, --allow-env-change and --no-perturb do not apply"
        )
    rec = RunRecording(run_dir, required=True)
    start, ckpt = replay_start(run_dir, from_step)
    to = rec.last if to_step is None else to_step  # the engine says whether it is in the recording
    cfg, changed = _overrides(config_of(ckpt).replace(**{"train.steps": to}), overrides or {})
    notes: list[str] = []
    inside = sorted({s for s in rec.rollbacks if s >= start})
    if inside:  # the plain re-run of steps would not reproduce these: the guarded loop does (R-P15)
        notes.append(
            f"the recording re-ran or rolled back at step(s) {', '.join(map(str, inside))} (--auto-rollback "
            "on): the replay's guarded loop went through them, every history row compared in order (R-P15)"
        )
    argv = [*launcher(world), "train", "--run-dir", PLACEHOLDER, "--quiet", *knob_flags(cfg), "--resume"]
    argv += ["--resume-check", "off"]  # the replay compares, and reports, itself
    if world == 1:  # a torchrun job's environment is its ranks': they judge it as they resume
        _judge_environment(run_dir, allow_env_change, threads)  # the replay's resume row then records it
        argv.append("--allow-env-change")  # judged here, with replay's own wording
        argv += ["--threads", str(threads)] if threads is not None else []
    plan = ReplayPlan(
        run_dir=run_dir,
        from_step=from_step,
        command=argv,
        to_step=to,
        prepare=functools.partial(_prepare, cfg, run_dir, start, ckpt, bool(changed)),
        accept=(EXIT_UNSTABLE,),  # a recording may have ended so too: its rows say whether it did
        explain=functools.partial(explain, rerun=world == 1, log=log or (lambda _m: None), rerun_in="b"),
        overrides=changed,
        notes=notes,
        on_step=on_step,
        timeout=timeout,
        keep_dir=None if out_dir is None else os.fspath(out_dir),
        log=log,
    )
    return replay_command(plan)


def _judge_environment(run_dir: str, allow: bool, threads: int | None) -> None:
    """The environment (under ``threads``) against the recording's: refused on a difference unless ``allow``.

    Raises:
        EnvironmentDrift: a fact differs and ``allow`` is False.
    """
    with deterministic_torch(), intra_op_threads(threads):  # as the replaying process will run
        diffs = [d for d in diff_environment(read_environment(run_dir), capture()) if d.fatal]
    if diffs and not allow:
        lines = [f"the environment differs from the run's recording in {len(diffs)} fact(s):"]
        lines += [f"  {d}" for d in diffs]
        lines.append(ENV_REPLAY_HINT)
        raise EnvironmentDrift("\n".join(lines), diffs)


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


def _prepare(cfg: TrainerConfig, run_dir: str, start: int, ckpt: str, overridden: bool, work: str) -> None:
    """The copy the replay resumes: its rollback ring's base and, with overrides, the replay's snapshot."""
    # A guarded resume rebuilds its ring by re-running from the newest checkpoint at or before
    # start - K (spec/rollback.md R-R12): RUN's, or it re-runs from step 0.
    base = [p for s, p in list_checkpoints(run_dir) if s <= max(start - cfg.train.rollback_k, 0)]
    if base and base[-1] != ckpt:
        copy_checkpoint(run_dir, base[-1], work)
    if overridden:  # the replay's plan is its own, not drift from the recorded snapshot
        copy = os.path.join(work, os.path.basename(ckpt))
        write_snapshot(snapshot_path(copy), cfg)
        rebind(copy)  # the copy binds the replay's snapshot (spec/companions.md)
