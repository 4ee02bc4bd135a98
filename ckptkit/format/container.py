"""The checkpoint container: magic, header, four sections, trailer.

v2 (written and read)::

    [magic "DMCK\\0\\2\\0\\0"][step u64][model_len u64][optim_len u64][teacher_len u64]
    [flags u64][monitor_len u64][model][optim][teacher][monitor][skeleton xxh3 u64]["DMCKEND\\0"]

v1 (legacy, read only)::

    [step u64][model_len u64][optim_len u64][model][optim]

Every byte of a v2 file is covered by a digest: tensor bytes by their own xxh3-64
(in the section index), every other byte (the *skeleton*) by the trailer's digest.
A zero-length section is absent. This module is torch-free, so ``ckptkit verify``
starts in milliseconds; ``spec/container.md`` is the contract and the rule ids in
error hints (R-001...) point into ``spec/validation.md``.

Invariants:
    * The magic, version, section order and flag bits are defined here and only here.
    * Lengths are validated against the file size before anything is allocated.
    * Malformed input raises only :class:`~ckptkit.errors.CheckpointError` subclasses.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

from ..errors import (
    BadMagic,
    BadTensorValue,
    CheckpointError,
    ChecksumMismatch,
    FormatError,
    IncompleteCheckpoint,
    InsufficientMemory,
    MalformedIndex,
    ReservedBitSet,
    TruncatedFile,
    UnreadableFile,
    UnsupportedVersion,
)
from ._io import ZEROS, Source, WriteBehind, cpus, open_regular, run_keyed, write_all, write_zeros
from .section import SectionIndex, SectionPlan, decode_index
from .urls import is_url

__all__ = [
    "FLAG_FP32_FALLBACK",
    "FLAG_NAMES",
    "HEADER_SIZE",
    "LEGACY_MISSING",
    "MAGIC",
    "SECTIONS",
    "VERSION",
    "Layout",
    "Report",
    "SectionInfo",
    "Source",
    "open_regular",
    "read_layout",
    "verify",
    "write_container",
]

VERSION = 2
MAGIC = b"DMCK\x00" + struct.pack("<H", VERSION) + b"\x00"
_MAGIC_PREFIX = b"DMCK"
#: Section order in the header and on disk. Never reorder: it is the format.
SECTIONS = ("model", "optim", "teacher", "monitor")
_V1_SECTIONS = ("model", "optim")
#: What a v1 file cannot carry, in the words ``Checkpoint.missing`` uses.
LEGACY_MISSING = ("teacher", "flags", "monitor", "integrity")

#: flags bit 0: the one-way fp32-factor fallback latch (design record item 2).
FLAG_FP32_FALLBACK = 1 << 0
FLAG_NAMES = {0: "fp32_fallback"}
_KNOWN_FLAGS = sum(1 << b for b in FLAG_NAMES)

_HEADER = struct.Struct("<8sQQQQQQ")  # magic, step, model, optim, teacher, flags, monitor
HEADER_SIZE = _HEADER.size
_V1_HEADER = struct.Struct("<QQQ")  # step, model, optim
_TRAILER_MAGIC = b"DMCKEND\x00"
_TRAILER = struct.Struct("<Q8s")  # skeleton digest, end magic
_U64 = struct.Struct("<Q")
# Byte offset of each v2 header field, for messages.
_FIELD_OFFSET = {"step": 8, "model": 16, "optim": 24, "teacher": 32, "flags": 40, "monitor": 48}
_CHUNK = 1 << 20  # hashing/IO granularity: stays in cache between hash and write
# Performance knobs (none of them is format; spec/performance.md says why each value).
_PARALLEL_MIN = 32 << 20  # read_tensors uses threads only when there is at least this much to read
_READ_PIECE = 256 << 10  # read_tensors: a piece read into its destination is hashed while still in L2
_BATCH_BYTES = 4 << 20  # tensors smaller than this are read and checked in batches of about this many bytes...
_BATCH_COUNT = 1024  # ... or of this many tensors: one task per batch, not per tensor (G-04)


# ---------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Layout:
    """A container's structure, parsed and bounds-checked but not yet hashed."""

    path: str | None
    version: int
    step: int
    flags: int
    sections: dict[str, SectionIndex | None]
    legacy: bool
    missing: tuple[str, ...]
    size: int
    trailer_offset: int | None  # v2 only
    skeleton_digest: int | None  # v2 only, as stored
    header_size: int = 56

    @property
    def flag_names(self) -> tuple[str, ...]:
        return tuple(FLAG_NAMES.get(b, f"bit{b}") for b in range(64) if self.flags >> b & 1)


def read_layout(src: Source) -> Layout:
    """Parse the header and every section index, checking all lengths.

    Raises:
        BadMagic, UnsupportedVersion, TruncatedFile, MalformedIndex: see spec R-001..R-016.
    """
    head = src.pread(0, min(src.size, 8), "magic") if src.size else b""
    if head[:4] == _MAGIC_PREFIX:
        return _read_v2(src)
    return _read_v1(src, head)


def _read_v2(src: Source) -> Layout:
    check_magic(src, MAGIC, "container", "R-001", refused="malformed magic", version_error=_version_error)
    return _read_v2_body(src)


def _read_v2_body(src: Source) -> Layout:
    if src.size < _HEADER.size + _TRAILER.size:
        raise TruncatedFile(
            "file ends inside the header or before the trailer",
            path=src.path,
            offset=src.size,
            field="header",
            expected=f">= {_HEADER.size + _TRAILER.size} bytes",
            actual=src.size,
            hint="R-003",
        )
    _, step, m, o, t, flags, mon = _HEADER.unpack(src.pread(0, _HEADER.size, "header"))
    lengths = {"model": m, "optim": o, "teacher": t, "monitor": mon}
    offsets = {name: _FIELD_OFFSET[name] for name in lengths}
    sections, trailer_at, digest = read_framed(src, _HEADER.size, lengths, offsets, _TRAILER_MAGIC)
    return Layout(src.path, VERSION, step, flags, sections, False, (), src.size, trailer_at, digest)


def _version_error(src: Source, version: int) -> FormatError:
    """The error for a magic whose version is not 2: unsupported, or a damaged v2 header.

    A version this reader lacks is refused (R-002). But one flipped bit in the
    version field of a v2 file must read as damage, not as "a newer ckptkit wrote
    it": so when the rest of the file is a well-formed v2 file (lengths, trailer,
    indexes) whose skeleton digest, which covers the version field, fails, the
    header is damaged (R-005). A newer writer signs what it writes, so its file
    either is not laid out as v2 or carries a digest that matches.
    """
    try:
        layout = _read_v2_body(src)
        check_skeleton(src, layout)
    except ChecksumMismatch as e:
        return ChecksumMismatch(
            f"header damaged: the version field reads {version}, but the file is laid out as a v{VERSION} "
            "container and its skeleton digest (which covers the version) does not match",
            path=src.path,
            offset=5,
            field="magic",
            expected=e.expected,
            actual=e.actual,
            hint="R-005",
        )
    except FormatError:
        pass  # not laid out as v2: a format this reader does not know
    newer = "a newer ckptkit wrote it; upgrade ckptkit" if version > VERSION else "not a version ckptkit ever wrote"
    return UnsupportedVersion(
        f"container version {version} is not supported",
        path=src.path,
        offset=5,
        field="magic",
        expected=f"version {VERSION} (or a legacy v1 file)",
        actual=version,
        hint=f"{newer} (R-002)",
    )


def check_magic(
    src: Source,
    magic: bytes,
    what: str,
    rule: str,
    *,
    refused: str | None = None,
    hint: str | None = None,
    version_error: Callable[[Source, int], FormatError] | None = None,
) -> None:
    """Refuse a file whose 8-byte magic ``[4 bytes][0][u16 version][0]`` is not ``magic``.

    One check for the container, the sidecar and the distributed files, which open alike.

    Raises:
        BadMagic: a foreign or malformed magic (``refused``, default "not a ckptkit
            ``what``"; ``hint`` defaults to ``rule``).
        UnsupportedVersion: another version ("``what`` version N is not supported"),
            or what ``version_error(src, version)`` returns.
    """
    head = src.pread(0, min(src.size, 8), "magic")
    if head[:4] != magic[:4] or len(head) < 8 or head[4] or head[7]:
        raise BadMagic(
            refused or f"not a ckptkit {what}",
            path=src.path,
            offset=0,
            field="magic",
            expected=repr(magic),
            actual=repr(head),
            hint=hint or rule,
        )
    version, expected = struct.unpack_from("<H", head, 5)[0], struct.unpack_from("<H", magic, 5)[0]
    if version == expected:
        return
    if version_error is not None:
        raise version_error(src, version)
    raise UnsupportedVersion(
        f"{what} version {version} is not supported",
        path=src.path,
        offset=5,
        field="magic",
        expected=expected,
        actual=version,
        hint=f"a newer ckptkit wrote it; upgrade ckptkit ({rule})",
    )


def read_framed(
    src: Source, header_size: int, lengths: dict[str, int], len_offsets: dict[str, int], end_magic: bytes
) -> tuple[dict[str, SectionIndex | None], int, int]:
    """Place and parse the sections that follow a header, and read the trailer.

    Shared by the container and the sidecar (``spec/sidecar.md``), whose bodies have
    the same shape: back-to-back sections, then ``[skeleton digest u64][end magic]``.

    Returns:
        ``(sections, trailer offset, stored skeleton digest)``.
    """
    starts = _place_sections(src, header_size, lengths, len_offsets, reserve=_TRAILER.size)
    trailer_at = header_size + sum(lengths.values())
    digest, got_magic = _TRAILER.unpack(src.pread(trailer_at, _TRAILER.size, "trailer"))
    if got_magic != end_magic:
        raise BadMagic(
            "trailer end magic is wrong",
            path=src.path,
            offset=trailer_at + 8,
            field="trailer",
            expected=repr(end_magic),
            actual=repr(got_magic),
            hint="R-005",
        )
    sections = {name: _read_section(src, name, starts[name], n, legacy=False) for name, n in lengths.items()}
    return sections, trailer_at, digest


def _read_v1(src: Source, head: bytes) -> Layout:
    if src.size < _V1_HEADER.size:
        raise BadMagic(
            "not a ckptkit checkpoint: too short for any header",
            path=src.path,
            offset=0,
            field="magic",
            expected=f">= {_V1_HEADER.size} bytes",
            actual=src.size,
            hint=_foreign_hint(head),
        )
    step, m, o = _V1_HEADER.unpack(src.pread(0, _V1_HEADER.size, "v1 header"))
    if _V1_HEADER.size + m + o != src.size:
        start = src.pread(0, min(src.size, 64), "magic")
        if _looks_like_text(start):
            raise BadMagic(
                f"not a ckptkit file: it starts with text ({_text_preview(start)})",
                path=src.path,
                offset=0,
                field="magic",
                expected=repr(MAGIC),
                hint="a text file; check the path: a checkpoint is a binary file (R-001)",
            )
        raise BadMagic(
            f"not a ckptkit file: no DMCK magic, and not a legacy v1 container either: read as v1, its header "
            f"claims 24 + model {m} + optim {o} bytes",
            path=src.path,
            offset=0,
            field="magic",
            expected=f"file size {_V1_HEADER.size + m + o}",
            actual=src.size,
            hint=_foreign_hint(head),
        )
    lengths = {"model": m, "optim": o}
    starts = _place_sections(src, _V1_HEADER.size, lengths, {"model": 8, "optim": 16}, reserve=0)
    sections: dict[str, SectionIndex | None] = {
        name: _read_section(src, name, starts[name], lengths[name], legacy=True) for name in _V1_SECTIONS
    }
    sections.update({"teacher": None, "monitor": None})
    return Layout(src.path, 1, step, 0, sections, True, LEGACY_MISSING, src.size, None, None, _V1_HEADER.size)


def _looks_like_text(data: bytes) -> bool:
    """UTF-8 without control characters other than tab, newline and carriage return."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # a multi-byte character cut at the end of the sample still counts
        text = data[:-3].decode("utf-8", errors="replace")
        if "\ufffd" in text:
            return False
    return all(c.isprintable() or c in "\t\n\r" for c in text)


def _text_preview(data: bytes) -> str:
    return repr(data[:24].decode("utf-8", errors="replace")) + ("..." if len(data) > 24 else "")


def _foreign_hint(head: bytes) -> str:
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return (
            "this looks like a torch.save (zip/pickle) file; ckptkit never unpickles — "
            "import it once with ckptkit.import_torch_checkpoint (R-001)"
        )
    return "R-001"


def _place_sections(
    src: Source, first: int, lengths: dict[str, int], len_offsets: dict[str, int], *, reserve: int
) -> dict[str, int]:
    starts, pos = {}, first
    for name, n in lengths.items():
        if pos + n + reserve > src.size:
            raise TruncatedFile(
                f"{name} section of {n} bytes at offset {pos} runs past the end of the file",
                path=src.path,
                offset=len_offsets[name],
                field=f"{name}_len",
                expected=f"<= {max(0, src.size - pos - reserve)}",
                actual=n,
                hint="R-003",
            )
        starts[name] = pos
        pos += n
    if pos + reserve != src.size:
        extra = src.size - pos - reserve
        raise TruncatedFile(
            f"{extra} unexpected byte{'s' if extra != 1 else ''} after the last section",
            path=src.path,
            offset=pos,
            field="trailer",
            expected=pos + reserve,
            actual=src.size,
            hint="R-003",
        )
    return starts


def _read_section(src: Source, name: str, start: int, length: int, *, legacy: bool) -> SectionIndex | None:
    if length == 0:
        return None
    if length < 8:
        raise TruncatedFile(
            f"{name} section is {length} bytes, shorter than its index_len field",
            path=src.path,
            offset=start,
            field=name,
            expected=">= 8",
            actual=length,
            hint="R-004",
        )
    index_len = _U64.unpack(src.pread(start, 8, f"{name} index_len"))[0]
    if 8 + index_len > length:
        raise TruncatedFile(
            f"{name} index of {index_len} bytes does not fit in its {length}-byte section",
            path=src.path,
            offset=start,
            field=f"{name} index_len",
            expected=f"<= {length - 8}",
            actual=index_len,
            hint="R-004",
        )
    raw = src.pread(start + 8, index_len, f"{name} index")
    return decode_index(raw, name=name, start=start, length=length, index_len=index_len, legacy=legacy, path=src.path)


def skeleton_extents(layout: Layout) -> Iterator[tuple[int, int]]:
    """Absolute byte ranges covered by the skeleton digest, in file order (a generator: one
    range per gap between tensors, never all held at once)."""
    assert layout.trailer_offset is not None
    yield (0, layout.header_size)
    for sec in layout.sections.values():
        if sec is not None:
            yield from ((a, b) for a, b in sec.skeleton_extents() if b > a)


def check_skeleton(src: Source, layout: Layout, scratch: bytearray | None = None) -> None:
    """Hash every non-tensor byte and compare with the trailer (R-005).

    Raises:
        ChecksumMismatch: naming the trailer offset and both digests.
    """
    h = xxhash.xxh3_64()
    if scratch is None:  # sized to the longest extent: indexes are kilobytes, and a 1 MiB buffer costs its zeroing
        scratch = bytearray(min(_CHUNK, max((b - a for a, b in skeleton_extents(layout)), default=0)))
    for a, b in skeleton_extents(layout):
        src.feed(a, b, h.update, scratch)
    got = h.intdigest()
    if got != layout.skeleton_digest:
        raise ChecksumMismatch(
            "skeleton digest (header, indexes, padding) does not match",
            path=src.path,
            offset=layout.trailer_offset,
            field="trailer",
            expected=f"0x{layout.skeleton_digest:016x}",
            actual=f"0x{got:016x}",
            hint="R-005",
        )


def check_flags(layout: Layout) -> None:
    """Refuse flag bits this reader cannot honour (R-006)."""
    unknown = layout.flags & ~_KNOWN_FLAGS
    if unknown:
        bit = (unknown & -unknown).bit_length() - 1
        raise ReservedBitSet(
            f"reserved bit {bit} set",
            path=layout.path,
            offset=_FIELD_OFFSET["flags"],
            field="flags",
            expected=0,
            actual=f"0x{unknown:x}",
            hint="a newer ckptkit wrote state this reader cannot restore; upgrade ckptkit (R-006)",
        )


def tensor_mismatch(src_path: str | None, sec: SectionIndex, i: int, got: int) -> ChecksumMismatch:
    rec = sec.tensors[i]
    where = sec.data_start + rec.offset if sec.codec == "raw" else sec.data_start
    return ChecksumMismatch(
        f"tensor {i} ({rec.dtype}{list(rec.shape)}) digest does not match its bytes",
        path=src_path,
        offset=where,
        field=f"{sec.name} data",
        expected=f"0x{rec.digest:016x}",
        actual=f"0x{got:016x}",
        hint="R-007",
    )


class TensorCheck:
    """Every check on one tensor's bytes, fed piece by piece as they are read or decoded.

    The digest (R-007) and, for ``bool``, that every byte is 0 or 1 (R-017: torch would
    read 0x07 as True, so two files with different bytes would load as the same
    state). Every reader (``load``, ``verify``, the lazy reader) uses this one class.
    """

    __slots__ = ("_bad", "_bool", "_h", "_pos", "i", "sec")

    def __init__(self, sec: SectionIndex, i: int) -> None:
        self.sec, self.i = sec, i
        self._h = xxhash.xxh3_64()
        self._bool = sec.tensors.dtype(i) == "bool"
        self._pos = 0
        self._bad: tuple[int, int] | None = None  # (byte index in the tensor, value) of the first bad bool

    def update(self, piece: memoryview | bytes) -> None:
        self._h.update(piece)
        if self._bool and self._bad is None:
            data = bytes(piece)
            junk = data.translate(None, b"\x00\x01")
            if junk:
                k = data.index(junk[:1])
                self._bad = (self._pos + k, junk[0])
        self._pos += len(piece)

    def finish(self, path: str | None) -> None:
        """Raise for the first check that failed: the digest first (damage), then the values.

        Raises:
            ChecksumMismatch: the bytes do not match the record's digest (R-007).
            BadTensorValue: a bool byte other than 0 or 1 (R-017).
        """
        sec = self.sec
        got = self._h.intdigest()
        want = sec.tensors.digest(self.i)
        if want is not None and got != want:
            raise tensor_mismatch(path, sec, self.i, got)
        if self._bad is not None:
            rec = sec.tensors[self.i]
            k, value = self._bad
            raw = sec.codec == "raw"
            raise BadTensorValue(
                f"tensor {self.i} ({rec.dtype}{list(rec.shape)}): element {k} is byte 0x{value:02x}; "
                "a bool is stored as 0 or 1",
                path=path,
                offset=sec.data_start + rec.offset + k if raw else sec.data_start,
                field=f"{sec.name} data",
                hint="R-017",
            )


def check_tensors(src: Source, sec: SectionIndex, scratch: bytearray) -> int:
    """Hash every tensor of a v2 section against its digest; returns bytes hashed (R-007).

    Memory stays bounded: raw tensors are hashed through mapped windows or chunked
    reads, and a zstd region is decoded as a stream, never held whole.
    """
    if sec.codec == "raw":
        total = 0
        for i, rec in enumerate(sec.tensors):
            check = TensorCheck(sec, i)
            a = sec.data_start + rec.offset
            src.feed(a, a + rec.nbytes, check.update, scratch)
            check.finish(src.path)
            total += rec.nbytes
        return total
    _scatter_region(src, sec, None)
    return sec.raw_len


def check_all_tensors(src: Source, layout: Layout, *, threads: int = 0) -> tuple[int, FormatError | None]:
    """Hash every tensor of every section, one thread per core (R-007, R-008).

    The same checks as :func:`check_tensors` section by section, and the same
    error: the earliest in the file (within a zstd section, R-008 before R-007).
    Small tensors are hashed in batches (:func:`_id_batches`): the work list holds
    one task per batch, so a file declaring a million tensors costs no million objects.

    Returns:
        ``(bytes hashed by the checks that passed, the error or None)``.
    """
    tasks: list[Callable[[], None]] = []
    keys: list[int] = []
    done = [0]
    lock = threading.Lock()

    def count(n: int) -> None:
        with lock:
            done[0] += n

    def scatter(sec: SectionIndex) -> None:
        _scatter_region(src, sec, None)
        count(sec.raw_len)

    def hash_ids(sec: SectionIndex, ids: range) -> None:
        first: BaseException | None = None
        scratch = bytearray(min(_CHUNK, max(sec.tensors.sizes[ids.start : ids.stop])))
        for i in ids:
            try:
                count(_hash_tensor(src, sec, i, scratch))
            except Exception as e:  # noqa: BLE001 - the batch's first failure, in file order, is its error
                first = first or e
        if first is not None:
            raise first

    for sec in layout.sections.values():
        if sec is None:
            continue
        if sec.codec != "raw":
            tasks.append(functools.partial(scatter, sec))
            keys.append(sec.data_start)
            continue
        for ids in _id_batches(sec.tensors.sizes):
            tasks.append(functools.partial(hash_ids, sec, ids))
            keys.append(sec.data_start + sec.tensors.offsets[ids.start])
    total = sum(s.tensors.total_nbytes() for s in layout.sections.values() if s is not None)
    if threads <= 0:
        threads = min(4, cpus()) if total >= _PARALLEL_MIN else 1
    errors: dict[int, BaseException] = {}
    run_keyed(tasks, keys, errors, min(threads, max(1, len(tasks))))
    if errors:
        err = errors[min(errors)]
        if not isinstance(err, FormatError):
            raise err
        return done[0], err
    return done[0], None


def _id_batches(sizes: Sequence[int]) -> Iterator[range]:
    """Consecutive ranges of tensor ids, each at most :data:`_BATCH_BYTES` (or one larger tensor)
    and :data:`_BATCH_COUNT` tensors: the unit of work of the tensor checks."""
    i, n = 0, len(sizes)
    while i < n:
        j, got = i + 1, sizes[i]
        while j < n and j - i < _BATCH_COUNT and got + sizes[j] <= _BATCH_BYTES:
            got += sizes[j]
            j += 1
        yield range(i, j)
        i = j


def _hash_tensor(src: Source, sec: SectionIndex, i: int, scratch: bytearray) -> int:
    n = sec.tensors.sizes[i]
    check = TensorCheck(sec, i)
    a = sec.data_start + sec.tensors.offsets[i]
    src.feed(a, a + n, check.update, scratch)
    check.finish(src.path)
    return n


class _RangeReader:
    """``read(n)`` over ``[start, end)`` of a :class:`Source`: the input side of a zstd stream."""

    def __init__(self, src: Source, start: int, end: int, field: str) -> None:
        self.src, self.pos, self.end, self.field = src, start, end, field

    def read(self, n: int = -1) -> bytes:
        n = self.end - self.pos if n < 0 else min(n, self.end - self.pos)
        out = self.src.pread(self.pos, n, self.field) if n > 0 else b""
        self.pos += n
        return out


#: The largest zstd window a reader must support (libzstd's default limit): a frame
#: that needs more decoder memory is refused before decoding (R-008).
MAX_ZSTD_WINDOW = 128 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _check_zstd_frame(src: Source, sec: SectionIndex) -> None:
    """Check that a zstd data region is exactly one zstd frame within the window limit (R-008).

    Walks the frame's block headers (3 bytes per block of at most 128 KiB, so a
    few thousand small reads for a gigabyte) to find where the frame ends: a
    skippable frame before or after it, a second frame, or any other byte after
    it is refused, because §7 allows exactly one frame and nothing else. The
    blocks' contents are left to the decoder.
    """
    import zstandard

    field = f"{sec.name} data"

    def bad(problem: str, **kw: Any) -> MalformedIndex:
        return MalformedIndex(problem, path=src.path, offset=sec.data_start, field=field, hint="R-008", **kw)

    head = src.pread(sec.data_start, min(sec.data_len, 18), field)
    if head[:4] != _ZSTD_MAGIC:
        skippable = len(head) >= 4 and head[0] & 0xF0 == 0x50 and head[1:4] == b"\x2a\x4d\x18"
        what = "a skippable frame" if skippable else f"bytes {head[:4].hex(' ')}"
        raise bad(f"zstd data region starts with {what}, not a zstd frame (exactly one frame is allowed)")
    try:
        params = zstandard.get_frame_parameters(head)
        pos = zstandard.frame_header_size(head)
    except zstandard.ZstdError as e:
        raise bad(f"zstd frame header does not parse: {e}") from None
    if params.window_size > MAX_ZSTD_WINDOW:
        raise bad(
            "zstd frame needs a larger window than a reader must support",
            expected=f"<= {MAX_ZSTD_WINDOW} bytes",
            actual=params.window_size,
        )
    while True:
        if pos + 3 > sec.data_len:
            raise bad("zstd frame is cut short (its blocks run past the data region)")
        b = int.from_bytes(src.pread(sec.data_start + pos, 3, field), "little")
        block_type, size = b >> 1 & 3, b >> 3
        pos += 3 + (1 if block_type == 1 else size)  # an RLE block stores one byte
        if b & 1:  # last block
            break
    pos += 4 if params.has_checksum else 0
    if pos > sec.data_len:
        raise bad("zstd frame is cut short (its blocks run past the data region)")
    if pos < sec.data_len:
        extra = sec.data_len - pos
        raise bad(
            f"{extra} byte{'s' if extra != 1 else ''} after the zstd frame (exactly one frame, nothing after it)",
            expected=f"frame end at {sec.data_start + sec.data_len}",
            actual=sec.data_start + pos,
        )


def _region_pieces(src: Source, sec: SectionIndex) -> Iterator[bytes]:
    """The decoded data region of a zstd section as consecutive pieces (R-008).

    The region must be one frame (:func:`_check_zstd_frame`) that decodes to
    exactly ``raw_len`` bytes; it is streamed: at most one 1 MiB piece is held at
    a time, whatever ``raw_len`` is.
    """
    import zstandard

    _check_zstd_frame(src, sec)
    source = _RangeReader(src, sec.data_start, sec.data_start + sec.data_len, f"{sec.name} data")
    total = 0
    try:
        # zstandard's stub asks for IO[bytes]; stream_reader only calls read() (all _RangeReader has).
        reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=False)  # type: ignore[arg-type]
        while total <= sec.raw_len:
            piece = reader.read(min(_CHUNK, sec.raw_len + 1 - total))
            if not piece:
                break
            total += len(piece)
            if total <= sec.raw_len:
                yield piece
    except zstandard.ZstdError as e:
        raise MalformedIndex(
            f"zstd data region does not decompress: {e}",
            path=src.path,
            offset=sec.data_start,
            field=f"{sec.name} data",
            hint="R-008",
        ) from None
    if total != sec.raw_len:
        raise MalformedIndex(
            "zstd data region decompresses to the wrong length",
            path=src.path,
            offset=sec.data_start,
            field=f"{sec.name} data",
            expected=sec.raw_len,
            actual=total if total <= sec.raw_len else f"> {sec.raw_len}",
            hint="R-008",
        )


def _scatter_region(src: Source, sec: SectionIndex, dests: Sequence[memoryview | None] | None) -> None:
    """Decode a zstd section as a stream, copying each tensor into ``dests[i]`` (None: hash only).

    Every tensor is hashed as its bytes go by, one tensor's check open at a time
    (tensors are in offset order and disjoint, R-014); a digest mismatch is raised
    only after the whole region decoded to the right length, so R-008 is reported
    before R-007, as when the region was decoded whole.
    """
    offsets, sizes = sec.tensors.offsets, sec.tensors.sizes
    n = len(offsets)
    first: list[FormatError] = []  # the first failed check, in table (= file) order
    i, check = 0, None  # the next tensor not yet finished, and its open check
    pos = 0  # region offset of the next piece
    for piece in _region_pieces(src, sec):
        end = pos + len(piece)
        mv = memoryview(piece)
        while i < n and (offsets[i] < end or offsets[i] + sizes[i] <= end):
            off, nb = offsets[i], sizes[i]
            check = check or TensorCheck(sec, i)
            a, b = max(pos, off), min(end, off + nb)
            if b > a:
                check.update(mv[a - pos : b - pos])
                dest = None if dests is None else dests[i]
                if dest is not None:
                    dest[a - off : b - off] = mv[a - pos : b - pos]
            if off + nb > end:
                break  # continues in the next piece
            _finish(check, src.path, first)
            i, check = i + 1, None
        pos = end
    for k in range(i, n):  # empty tensors at the region's end (the region decoded to raw_len)
        _finish(check if k == i and check else TensorCheck(sec, k), src.path, first)
    if first:
        raise first[0]


def _finish(check: TensorCheck, path: str | None, first: list[FormatError]) -> None:
    try:
        check.finish(path)
    except FormatError as e:
        if not first:
            first.append(e)


def read_tensors(
    src: Source,
    jobs: Sequence[tuple[SectionIndex, int, memoryview | None]],
    *,
    mapping: mmap.mmap | None = None,
    threads: int = 0,
) -> None:
    """Read tensors straight into their destinations, checking each digest in the same pass (R-007, R-008).

    Args:
        src: the open file (its layout already read and its skeleton checked).
        jobs: ``(section, tensor index, destination)``; each destination is a
            writable byte view of exactly the tensor's ``nbytes``. Tensors of a
            raw section are read with positional reads in 256 KiB pieces, each piece
            hashed while it is still in cache; a zstd section is decoded as a
            stream into its destinations. A raw tensor whose destination is None
            is checked where it lies in ``mapping`` (a mapping of the whole file,
            :meth:`Source.map_private`): its bytes are the ones the caller hands out.
        mapping: required when a raw job has no destination.
        threads: reader threads; 0 picks one per available core (at most 4) when
            there is enough to read. ``os.preadv`` and xxh3 release the GIL, so
            the threads overlap the copy out of the page cache with hashing.

    Small tensors are read in batches (about 4 MiB or 1024 tensors a task), the
    large ones each in a task of its own, largest first: a thread that picks the
    last task finishes soon after the others, and a file of a million tensors is
    a thousand tasks, not a million.

    Raises:
        ChecksumMismatch: a tensor's bytes do not match its digest; when several
            do, the one earliest in the file.
        MalformedIndex: a zstd region that does not decode to ``raw_len`` bytes.
        TruncatedFile: the file shrank while being read.
    """
    big: list[tuple[SectionIndex, int, memoryview | None]] = []
    batches: list[list[tuple[SectionIndex, int, memoryview | None]]] = [[]]
    zstd: dict[int, tuple[SectionIndex, list[memoryview | None]]] = {}
    total, batch_bytes = 0, 0
    for job in jobs:
        sec, i, dest = job
        if sec.codec != "raw":
            zstd.setdefault(sec.start, (sec, [None] * len(sec.tensors)))[1][i] = dest
            continue
        if dest is None and mapping is None:
            raise AssertionError("a raw job without destination needs the file's mapping")
        nbytes = sec.tensors.sizes[i]
        total += nbytes
        if nbytes >= _BATCH_BYTES:
            big.append(job)
            continue
        if batch_bytes + nbytes > _BATCH_BYTES or len(batches[-1]) >= _BATCH_COUNT:
            batches.append([])
            batch_bytes = 0
        batches[-1].append(job)
        batch_bytes += nbytes
    big.sort(key=lambda t: -t[0].tensors.sizes[t[1]])
    errors: dict[int, BaseException] = {}
    work = [[job] for job in big] + [b for b in batches if b]

    def run(k: int) -> None:
        if k < len(zstd_tasks):
            zstd_tasks[k]()
            return
        for sec, i, dest in work[k - len(zstd_tasks)]:
            try:
                _read_one(src, sec, i, dest, mapping)
            except Exception as e:  # noqa: BLE001 - raised below, the earliest in the file
                errors[sec.data_start + sec.tensors.offsets[i]] = e

    zstd_tasks = [functools.partial(_scatter_region, src, sec, dests) for sec, dests in zstd.values()]
    keys = [sec.data_start for sec, _ in zstd.values()]
    if threads <= 0:
        threads = min(4, cpus()) if total >= _PARALLEL_MIN else 1
    n_tasks = len(zstd_tasks) + len(work)
    run_keyed(
        [functools.partial(run, k) for k in range(n_tasks)], keys + [0] * len(work), errors, min(threads, n_tasks)
    )
    if errors:
        raise errors[min(errors)]


def _read_one(src: Source, sec: SectionIndex, i: int, dest: memoryview | None, mapping: mmap.mmap | None) -> None:
    """Read raw tensor ``i`` into ``dest`` checking it piece by piece, or check it where it lies in ``mapping``."""
    if dest is None:
        assert mapping is not None
        check_mapped(src.path, sec, i, mapping)
        return
    base = sec.data_start + sec.tensors.offsets[i]
    check = TensorCheck(sec, i)
    for a in range(0, sec.tensors.sizes[i], _READ_PIECE):
        piece = dest[a : a + _READ_PIECE]
        src.readinto(base + a, piece)
        check.update(piece)
    check.finish(src.path)


def check_mapped(path: str | None, sec: SectionIndex, i: int, mapping: mmap.mmap) -> None:
    """Check raw tensor ``i`` where it lies in a mapping of the whole file (R-007, R-017).

    Raises:
        ChecksumMismatch, BadTensorValue: as :meth:`TensorCheck.finish`.
    """
    at = sec.data_start + sec.tensors.offsets[i]
    check = TensorCheck(sec, i)
    with memoryview(mapping) as whole, whole[at : at + sec.tensors.sizes[i]] as view:
        check.update(view)
    check.finish(path)


@dataclass(frozen=True)
class SectionInfo:
    """One section as ``ckptkit inspect`` shows it."""

    name: str
    offset: int
    length: int  # bytes on disk, including the index
    codec: str | None  # None when absent
    tensors: int
    raw_len: int  # tensor-region bytes once decoded

    @property
    def present(self) -> bool:
        return self.length > 0


@dataclass(frozen=True)
class Report:
    """The verdict of :func:`verify` on one file. ``ok`` is False iff ``error`` is set."""

    path: str
    ok: bool
    error: CheckpointError | None
    version: int | None
    step: int | None
    flags: tuple[str, ...]
    legacy: bool
    missing: tuple[str, ...]
    sections: tuple[SectionInfo, ...]
    size: int
    bytes_hashed: int
    kind: str = "container"  # or "sidecar"


def section_infos(layout: Layout) -> tuple[SectionInfo, ...]:
    """Per-section summary for reports (absent sections included, length 0)."""
    out, pos = [], layout.header_size
    names = _V1_SECTIONS if layout.legacy else tuple(layout.sections)
    for name in names:
        sec = layout.sections[name]
        if sec is None:
            out.append(SectionInfo(name, pos, 0, None, 0, 0))
        else:
            out.append(SectionInfo(name, sec.start, sec.length, sec.codec, len(sec.tensors), sec.raw_len))
            pos = sec.start + sec.length
    return tuple(out)


def verify(path: str | os.PathLike[str]) -> Report:
    """Check every byte of a checkpoint file with bounded memory; never raises for bad bytes.

    Args:
        path: a checkpoint file, or an ``s3://`` URL: an object that lacks its commit
            record, or whose size or xxh3-64 differs from it, is a failed report.

    Returns:
        A :class:`Report`; ``report.ok`` is False and ``report.error`` holds the typed
        error when the file is corrupt, truncated, of an unknown version, or has a
        reserved flag set, or when the path is no readable file (a directory, FIFO,
        device, symlink loop: :class:`~ckptkit.errors.UnreadableFile`, ``size`` 0).
        A legacy v1 file that parses is ``ok`` (it has no digests to check;
        ``missing`` says so).

    Raises:
        CheckpointNotFound: nothing exists at ``path``.

    Example:
        >>> report = verify("run/step-00000100.ckpt")  # doctest: +SKIP
        >>> report.ok, report.step
        (True, 100)
    """
    path = os.fspath(path)
    try:
        opened = _remote_source(path) if is_url(path) else Source(path)
    except (UnreadableFile, IncompleteCheckpoint, FormatError) as e:
        return layout_report(path, 0, None, e, 0)
    with opened as src:
        return verify_source(path, src)


def _remote_source(url: str) -> Source:
    """The committed object at ``url`` (its record's size and digest checked, R-O14)."""
    from .remote import get_checkpoint

    return Source(url, data=get_checkpoint(url))


def verify_source(path: str, src: Source) -> Report:
    """:func:`verify` of an open source (a file, or an object's bytes already checked against its
    commit record), named ``path`` in the report."""
    layout: Layout | None = None
    hashed = 0
    try:
        layout = read_layout(src)
        if not layout.legacy:
            scratch = bytearray(_CHUNK * 4)
            check_skeleton(src, layout, scratch)
            check_flags(layout)
            hashed, error = check_all_tensors(src, layout)
            if error is not None:
                raise error
    except FormatError as e:
        return layout_report(path, src.size, layout, e, hashed)
    except MemoryError:  # no verdict on the bytes: say so, never as damage and never as a bare MemoryError
        oom = InsufficientMemory(
            f"{path}: ran out of memory while verifying it ({src.size} bytes); the file is neither damaged nor "
            "sound by this run: free memory or raise the limit (ulimit -v, the cgroup) and verify again"
        )
        return layout_report(path, src.size, layout, oom, hashed)
    return layout_report(path, src.size, layout, None, hashed)


def layout_report(path: str, size: int, layout: Layout | None, error: CheckpointError | None, hashed: int) -> Report:
    """The :class:`Report` on a file whose layout was read (``layout`` None: not even that);
    :func:`verify` and ``ckptkit inspect`` both build theirs here, so the two list the same sections."""
    if layout is None:
        return Report(path, False, error, None, None, (), False, (), (), size, hashed)
    return Report(
        path,
        error is None,
        error,
        layout.version,
        layout.step,
        layout.flag_names,
        layout.legacy,
        layout.missing,
        section_infos(layout),
        size,
        hashed,
    )


# ---------------------------------------------------------------------------- writing


def write_container(f: BinaryIO, *, step: int, flags: int, plans: dict[str, SectionPlan | None]) -> None:
    """Stream a v2 container into ``f`` (an unbuffered binary file at position 0).

    Raises:
        OSError: from the writes (the caller, :func:`ckptkit.format.atomic.atomic_write`,
            turns it into :class:`~ckptkit.errors.SaveFailed`).
    """
    if not 0 <= step < 2**64:
        raise ValueError(f"step must be in [0, 2**64) (got {step})")
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"flags has unknown bits set: 0x{flags & ~_KNOWN_FLAGS:x}")
    ordered = [plans.get(name) for name in SECTIONS]
    lens = [0 if p is None else p.length for p in ordered]
    header = _HEADER.pack(MAGIC, step, lens[0], lens[1], lens[2], flags, lens[3])
    write_framed(f, header, ordered, _TRAILER_MAGIC)


def write_framed(f: BinaryIO, header: bytes, plans: list[SectionPlan | None], end_magic: bytes) -> None:
    """Write ``header``, the sections back to back, and the trailer.

    Tensor bytes are hashed and written in one pass, chunk by chunk (the chunk is
    still in cache when it is written); the indexes are re-written in place with
    the real digests, and the skeleton digest is computed last over the in-memory
    skeleton pieces (header, indexes, padding, compressed regions).
    """
    fd = f.fileno()
    write_all(fd, memoryview(header))
    pos = len(header)
    behind = WriteBehind(fd)
    index_at: list[tuple[int, SectionPlan]] = []
    for plan in plans:
        if plan is None:
            continue
        write_all(fd, memoryview(_U64.pack(len(plan.index)) + plan.index))
        index_at.append((pos + 8, plan))
        write_zeros(fd, plan.data_start_rel - 8 - len(plan.index))
        plan.digests = []
        if plan.codec == "raw":
            off = 0
            data_at = pos + plan.data_start_rel
            for rec, buf in zip(plan.records, plan.buffers, strict=True):
                write_zeros(fd, rec[2] - off)
                h = xxhash.xxh3_64()
                for i in range(0, buf.nbytes, _CHUNK):
                    piece = buf[i : i + _CHUNK]
                    h.update(piece)
                    write_all(fd, piece)
                    behind.reached(data_at + rec[2] + i + piece.nbytes)
                plan.digests.append(h.intdigest())
                off = rec[2] + rec[3]
            write_zeros(fd, plan.data_len - off)
        else:
            assert plan.stored is not None
            plan.digests = [xxhash.xxh3_64_intdigest(b) for b in plan.buffers]
            write_all(fd, memoryview(plan.stored))
        pos += plan.length
    skeleton = xxhash.xxh3_64(header)
    for at, plan in index_at:
        final = plan.final_index()
        os.pwrite(fd, final, at)
        skeleton.update(_U64.pack(len(final)))
        skeleton.update(final)
        _hash_zeros(skeleton, plan.data_start_rel - 8 - len(final))
        if plan.codec == "raw":
            off = 0
            for rec in plan.records:
                _hash_zeros(skeleton, rec[2] - off)
                off = rec[2] + rec[3]
            _hash_zeros(skeleton, plan.data_len - off)
        else:
            assert plan.stored is not None
            skeleton.update(plan.stored)
    os.pwrite(fd, _TRAILER.pack(skeleton.intdigest(), end_magic), pos)


def _hash_zeros(h: xxhash.xxh3_64, n: int) -> None:
    while n:
        k = min(n, len(ZEROS))
        h.update(ZEROS[:k])
        n -= k


def _encode_v1(step: int, model: SectionPlan | None, optim: SectionPlan | None) -> bytes:
    """Bytes of a legacy v1 container. ckptkit never writes v1 for a run; this exists
    so that ``fixtures/generate.py`` and the tests can produce legacy files."""
    lens = [0 if p is None else p.length for p in (model, optim)]
    out = bytearray(_V1_HEADER.pack(step, *lens))
    for plan in (model, optim):
        if plan is None:
            continue
        start = len(out)
        out += _U64.pack(len(plan.index)) + plan.index
        out += bytes(start + plan.data_start_rel - len(out))
        region = bytearray(plan.data_len)
        for rec, buf in zip(plan.records, plan.buffers, strict=True):
            region[rec[2] : rec[2] + rec[3]] = buf
        out += region
    return bytes(out)
