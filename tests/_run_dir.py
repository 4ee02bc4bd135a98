"""A run directory with special files in it: the helpers its tests share.

Used by tests/run/test_run_dir_special_files.py and tests/run/test_run_dir_state_machine.py.
Unreadable files: see the first one's docstring (root reads as ``nobody``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from helpers import linear_run

from ckptkit import CheckpointNotFound
from ckptkit.cli import main
from ckptkit.run import RunState

NOBODY = 65534


ROOT_USER = os.geteuid() == 0


def make_run(run_dir: Path) -> tuple[RunState, torch.nn.Linear]:
    return linear_run(run_dir)


@contextlib.contextmanager
def no_hang(seconds: float = 20.0) -> Iterator[None]:
    """Fail (never wait) if the block blocks: a FIFO opened for reading waits for a writer."""

    def fire(*_: Any) -> None:
        raise AssertionError(f"blocked for {seconds} s (a FIFO or device opened and waited on)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def as_reader(nobody: bool) -> Iterator[None]:
    """With ``nobody``, read as a user a ``chmod 000`` stops: root's effective uid becomes nobody's
    for the block (the run directory must then be one nobody may enter: :func:`shared_run`)."""
    if not (nobody and ROOT_USER):
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def make_special(path: Path, kind: str) -> None:
    """Put ``kind`` where ``path`` was: a FIFO, a directory, a symlink to /dev/zero, an unreadable file."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        if kind == "unreadable":
            path.chmod(0)
            return
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(b"x")
        path.chmod(0)


def verify_run(run_dir: Path, nobody: bool = False) -> tuple[int, dict[str, Any]]:
    """``verify RUN --json``: its exit code and document (empty for a directory with no checkpoint: exit 2)."""
    out, err = io.StringIO(), io.StringIO()
    with no_hang(), as_reader(nobody), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", str(run_dir), "--json"])
    if code == 2:
        assert err.getvalue() == f"ckptkit verify: {run_dir}: no *.ckpt files in this directory\n", err.getvalue()
        return code, {"files": [], "companions": []}
    return code, json.loads(out.getvalue())


def failed(doc: dict[str, Any]) -> set[str]:
    """The checkpoints ``verify --json`` fails: the container, a sidecar beside it, or a companion it binds."""
    bad = {f["path"] for f in doc["files"] if not f["ok"]}
    ckpts = {f["path"] for f in doc["files"] if f["path"].endswith(".ckpt")}
    ckpts |= {c for e in doc["companions"] for c in e["checkpoints"]}
    out = {c for c in ckpts if c in bad or any(p.startswith(c + ".") for p in bad)}
    return out | {c for e in doc["companions"] if not e["ok"] for c in e["checkpoints"]}


def resume_run(run_dir: Path, nobody: bool = False) -> tuple[RunState | None, Any, torch.nn.Linear]:
    """(the resumed run, its ResumeInfo, its model) or (None, the NoConsistentCheckpoint, ...);
    anything else fails the test."""
    rs, net = make_run(run_dir)
    with no_hang(), as_reader(nobody):
        try:
            return rs, rs.resume(), net
        except CheckpointNotFound as e:  # none at all, or NoConsistentCheckpoint: every one damaged
            return None, e, net
