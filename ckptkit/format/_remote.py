"""One checkpoint file at an ``s3://`` URL: the object-storage side of ``save``/``load``/``verify``/``open_checkpoint``.

``save("s3://bkt/run/model.ckpt", ckpt)`` writes the same container bytes a local save
writes (R-O18), spooled through an anonymous temporary file whose parts go up as they are
written (R-O52), as the object ``run/model.ckpt``, then commits it with its record
``run/model.ckpt.commit.json``
(:mod:`ckptkit.format._commit`). A read fetches the record, then the object, and checks
its size and xxh3-64 before a byte of it is parsed (R-O14); the container's own digests
are then checked as for a local file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from ._commit import Entry, commit, fetch, read_record
from ._io import Source
from ._objectstore import ObjectStore, store_for
from ._urls import StorageURL, parse

__all__ = ["fetched", "locate", "put_checkpoint", "remote_source"]


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
    """Write a checkpoint through ``write(f)`` into a temporary file and commit it at ``path``, each
    part uploaded from the file as soon as the writer has written it for good (R-O51, R-O52).

    Raises:
        CommitConflict: a checkpoint is committed at ``path`` already (R-O11).
        SaveFailed: a storage write failed; nothing at ``path`` is committed.
    """
    store, base, name = locate(path)
    commit(store, base, name, write)


def remote_source(path: str | os.PathLike[str]) -> Source:
    """The committed checkpoint object at ``path``, its size and digest checked (R-O14), as a
    :class:`Source` named by the URL (see :func:`fetched`).

    Raises:
        CheckpointNotFound: nothing is at ``path``.
        IncompleteCheckpoint: objects without a commit record (an interrupted save), or a
            listed object is missing.
        ChecksumMismatch, FormatError: the object or its record is damaged (named).
    """
    store, base, name = locate(path)
    entry = next(e for e in read_record(store, base, name) if e.key == name)  # listed first (R-O13)
    return fetched(store, base, entry)


def fetched(store: ObjectStore, base: StorageURL, entry: Entry) -> Source:
    """The listed object ``entry``, checked (R-O14), streamed into an unlinked temporary file
    (R-O51) that the returned :class:`Source` reads and maps as a local file's; named by its URL.

    Raises:
        IncompleteCheckpoint, ChecksumMismatch, FormatError: as :func:`~ckptkit.format._commit.fetch`.
    """
    folder = tempfile.mkdtemp(prefix="ckptkit-")
    try:
        path = os.path.join(folder, "object")
        fetch(store, base, entry, path)
        src = Source(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    src.path = str(base.child(entry.key))
    return src
