"""Turning command-line paths into checkpoint files (shared by the subcommands)."""

from __future__ import annotations

import os
import re

from ..errors import CheckpointNotFound

__all__ = ["CKPT_RE", "expand_checkpoints"]

#: Checkpoint file names inside a run directory: step-<zero-padded step>.ckpt
CKPT_RE = re.compile(r"^step-(\d{8,})\.ckpt$")


def expand_checkpoints(paths: list[str]) -> list[str]:
    """Files as given; directories replaced by their ``*.ckpt`` files, sorted.

    Raises:
        CheckpointNotFound: a path does not exist, or a directory holds no checkpoint.
    """
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".ckpt") and not n.startswith("."))
            if not found:
                raise CheckpointNotFound(f"{p}: no *.ckpt files in this directory")
            out.extend(found)
        elif os.path.exists(p):
            out.append(p)
        else:
            raise CheckpointNotFound(f"{p}: no such file or directory")
    return out
