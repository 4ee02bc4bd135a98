"""The commit record: how a checkpoint on object storage commits without a rename.

A checkpoint named ``N`` under a prefix is its data objects (``N`` and its companions
``N.<suffix>``), written first with conditional puts, and then its commit record
``N.commit.json``, written once with ``If-None-Match: *``: the record lists every
object's key, size and xxh3-64, and its creation is the commit (spec/objectstore.md
R-O10..R-O19). A reader trusts only what a record lists and checks every object's size
and digest as it reads it; objects go up from and come down into files a part at a time, never
whole in memory (R-O51); objects without a record are an incomplete save, which the
next save of that name removes. Retention removes the record first, then the objects.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

from ..errors import CheckpointNotFound, ChecksumMismatch, CommitConflict, FormatError, IncompleteCheckpoint
from ._checks import is_int
from ._json import loads_bounded
from ._objectstore import Body, FileSpan, ObjectStore, piece
from ._urls import StorageURL

__all__ = [
    "RECORD_FORMAT",
    "RECORD_SUFFIX",
    "STALE_AFTER",
    "Entry",
    "Written",
    "begin",
    "commit",
    "commit_begun",
    "decode_record",
    "encode_record",
    "fetch",
    "fetch_committed",
    "leftovers",
    "listing",
    "put_written",
    "read_range",
    "read_record",
    "remove",
    "sweep",
]

#: The record of checkpoint ``N`` is the object ``N.commit.json`` (R-O10).
RECORD_SUFFIX = ".commit.json"
RECORD_FORMAT = "ckptkit-commit"
_VERSION = 1
_MAX_RECORD = 1 << 20  # a record of a few thousand objects is ~100 KiB (R-O13)
_SIZE_END = 2**64  # an entry's size is a u64 (R-O47)
#: A save removes another save's objects without a record only once the newest is this old
#: (seconds): younger ones are a live writer's (R-O16). A resume removes them at once.
STALE_AFTER = 60.0


@dataclass(frozen=True)
class Entry:
    """One object a commit record lists: its key (relative to the record's prefix), size, xxh3-64."""

    key: str
    size: int
    xxh3: int


def encode_record(name: str, entries: Iterable[Entry]) -> bytes:
    """The record's exact bytes (R-O12): canonical JSON, keys sorted, no spaces, objects by key, one newline."""
    objects = [{"key": e.key, "size": e.size, "xxh3": f"{e.xxh3:016x}"} for e in sorted(entries, key=lambda e: e.key)]
    doc = {"checkpoint": name, "format": RECORD_FORMAT, "objects": objects, "version": _VERSION}
    return (json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode("ascii")


def decode_record(data: bytes, where: str, name: str) -> list[Entry]:
    """A record's entries, every rule of R-O12/R-O13 and R-O46/R-O48 checked, with bounded work.

    Raises:
        FormatError: not this format, another checkpoint's record, an object outside the
            checkpoint, a bad size or digest field; the message names the record, field and rule.
    """

    def bad(field: str, expected: object, actual: object, rule: str = "R-O13") -> FormatError:
        return FormatError(
            "not a valid commit record", path=where, field=field, expected=expected, actual=_short(actual), hint=rule
        )

    if len(data) > _MAX_RECORD:
        raise FormatError("commit record too large", path=where, expected=f"<= {_MAX_RECORD}", actual=len(data))
    doc = _document(data, bad)
    if doc.get("format") != RECORD_FORMAT:
        raise bad("format", RECORD_FORMAT, doc.get("format"))
    if sorted(doc) != sorted(_TOP):
        raise bad("keys", ", ".join(sorted(_TOP)), ", ".join(sorted(doc)))
    if not is_int(doc["version"]) or doc["version"] != _VERSION:
        raise bad("version", _VERSION, json.dumps(doc["version"]))
    if doc["checkpoint"] != name:
        raise bad("checkpoint", name, doc["checkpoint"])
    objects = doc["objects"]
    if not isinstance(objects, list) or not objects:
        raise bad("objects", "a non-empty list", objects)
    entries = [_entry(o, name, bad) for o in objects]
    if [e.key for e in entries] != sorted({e.key for e in entries}) or entries[0].key != name:
        raise bad("objects", f"distinct keys, sorted, the first {name!r}", [e.key for e in entries])
    if encode_record(name, entries) != data:
        raise bad("bytes", "the canonical encoding of its contents", "other bytes", "R-O12")
    return entries


#: The record's top-level keys, exactly (R-O12, R-O13).
_TOP = ("checkpoint", "format", "objects", "version")
#: The record's own shape nests 3 levels: the document, its ``objects`` list, an entry (R-O46).
_MAX_NESTING = 3
_BOUNDED = f"at most {_MAX_NESTING} levels of nesting, integers of at most 20 digits, no NaN"
#: A companion's suffix: dot-separated non-empty words of letters, digits, ``_`` and ``-`` (R-O48).
_SUFFIX = re.compile(r"\w+(?:[.-]\w+)*")


def _document(data: bytes, bad: Callable[..., FormatError]) -> dict[str, Any]:
    """The record's top-level object, decoded with bounded nesting (R-O12, R-O46)."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise bad("json", "canonical ASCII JSON", "UnicodeDecodeError", "R-O12") from None
    try:
        doc = loads_bounded(text, _MAX_NESTING)
    except json.JSONDecodeError:
        raise bad("json", "canonical ASCII JSON", "JSONDecodeError", "R-O12") from None
    except ValueError as e:  # deeper nesting, a longer integer, NaN, Infinity
        raise bad("json", _BOUNDED, e, "R-O46") from None
    if not isinstance(doc, dict):
        raise bad("format", RECORD_FORMAT, type(doc).__name__)
    return doc


def _short(value: object) -> object:
    """A value as an error shows it: whole up to 80 characters, else its start and its length."""
    text = str(value)
    return value if len(text) <= 80 else f"{text[:40]}... ({len(text)} characters)"


def _entry(obj: object, name: str, bad: Callable[..., FormatError]) -> Entry:
    if not isinstance(obj, dict) or sorted(obj) != ["key", "size", "xxh3"]:
        raise bad("objects[]", "{key, size, xxh3}", obj)
    key, size, digest = obj["key"], obj["size"], obj["xxh3"]
    if not isinstance(key, str) or not (key == name or key.startswith(name + ".")) or "/" in key:
        raise bad("objects[].key", f"{name} or {name}.<companion>", key)
    if key != name and not _SUFFIX.fullmatch(key[len(name) + 1 :]):
        raise bad("objects[].key", f"{name}.<suffix> of dot-separated letters, digits, _ and -", repr(key), "R-O48")
    if not is_int(size):
        raise bad("objects[].size", "an integer >= 0", size)
    if size >= _SIZE_END:
        raise bad("objects[].size", "an integer below 2^64", size, "R-O47")
    if not isinstance(digest, str) or len(digest) != 16 or digest.strip("0123456789abcdef"):
        raise bad("objects[].xxh3", "16 lowercase hex digits", digest)
    return Entry(key, size, int(digest, 16))


def _key(base: StorageURL, name: str) -> str:
    return f"{base.key}/{name}" if base.key else name


# ---------------------------------------------------------------------- writing


def commit(
    store: ObjectStore,
    base: StorageURL,
    name: str,
    write: Callable[[BinaryIO], object],
    companions: Sequence[tuple[str, Body]] = (),
) -> None:
    """Write checkpoint ``name`` under ``base``: its object ``name``, what ``write(f)`` writes, put
    while it is written (R-O52), then ``companions`` (as :func:`put_objects` takes them), then its
    record. The object is created only once ``write`` returned and its last parts went up.

    A committed ``name`` is never touched; what an interrupted save of ``name`` left is removed
    first, once :data:`STALE_AFTER` seconds old (R-O16). Every put is conditional, so a racing
    writer cannot overwrite an object, and before its record this save checks that each of its
    objects is still the one it put.

    Raises:
        CommitConflict: ``name`` is committed already, or another writer created one of its
            objects or its record first (R-O11): this save committed nothing.
        SaveFailed: a write failed; earlier checkpoints are intact, and the objects this save
            created are removed where the store still answers.
        Whatever else ``write`` raises: nothing is created.
    """
    begin(store, base, name)
    commit_begun(store, base, name, write, companions)


def commit_begun(
    store: ObjectStore,
    base: StorageURL,
    name: str,
    write: Callable[[BinaryIO], object],
    companions: Sequence[tuple[str, Body]] = (),
    others: Sequence[Written] = (),
) -> None:
    """The rest of :func:`commit` for a save that :func:`begin` began: the object ``name`` put while
    ``write`` writes it, ``companions``, then the record listing them and ``others`` (the objects the
    save's other writers put, R-O30).

    Raises:
        CommitConflict, SaveFailed: as :func:`commit`; on a failure before the record, the objects
            this call created are removed where the store answers.
    """
    first = put_written(store, base, name, name, write)
    try:
        rest = put_objects(store, base, name, companions)
    except CommitConflict:
        raise
    except Exception:
        _undo(store, base, [first])
        raise
    finish(store, base, name, [first, *rest, *others])


def begin(store: ObjectStore, base: StorageURL, name: str) -> None:
    """Before any object of a save of ``name``: refuse a committed ``name`` (R-O11), clean what an
    interrupted save of it left once :data:`STALE_AFTER` old (R-O16).

    Raises:
        CommitConflict: ``name`` is committed, or another writer's objects of it are younger.
    """
    record_key = _key(base, name + RECORD_SUFFIX)
    if store.head(record_key) is not None:
        raise CommitConflict(
            f"{store.url(record_key)}: step already committed; a checkpoint on object storage is "
            "written once (R-O11): delete it first, or save under another name",
            path=store.url(record_key),
        )
    sweep(store, base, name, older_than=STALE_AFTER)


#: What a put of one object of a save hands its commit: its record entry and the ETag it got.
Written = tuple[Entry, str]


def put_objects(store: ObjectStore, base: StorageURL, name: str, objects: Sequence[tuple[str, Body]]) -> list[Written]:
    """Put each ``(key relative to base, bytes or a file's span)`` with a conditional put (R-O11), in order.

    Raises:
        CommitConflict: another writer created one of them first (named).
        SaveFailed: a put failed; the objects this call created are removed where the store answers.
    """
    written: list[Written] = []
    try:
        for rel, data in objects:
            etag = store.put(_key(base, rel), data, if_absent=True)
            written.append((Entry(rel, len(data), _xxh3(data, store.part_size)), etag))
    except CommitConflict as e:  # nothing removed: on a conflict, a key may be the winner's now
        raise _conflict(store, base, name, e) from None
    except Exception:
        _undo(store, base, written)
        raise
    return written


def put_written(
    store: ObjectStore, base: StorageURL, name: str, rel: str, write: Callable[[BinaryIO], object]
) -> Written:
    """Put ``rel`` (relative to base) with a conditional put (R-O11), its bytes what ``write(f)``
    writes into a temporary file, each part going up as soon as the writer says it is final (R-O52);
    its record entry (the digest of the written bytes) and ETag.

    Raises:
        CommitConflict: another writer created it first.
        SaveFailed: a put failed; the upload is aborted, nothing is created.
    """
    try:
        etag, digest = store.put_written(
            _key(base, rel), write, lambda data: (len(data), _xxh3(data, store.part_size)), if_absent=True
        )
    except CommitConflict as e:  # on a conflict, the key is the winner's
        raise _conflict(store, base, name, e) from None
    return Entry(rel, *digest), etag


def finish(store: ObjectStore, base: StorageURL, name: str, written: Sequence[Written]) -> None:
    """Commit ``name``: check every written object is still the one put (R-O11), then create the
    record listing them all with ``If-None-Match: *``: the commit.

    Raises:
        CommitConflict: an object was replaced or removed, or the record exists (R-O11).
        SaveFailed: the record's put failed; the objects are removed where the store answers.
    """
    try:
        _still_mine(store, [(_key(base, e.key), etag) for e, etag in written])
        store.put(_key(base, name + RECORD_SUFFIX), encode_record(name, [e for e, _ in written]), if_absent=True)
    except CommitConflict as e:
        raise _conflict(store, base, name, e) from None
    except Exception:
        _undo(store, base, written)
        raise


def _conflict(store: ObjectStore, base: StorageURL, name: str, e: CommitConflict) -> CommitConflict:
    return CommitConflict(
        f"{e}: another writer is saving {store.url(_key(base, name))}; exactly one commits (R-O11)",
        path=store.url(_key(base, name)),
    )


def _undo(store: ObjectStore, base: StorageURL, written: Sequence[Written]) -> None:
    """Best effort: a crash leaves them to the next save's sweep (R-O16)."""
    for e, _etag in written:
        try:
            store.delete(_key(base, e.key))
        except Exception:  # noqa: BLE001 - the first error is the one raised
            break


def _still_mine(store: ObjectStore, created: list[tuple[str, str]]) -> None:
    """Before the record: every object is still the one this save put (R-O11). Another save of the
    same name may have cleaned them away as an interrupted save's (R-O16) and written its own.

    Raises:
        CommitConflict: one was replaced or removed; this save commits nothing.
    """
    for key, etag in created:
        if store.etag(key) != etag:
            raise CommitConflict(f"{store.url(key)}: replaced by another writer", path=store.url(key))


def leftovers(store: ObjectStore, base: StorageURL, name: str) -> list[tuple[str, float]]:
    """``(key, last modified)`` of ``name``'s objects when it has no record (an interrupted save,
    or one in progress), else ``[]``."""
    prefix = _key(base, name)
    found = [(k, m) for k, _, m in store.list(prefix) if k == prefix or k.startswith(prefix + ".")]
    if any(k == prefix + RECORD_SUFFIX for k, _ in found):
        return []
    return found


def sweep(store: ObjectStore, base: StorageURL, name: str, *, older_than: float | None = None) -> list[str]:
    """Remove what an interrupted save of ``name`` left (R-O16); returns the keys removed.

    Args:
        older_than: only when the newest of them is that many seconds old (a save's own
            cleaning); None (a resume's): whatever their age, the writer being gone.

    Raises:
        CommitConflict: with ``older_than``, they are younger: another writer is saving ``name``.
    """
    gone = leftovers(store, base, name)
    if gone and older_than is not None:
        age = time.time() - max(m for _, m in gone)
        if age < older_than:
            raise CommitConflict(
                f"{store.url(_key(base, name))}: another writer is saving it ({len(gone)} object(s) without a "
                f"record, the newest {max(age, 0):.0f} s old); a save removes an interrupted save's objects once "
                f"they are {older_than:.0f} s old, a resume at once (R-O16)",
                path=store.url(_key(base, name)),
            )
    for key, _m in gone:
        store.delete(key)
    return [key for key, _m in gone]


def remove(store: ObjectStore, base: StorageURL, name: str) -> None:
    """Uncommit ``name`` and remove its objects: the record first, then the objects (R-O17)."""
    prefix = _key(base, name)
    try:
        entries = read_record(store, base, name)
    except (CheckpointNotFound, FormatError):
        entries = []
    store.delete(prefix + RECORD_SUFFIX)
    for key in sorted({_key(base, e.key) for e in entries} | {k for k, _m in leftovers(store, base, name)}):
        store.delete(key)


# ---------------------------------------------------------------------- reading


def listing(store: ObjectStore, base: StorageURL, suffix: str) -> dict[str, bool]:
    """``{name: committed}`` for every checkpoint name ending in ``suffix`` directly under ``base``
    (one LIST: the objects of a save in progress or interrupted appear with ``False``)."""
    head = _key(base, "")
    out: dict[str, bool] = {}
    for key, _size, _modified in store.list(head):
        rel = key[len(head) :]
        if "/" in rel:
            continue
        if rel.endswith(suffix + RECORD_SUFFIX):
            out[rel[: -len(RECORD_SUFFIX)]] = True
        elif rel.endswith(suffix):
            out.setdefault(rel, False)
    return out


def read_record(store: ObjectStore, base: StorageURL, name: str, *, name_leftovers: bool = True) -> list[Entry]:
    """The entries of ``name``'s record.

    Args:
        name_leftovers: without a record, LIST what the save left to name it; False where one
            process of many lists it for all (R-O33), the others then saying only that there is none.

    Raises:
        CheckpointNotFound: no record and no object of the checkpoint (or, not ``name_leftovers``, no record).
        IncompleteCheckpoint: no record: the save did not commit (the objects it left named).
        FormatError: the record breaks R-O12/R-O13.
    """
    key = _key(base, name + RECORD_SUFFIX)
    try:
        data = store.get(key)
    except CheckpointNotFound:
        if not name_leftovers:
            raise CheckpointNotFound(
                f"{store.url(_key(base, name))}: no commit record {name}{RECORD_SUFFIX}: not committed, or no such "
                "checkpoint; the coordinator's error names which (R-O15)"
            ) from None
        left = [k.rpartition("/")[2] for k, _m in leftovers(store, base, name)]
        if not left:
            raise CheckpointNotFound(f"{store.url(_key(base, name))}: no such checkpoint") from None
        raise IncompleteCheckpoint(
            f"{store.url(_key(base, name))}: not committed (no commit record {name}{RECORD_SUFFIX}; objects "
            f"without a record: {', '.join(left)}); an interrupted save, which the next save removes (R-O15)",
            (name + RECORD_SUFFIX,),
        ) from None
    return decode_record(data, store.url(key), name)


def fetch_committed(
    store: ObjectStore,
    base: StorageURL,
    name: str,
    into: str,
    layout: Callable[[str, str], str] | None = None,
    only: Callable[[str], bool] | None = None,
) -> list[str]:
    """Every object ``name``'s record lists (``only``: those whose key it keeps), each checked (R-O14),
    into the directory ``into``: at ``layout(name, key)`` (default: a file of the key's name); the
    paths written.

    Raises:
        IncompleteCheckpoint: no record, or a listed object is missing (named).
        ChecksumMismatch, FormatError: an object's size or xxh3-64 differs from its record's (named).
    """
    paths = []
    for e in read_record(store, base, name):
        if only is not None and not only(e.key):
            continue
        path = os.path.join(into, layout(name, e.key) if layout else e.key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fetch(store, base, e, path)
        paths.append(path)
    return paths


def fetch(store: ObjectStore, base: StorageURL, e: Entry, path: str) -> None:
    """One listed object into the new file ``path``, a part at a time (R-O51), its size and digest
    checked against the record (R-O14); a failed check leaves no file.

    A size above the part size is compared with the object's (one HEAD) before its ranges are
    read, so a record that declares 2^64 bytes writes nothing (R-O47).

    Raises:
        IncompleteCheckpoint: the object is missing.
        FormatError, ChecksumMismatch: its size or bytes differ from its entry's.
    """
    url = store.url(_key(base, e.key))
    if e.size > store.part_size:
        _check_size(url, e.key, e.size, store.head(_key(base, e.key)))
    try:
        with open(path, "w+b") as f:  # read back for its digest
            try:
                got: int | None = store.get_into(_key(base, e.key), e.size, f.fileno())
            except CheckpointNotFound:
                got = None
            _check_size(url, e.key, e.size, got)
            digest = _xxh3(FileSpan(f.fileno(), e.size), store.part_size)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    if digest != e.xxh3:
        os.unlink(path)
        raise ChecksumMismatch(
            "object bytes differ from its commit record",
            path=url,
            field="xxh3",
            expected=f"{e.xxh3:016x}",
            actual=f"{digest:016x}",
            hint="the object was changed after its commit; use another checkpoint",
        )


def read_range(store: ObjectStore, base: StorageURL, e: Entry, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the listed object ``e`` (one ranged GET, retried, R-O20): a part of
    it whose own digest the caller checks (a distributed load's chunks, R-O33); the object's digest
    is not, so the caller MUST check every byte it uses.

    Raises:
        IncompleteCheckpoint: the object is missing.
        FormatError: it holds fewer bytes than its entry lists (or the store ignored the range).
    """
    assert 0 <= start < end <= e.size, (start, end, e.size)  # the caller reads inside the listed size
    key = _key(base, e.key)
    try:
        data = store.get(key, start, end)
    except CheckpointNotFound:
        raise _missing(store.url(key), e.key) from None
    if len(data) != end - start:
        raise FormatError(
            f"a read of bytes [{start}, {end}) returned {len(data)} bytes",
            path=store.url(key),
            offset=start,
            field="size",
            expected=end - start,
            actual=len(data),
            hint=f"the object is not the {e.size} bytes its commit record lists; use another checkpoint",
        )
    return data


def _xxh3(data: Body, chunk: int) -> int:
    """The xxh3-64 of ``data``, read ``chunk`` bytes at a time (a file's span is never whole in memory)."""
    if not isinstance(data, FileSpan):
        return xxhash.xxh3_64_intdigest(data)
    h = xxhash.xxh3_64()
    for start in range(0, len(data), chunk):
        h.update(piece(data, start, min(start + chunk, len(data))))
    return h.intdigest()


def _check_size(url: str, key: str, listed: int, size: int | None) -> None:
    """The object at ``url`` has the size its record lists (R-O14, R-O47).

    Raises:
        IncompleteCheckpoint: there is no object (``size`` None).
        FormatError: another size.
    """
    if size is None:
        raise _missing(url, key)
    if size != listed:
        raise FormatError(
            "object size differs from its commit record",
            path=url,
            field="size",
            expected=listed,
            actual=size,
            hint="R-O47",
        )


def _missing(url: str, key: str) -> IncompleteCheckpoint:
    return IncompleteCheckpoint(f"{url}: listed by its commit record but missing; the checkpoint is damaged", (key,))
