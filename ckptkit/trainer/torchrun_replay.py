"""Replay of a run trained under torchrun: its ranks are launched again, from one of its checkpoints.

    ckptkit replay runs/d --from 20            # a 2-rank run is replayed by a 2-rank torchrun job
    ckptkit replay runs/d --from 20 --to 30 --json

``ckptkit replay`` re-runs a one-process run inside its own process
(:mod:`ckptkit.trainer.replay`). A run trained by W ranks (its ``environment.json``
records ``world_size``) is replayed by W ranks, at the same world size: its checkpoint
at or before ``--from`` (the ``.dcp`` directory and its companions), ``environment.json``
and ``history.jsonl`` are copied into a fresh directory, and ``torchrun --nproc_per_node
W -m ckptkit train --resume``, with the checkpoint's own config, continues it to ``--to``
(default: the end of the recording). The replay's history rows from the checkpoint on
are compared with the recording's, in order (:func:`ckptkit.audit.recording.first_difference`),
then every checkpoint both hold after the start, file by file (spec/trainer.md R-T14).
RUN is only read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable

from ..audit.commands import CommandReport, _workdir  # the same work directory rule as `replay -- CMD`
from ..audit.recording import RunRecording, checkpoint_difference, first_difference
from ..errors import AuditError, CheckpointError, CheckpointNotFound, ReplayError
from ..run import ENVIRONMENT_FILE, read_environment
from ..run.difference import Difference
from ..run.files import run_checkpoints
from ..run.history import HISTORY_FILE
from .audit import knob_flags
from .parallel import launcher, stop_job
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


def _copy_start(run_dir: str, ckpt: str, work: str) -> None:
    """The checkpoint (directory and companions), the environment record and the history, into ``work``."""
    name = os.path.basename(ckpt)
    for f in sorted(os.listdir(run_dir)):
        if f.startswith(name) or f in (ENVIRONMENT_FILE, HISTORY_FILE):
            src, dst = os.path.join(run_dir, f), os.path.join(work, f)
            shutil.copytree(src, dst) if os.path.isdir(src) else shutil.copy2(src, dst)


def _run(argv: list[str], timeout: float, log: Log) -> None:
    log(f"replay: {' '.join(argv)}")
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_job(proc)
            raise AuditError(f"the replay did not finish within {timeout:g} s (--timeout)") from None
        except BaseException:
            stop_job(proc)
            raise
        if code != 0:
            err.seek(0)
            tail = err.read().decode("utf-8", "replace").strip().splitlines()[-15:]
            raise AuditError(f"the replay's `ckptkit train` exited {code}:\n" + "\n".join(tail))


def replay_ranks(
    run_dir: str | os.PathLike[str],
    from_step: int,
    to_step: int | None = None,
    *,
    timeout: float = 600.0,
    keep_dir: str | None = None,
    log: Log | None = None,
) -> CommandReport:
    """Replay a torchrun run from its checkpoint at (or before) ``from_step`` with as many ranks as it had.

    Returns:
        A report whose ``difference`` is the first row or checkpoint that differs, or None.

    Raises:
        CheckpointNotFound: no checkpoint at or before ``from_step``.
        ReplayError: ``to_step`` before that checkpoint.
        AuditError: ``keep_dir`` not empty, or the torchrun job failed or ran out of time.
    """
    log = log or (lambda _m: None)
    run_dir = os.fspath(run_dir)
    world = recorded_world(run_dir)
    ckpts = run_checkpoints(run_dir)
    before = [s for s in ckpts if s <= from_step]
    if not before:
        have = ", ".join(map(str, sorted(ckpts))) or "none"
        raise CheckpointNotFound(f"{run_dir}: no checkpoint at or before step {from_step} (checkpoints: {have})")
    start = max(before)
    rec = RunRecording(run_dir)
    end = to_step if to_step is not None else max([start] + [r["step"] + 1 for r in rec.rows if r["kind"] == "step"])
    if end < start:
        raise ReplayError(f"--to {end} is before the checkpoint the replay starts from (step {start})")
    rec.rows = [r for r in rec.rows if r["step"] < end or (r["kind"] == "digests" and r["step"] == end)]
    cfg = config_of(ckpts[start]).replace(**{"train.steps": end})
    with _workdir(keep_dir, "ckptkit-replay-") as base:
        work = os.path.join(base, "replay")
        os.makedirs(work)
        _copy_start(run_dir, ckpts[start], work)
        argv = [*launcher(world), "train", "--run-dir", work, "--quiet", *knob_flags(cfg), "--resume"]
        _run(argv, timeout, log)
        got = RunRecording(work)
        both = [s for s in sorted(set(ckpts) & set(run_checkpoints(work))) if start < s <= end]
        difference = first_difference(rec, got, from_step=start) or _checkpoint_difference(run_dir, work, both)
        compared = len([r for r in got.rows if r["step"] >= start])
        return CommandReport("replay", tuple(argv), end, start, compared, len(both), difference, keep_dir)


def _checkpoint_difference(run_dir: str, work: str, steps: list[int]) -> Difference | None:
    ca, cb = run_checkpoints(run_dir), run_checkpoints(work)
    return next((d for s in steps if (d := checkpoint_difference(s, ca[s], cb[s])) is not None), None)
