"""One checkpoint file at an ``s3://`` URL: the object-storage side of ``save``/``load``/``verify``/``open_checkpoint``.

``save("s3://bkt/run/model.ckpt", ckpt)`` writes the same container bytes a local save
writes (R-O18), spooled through an anonymous temporary file, as the object
``run/model.ckpt``, then commits it with its record ``run/model.ckpt.commit.json``
(:mod:`ckptkit.format._commit`). A read fetches the record, then the object, and checks
its size and xxh3-64 before a byte of it is parsed (R-O14); the container's own digests
are then checked as for a local file.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from ._commit import commit, read_committed
from ._objectstore import ObjectStore, store_for
from ._urls import StorageURL, parse

__all__ = ["get_checkpoint", "locate", "put_checkpoint", "spool"]


def locate(path: str | os.PathLike[str]) -> tuple[ObjectStore, StorageURL, str]:
    """``(store, prefix, name)`` of the checkpoint at a URL.

    Raises:
        UnsupportedOption: not a served URL, no object name, or the S3 client is missing.
    """
    url = parse(path)
    if not url.key:
        from ..errors import UnsupportedOption

        raise UnsupportedOption(f"{url}: names a bucket, not a checkpoint (expected s3://bucket/prefix/name.ckpt)")
    return store_for(url), url.parent, url.name


def put_checkpoint(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Write a checkpoint through ``write(f)`` into a temporary file, then commit it at ``path``.

    Raises:
        CommitConflict: a checkpoint is committed at ``path`` already (R-O11).
        SaveFailed: a storage write failed; nothing at ``path`` is committed.
    """
    store, base, name = locate(path)
    with tempfile.TemporaryFile(prefix="ckptkit-") as f:
        write(f)
        f.flush()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:  # a container is never empty
            data = memoryview(view)
            try:
                commit(store, base, name, [(name, data)])
            finally:
                data.release()


def get_checkpoint(path: str | os.PathLike[str]) -> bytes:
    """The committed checkpoint object at ``path``, its size and digest checked (R-O14).

    Raises:
        CheckpointNotFound: nothing is at ``path``.
        IncompleteCheckpoint: objects without a commit record (an interrupted save), or a
            listed object is missing.
        ChecksumMismatch, FormatError: the object or its record is damaged (named).
    """
    store, base, name = locate(path)
    return read_committed(store, base, name, only=[name])[name]


def spool(data: bytes) -> str:
    """``data`` in a new temporary file (for a reader that maps a file); the caller unlinks it."""
    fd, tmp = tempfile.mkstemp(prefix="ckptkit-", suffix=".ckpt")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp
