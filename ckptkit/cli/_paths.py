"""Turning command-line paths into checkpoint files (shared by the subcommands)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Mapping

from ..errors import CheckpointNotFound
from ..format._place import list_run_dir, local_only, place_for
from ..run._files import DAMAGED
from ._copies import Select, local_copy

__all__ = ["Copies", "copy_urls", "expand_checkpoints", "refuse_urls"]

#: A command's arguments read through a local copy (its ``URL_COPIES``): the steps it needs, given its arguments.
Copies = Mapping[str, Callable[[argparse.Namespace], Select]]


def _is_checkpoint_or_sidecar(name: str) -> bool:
    if name.startswith((".", DAMAGED)):  # a damaged step's piece a save set aside is no checkpoint
        return False
    if name.endswith(".ckpt"):
        return True
    stem, _, kind = name.rpartition(".ckpt.")
    return bool(stem) and kind.isidentifier()  # step-N.ckpt.ngram, not step-N.ckpt.config.json


def expand_checkpoints(paths: list[str]) -> list[str]:
    """Files as given; directories replaced by their checkpoints and sidecars, sorted.

    Raises:
        CheckpointNotFound: a path does not exist, or a directory holds no checkpoint.
    """
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(p, n) for n in list_run_dir(p) if _is_checkpoint_or_sidecar(n))
            if not found:
                raise CheckpointNotFound(f"{p}: no *.ckpt files in this directory")
            out.extend(found)
        elif _there(p):  # a symlink loop, a file in a directory this user may not search: the reader says which
            out.append(p)
        else:
            raise CheckpointNotFound(f"{p}: no such file or directory")
    return out


def _there(path: str) -> bool:
    """Whether ``path`` may exist: anything but "no such file" (``lexists`` is False for a file
    under a directory that cannot be searched, which does exist: the reader reports EACCES)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def refuse_urls(args: argparse.Namespace, *, served: tuple[str, ...]) -> None:
    """Every ``scheme://`` argument of a command is an object-storage URL, never a local folder
    (spec/objectstore.md R-O01): an argument in ``served`` (the command's ``URL_ARGS``) checks
    the scheme and the client, every other one is refused by name. The command after ``--``
    (audit, replay) is the user's.

    Raises:
        UnsupportedOption: the first URL the command cannot serve.
    """
    for name, value in sorted(vars(args).items()):
        if name in ("cmd", "command"):
            continue
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str):
                continue
            if name in served:
                place_for(item)  # a URL's scheme and client checked here, before the command starts
            else:
                local_only(item, f"ckptkit {args.command}")


def copy_urls(args: argparse.Namespace, copies: Copies, stack: contextlib.ExitStack[bool | None]) -> None:
    """Each ``s3://`` argument named in ``copies`` (a recorded run or checkpoint the command only
    reads) becomes a verified local copy for as long as ``stack`` is open, said on one line
    (spec/objectstore.md R-O40..R-O43): the command reads it as it reads a local run.

    Raises:
        CheckpointNotFound, ChecksumMismatch, FormatError: what the copy could not read, by URL.
    """
    for name, select in sorted(copies.items()):
        value = getattr(args, name, None)
        if isinstance(value, str) and place_for(value).fetches:
            copied = stack.enter_context(local_copy(value, select(args)))
            print(f"ckptkit {args.command}: {copied.describe()}", file=sys.stderr)
            setattr(args, name, copied.path)
