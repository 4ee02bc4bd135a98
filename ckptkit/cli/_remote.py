"""``ckptkit verify`` and ``inspect`` on ``s3://`` URLs: a checkpoint object, or a run prefix.

Every committed checkpoint under a prefix is checked object by object against its commit
record (size and xxh3-64, R-O14), and its container byte by byte as a local file is; a
checkpoint whose objects have no record is reported as not committed (R-O15), naming them.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointNotFound, FormatError, IncompleteCheckpoint
from ..format._commit import RECORD_SUFFIX, Entry, listing, read_record
from ..format._io import Source
from ..format._objectstore import ObjectStore, store_for
from ..format._place import place_and_name, place_for
from ..format._remote import fetched
from ..format._urls import StorageURL, parse
from ..format._verify import Report, layout_report, verify_source
from ..run._files import CKPT_SUFFIX, DCP_SUFFIX

__all__ = ["inspect_distributed", "verify_urls"]


def verify_urls(urls: list[str]) -> list[Report]:
    """One report per object of every checkpoint at or under each URL.

    Raises:
        CheckpointNotFound: a URL that is neither a checkpoint nor a prefix holding one.
    """
    return [r for text in urls for r in _verify_url(text)]


def _is_checkpoint(store: ObjectStore, url: StorageURL) -> bool:
    return bool(url.key) and any(store.head(url.key + s) is not None for s in (RECORD_SUFFIX, ""))


def _verify_url(text: str) -> list[Report]:
    url = parse(text)
    store = store_for(url)
    if _is_checkpoint(store, url):
        return _verify_checkpoint(store, url.parent, url.name)
    names = {**listing(store, url, CKPT_SUFFIX), **listing(store, url, DCP_SUFFIX)}  # one process, or distributed
    if not names:
        raise CheckpointNotFound(
            f"{text}: no checkpoint there (no object {url.name or text}, no step-*.ckpt or step-*.dcp under it)"
        )
    return [r for name in sorted(names) for r in _verify_checkpoint(store, url, name)]


def _verify_checkpoint(store: ObjectStore, base: StorageURL, name: str) -> list[Report]:
    """The container's report and one per companion object; a record problem is one failed report."""
    try:
        entries = read_record(store, base, name)
    except (IncompleteCheckpoint, FormatError) as e:
        return [layout_report(str(base.child(name)), 0, None, e, 0)]
    out = []
    for entry in entries:
        where = str(base.child(entry.key))
        try:
            src = fetched(store, base, entry)
        except (IncompleteCheckpoint, FormatError) as err:
            out.append(layout_report(where, entry.size, None, err, 0))
            continue
        with src:
            out.append(_verify_object(where, entry, src, name))
    return out


def _verify_object(where: str, entry: Entry, src: Source, name: str) -> Report:
    """The report of one listed object, its size and digest checked already (R-O14)."""
    if entry.key == name and name.endswith(DCP_SUFFIX):
        return _verify_distributed(where, entry.size)
    if entry.key == name:
        return verify_source(where, src)
    return Report(where, True, None, None, None, (), False, (), (), entry.size, entry.size, kind="object")


def _verify_distributed(where: str, size: int) -> Report:
    """A ``ckptkit.distributed`` checkpoint's metadata object: its listed objects fetched (each
    checked) into its place's stage, which is verified as a local directory (R-DC22, R-DC24)."""
    from ..distributed._format import read_metadata, verify_directory
    from ..distributed._objects import RemoteCheckpoint, check_listed, local_name

    remote = RemoteCheckpoint.at(where)
    place = place_for(str(remote.base))
    try:
        path = place.fetch(remote.name, local_name)
        report = verify_directory(path)
        if report.ok:
            check_listed(remote, remote.entries(), read_metadata(path, check_files=False))
    except (IncompleteCheckpoint, FormatError) as e:
        return layout_report(where, size, None, e, 0)
    finally:
        place.close()
    if report.error is not None:
        return layout_report(where, size, None, report.error, 0)
    return Report(where, True, None, None, None, (), False, (), (), size, size, kind="object")


def inspect_distributed(text: str, as_json: bool, size: Any) -> int:
    """``ckptkit inspect`` of a ``ckptkit.distributed`` checkpoint at ``text`` that is no local
    directory: on object storage its record, then its metadata object alone (checked against the
    record, R-O33) in its place's stage, shown as a local directory is."""
    from ..distributed._objects import local_name
    from ._distributed import inspect_directory

    place, name = place_and_name(text)
    try:
        path = place.fetch(name, local_name, only=lambda key: key == name)
        return inspect_directory(path, as_json, size, shown=place.child(name))
    finally:
        place.close()
