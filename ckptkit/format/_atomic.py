"""Crash-safe file replacement (spec/guarantees.md).

A file is written to a temporary name in its destination directory, flushed,
fsync'd, renamed over the destination and the directory is fsync'd. A crash at
any point leaves either the old file or the new one, never a torn one; after
:func:`atomic_write` returns the new file survives power loss.

Temporary names are ``.<name>.tmp.<pid>.<token>`` so that :func:`clean_stale_temps`
can remove what a killed writer left behind without touching a live writer's file.

A directory is replaced by :func:`exchange`: the new one is built beside it, then
the two names are swapped in one atomic step (``renameat2(RENAME_EXCHANGE)`` on
Linux, ``renamex_np(RENAME_SWAP)`` on macOS), so the name always holds one of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterator
from typing import BinaryIO

from ..errors import SaveFailed

__all__ = [
    "atomic_write",
    "clean_stale_temps",
    "create_exclusive",
    "exchange",
    "fsync_dir",
    "pid_alive",
    "write_bytes_atomic",
]

_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp\.(?P<pid>\d+)\.[0-9a-f]{8}$")


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp.{os.getpid()}.{secrets.token_hex(4)}")


def fsync_dir(directory: str) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _temp_file(path: str) -> Iterator[tuple[BinaryIO, str]]:
    tmp = _temp_name(path)
    try:
        f = open(tmp, "xb")  # noqa: SIM115 - closed below, on every path
    except FileNotFoundError as e:
        folder = os.path.dirname(path) or "."
        raise SaveFailed(
            f"{path}: the folder {folder} does not exist; create it first (os.makedirs({folder!r}, exist_ok=True)): "
            "ckptkit does not create it, so that a mistyped or unmounted path is an error, not checkpoints on the "
            "wrong disk",
            cause=e,
            path=path,
        ) from e
    except OSError as e:
        raise SaveFailed(f"{path}: cannot create temporary file: {e.strerror}", cause=e, path=path) from e
    try:
        yield f, tmp
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    f.close()


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Write a file through ``write(f)`` so that it appears whole or not at all.

    Args:
        path: destination; its directory must exist.
        write: fills the open binary file; it may seek and write at offsets.

    Raises:
        SaveFailed: any OSError while writing, syncing or renaming (ENOSPC, EIO,
            EACCES...). The temporary file is removed and the previous file at
            ``path`` is untouched. Other exceptions from ``write`` propagate
            unchanged, with the same cleanup.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    with _temp_file(path) as (f, tmp):
        try:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            what = errno.errorcode.get(e.errno or 0, "I/O error")
            raise SaveFailed(
                f"{path}: write failed ({what}: {e.strerror}); the previous file is intact",
                cause=e,
                path=path,
            ) from e
    try:
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise SaveFailed(
            f"{path}: cannot commit the new file ({e.strerror}); the previous file is intact", cause=e, path=path
        ) from e
    try:
        fsync_dir(directory)
    except OSError as e:  # the rename happened: the new file is whole, its durability unknown
        raise SaveFailed(
            f"{path}: the new file is in place but the directory could not be synced "
            f"({e.strerror}); it may not survive a power loss",
            cause=e,
            path=path,
        ) from e


def exchange(a: str, b: str) -> None:
    """Swap the names ``a`` and ``b`` (two directories of one filesystem) in one atomic step.

    There is no portable call for it: a rename over a non-empty directory fails, and two
    renames leave a moment with nothing at one of the names.

    Raises:
        SaveFailed: the platform or filesystem cannot swap atomically, or the swap failed;
            both names are as they were.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    ea, eb = os.fsencode(a), os.fsencode(b)
    if sys.platform == "linux" and hasattr(libc, "renameat2"):
        rc = libc.renameat2(-100, ea, -100, eb, 2)  # AT_FDCWD, RENAME_EXCHANGE
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(ea, eb, 2)  # RENAME_SWAP
    else:
        raise SaveFailed(
            f"{b}: cannot replace a directory atomically on this platform ({sys.platform}: no renameat2 or "
            "renamex_np); save into a new directory instead",
            path=b,
        )
    if rc != 0:
        code = ctypes.get_errno()
        raise SaveFailed(
            f"{b}: cannot swap in its replacement {a} ({errno.errorcode.get(code, code)}: {os.strerror(code)}); "
            "the previous directory is intact",
            cause=OSError(code, os.strerror(code)),
            path=b,
        )


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (see :func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))


def create_exclusive(path: str | os.PathLike[str], data: bytes) -> bool:
    """Create ``path`` holding ``data``, whole, only if nothing is there: written to a temp
    file, fsync'd and hard-linked into place (a link never replaces), then the directory is
    fsync'd. Returns False, writing nothing, when ``path`` exists: the local form of an
    object store's conditional put (``If-None-Match: *``).

    Raises:
        SaveFailed: the write failed (nothing is left at ``path``).
    """
    path = os.fspath(path)
    with _temp_file(path) as (f, tmp):
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as e:
        raise SaveFailed(f"{path}: cannot create it ({e.strerror})", cause=e, path=path) from e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(path))
    return True


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (this process's own pid: always)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(directory: str | os.PathLike[str]) -> list[str]:
    """Remove temporary files that a killed writer left in ``directory``.

    A temp file whose writer process is still alive is kept (it may be mid-save).

    Returns:
        The paths removed, sorted.
    """
    directory = os.fspath(directory)
    removed = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        m = _TEMP_RE.match(name)
        if m and not pid_alive(int(m.group("pid"))):
            full = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
                removed.append(full)
    return removed
