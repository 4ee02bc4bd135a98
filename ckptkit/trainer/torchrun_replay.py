"""Replay of a run trained under torchrun: its ranks are launched again, from one of its checkpoints.

    ckptkit replay runs/d --from 20            # a 2-rank run is replayed by a 2-rank torchrun job
    ckptkit replay runs/d --from 20 --to 30 --json

``ckptkit replay`` re-runs a one-process run inside its own process
(:mod:`ckptkit.trainer.replay`). A run trained by W ranks (its ``environment.json``
records ``world_size``) is replayed by W ranks, at the same world size, by the one
replay engine of any command (:func:`ckptkit.audit.commands.replay_command`): its
checkpoint at or before ``--from`` (the ``.dcp`` directory and its companions),
``environment.json`` and ``history.jsonl`` are copied into a fresh directory, and
``torchrun --nproc_per_node W -m ckptkit train --resume``, with the checkpoint's own
config, continues it to ``--to`` (default: the end of the recording); its rows and
checkpoints are compared with the recording's (spec/trainer.md R-T14). RUN is only read.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..audit.commands import PLACEHOLDER, AuditReport, replay_command, replay_start
from ..audit.recording import RunRecording
from ..errors import CheckpointError, ReplayError
from ..run import read_environment
from .audit import knob_flags
from .parallel import launcher
from .replay import config_of

__all__ = ["recorded_world", "replay_ranks"]

Log = Callable[[str], None]


def recorded_world(run_dir: str | os.PathLike[str]) -> int:
    """The world size ``run_dir`` was trained at (1 when its environment record does not say)."""
    try:
        world = read_environment(run_dir).get("world_size", 1)
    except CheckpointError:
        return 1
    return world if isinstance(world, int) and world >= 1 else 1


def replay_ranks(
    run_dir: str | os.PathLike[str],
    from_step: int,
    to_step: int | None = None,
    *,
    timeout: float = 600.0,
    keep_dir: str | None = None,
    log: Log | None = None,
) -> AuditReport:
    """Replay a torchrun run from its checkpoint at (or before) ``from_step`` with as many ranks as it had.

    Returns:
        A report whose ``divergence`` is the first row or checkpoint that differs, or None.

    Raises:
        CheckpointNotFound: no checkpoint at or before ``from_step``.
        ReplayError: ``to_step`` before that checkpoint.
        AuditError: ``keep_dir`` not empty, or the torchrun job failed or ran out of time.
    """
    run_dir = os.fspath(run_dir)
    start, ckpt = replay_start(run_dir, from_step)
    end = to_step if to_step is not None else max(start, RunRecording(run_dir).last)
    if end < start:
        raise ReplayError(f"--to {end} is before the checkpoint the replay starts from (step {start})")
    cfg = config_of(ckpt).replace(**{"train.steps": end})
    argv = [*launcher(recorded_world(run_dir)), "train", "--run-dir", PLACEHOLDER, "--quiet", *knob_flags(cfg)]
    return replay_command(
        run_dir, from_step, [*argv, "--resume"], to_step=end, timeout=timeout, keep_dir=keep_dir, log=log
    )
