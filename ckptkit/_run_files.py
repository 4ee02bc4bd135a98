"""The files of a run directory: checkpoint names, discovery, retention, the environment record.

Private: :class:`ckptkit.runstate.RunState` and the tools that read a run
directory (replay, audit, recording) use these; the public names are re-exported
by :mod:`ckptkit.runstate` (spec/runstate.md "Files in the run directory").
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

from .companions import ENVIRONMENT_FILE
from .errors import CheckpointNotFound, FormatError

__all__ = ["checkpoint_name", "list_checkpoints", "read_environment", "retain"]

_PREFIX, _SUFFIX = "step-", ".ckpt"


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint at ``step``: ``step-00000120.ckpt`` (8+ digits, sortable)."""
    return f"{_PREFIX}{step:08d}{_SUFFIX}"


def read_environment(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The environment facts a run recorded when it started (``environment.json``).

    Raises:
        CheckpointNotFound: the record is missing.
        FormatError: it is not valid JSON.
    """
    env_path = os.path.join(os.fspath(run_dir), ENVIRONMENT_FILE)
    try:
        with open(env_path, encoding="utf-8") as f:
            facts: dict[str, Any] = json.load(f)
            return facts
    except FileNotFoundError:
        raise CheckpointNotFound(f"{env_path}: the run's environment record is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"not valid JSON: {e}", path=env_path, field="environment") from None


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint file in ``run_dir``, oldest first."""
    run_dir = os.fspath(run_dir)
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(run_dir):
            digits = name[len(_PREFIX) : -len(_SUFFIX)]
            if name.startswith(_PREFIX) and name.endswith(_SUFFIX) and digits.isdigit() and len(digits) >= 8:
                out.append((int(digits), os.path.join(run_dir, name)))
    return sorted(out)


def retain(run_dir: str, keep: int, delete: Callable[[str], None], log: Callable[[str], None]) -> None:
    """Delete all but the newest ``keep`` checkpoints, and companions orphaned by a
    crash mid-delete (``delete`` removes a container and its companions). The new
    checkpoint is already committed, so a failure here is reported and retried by the
    next save, never raised."""
    ckpts = list_checkpoints(run_dir)
    for _step, path in ckpts[:-keep]:
        try:
            delete(path)
        except OSError as e:
            log(f"retention: cannot delete {path} ({e.strerror}); will retry at the next save")
    kept = {p for _s, p in list_checkpoints(run_dir)}
    oldest = ckpts[-keep:][0][0] if ckpts else None
    for name in sorted(os.listdir(run_dir)):
        head, sep, _kind = name.partition(_SUFFIX + ".")
        container = os.path.join(run_dir, head + _SUFFIX)
        digits = head[len(_PREFIX) :]
        if (
            sep
            and head.startswith(_PREFIX)
            and digits.isdigit()
            and container not in kept
            and oldest is not None
            and int(digits) < oldest
        ):
            try:
                os.unlink(os.path.join(run_dir, name))
            except FileNotFoundError:
                pass
            except OSError as e:
                log(f"retention: cannot delete orphan {name} ({e.strerror})")
