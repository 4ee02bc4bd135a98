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

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import xxhash

from ..errors import (
    BadMagic,
    BadTensorValue,
    ChecksumMismatch,
    FormatError,
    ReservedBitSet,
    TruncatedFile,
    UnsupportedVersion,
)
from ._io import ZEROS, Source, WriteBehind, open_regular, write_all, write_zeros
from ._section import SectionIndex, SectionPlan, decode_index

__all__ = [
    "FLAG_FP32_FALLBACK",
    "FLAG_NAMES",
    "HEADER_SIZE",
    "LEGACY_MISSING",
    "MAGIC",
    "SECTIONS",
    "VERSION",
    "Layout",
    "Source",
    "open_regular",
    "read_layout",
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
_SMALL_EXTENT = 256 << 10  # check_skeleton reads a skeleton extent up to this long with one pread


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


def read_layout(src: Source, *, deferred: bool = False) -> Layout:
    """Parse the header and every section index, checking all lengths.

    ``deferred`` (the lazy reader's): of a v2 file's indexes, check now only what the
    skeleton digest needs (the maps, the lengths, the tensor extents); each section's
    records and tree are checked on their first use (``SectionIndex.tree``, ``.tensors``).

    Raises:
        BadMagic, UnsupportedVersion, TruncatedFile, MalformedIndex: see spec R-001..R-016.
    """
    head = src.pread(0, min(src.size, 8), "magic") if src.size else b""
    if head[:4] == _MAGIC_PREFIX:
        check_magic(src, MAGIC, "container", "R-001", refused="malformed magic", version_error=_version_error)
        return _read_v2_body(src, deferred)
    return _read_v1(src, head)


def _read_v2_body(src: Source, deferred: bool = False) -> Layout:
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
    sections, trailer_at, digest = read_framed(src, _HEADER.size, lengths, offsets, _TRAILER_MAGIC, deferred=deferred)
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
    src: Source,
    header_size: int,
    lengths: dict[str, int],
    len_offsets: dict[str, int],
    end_magic: bytes,
    *,
    deferred: bool = False,
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
    sections = {
        name: _read_section(src, name, starts[name], n, legacy=False, deferred=deferred) for name, n in lengths.items()
    }
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


def _read_section(
    src: Source, name: str, start: int, length: int, *, legacy: bool, deferred: bool = False
) -> SectionIndex | None:
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
    return decode_index(
        raw, name=name, start=start, length=length, index_len=index_len, legacy=legacy, path=src.path, deferred=deferred
    )


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
    for a, b in skeleton_extents(layout):  # one pass: a million gaps are never listed
        if b - a <= _SMALL_EXTENT:  # an index or the padding between tensors: one pread, no scratch
            h.update(src.pread(a, b - a, "skeleton"))
            continue
        if scratch is None:  # allocated only for a long extent (a zstd region): 1 MiB costs its zeroing
            scratch = bytearray(_CHUNK)
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


# ---------------------------------------------------------------------------- writing


def write_container(f: BinaryIO, *, step: int, flags: int, plans: dict[str, SectionPlan | None]) -> None:
    """Stream a v2 container into ``f`` (an unbuffered binary file at position 0).

    Raises:
        OSError: from the writes (the caller, :func:`ckptkit.format._atomic.atomic_write`,
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


def write_framed(f: BinaryIO, header: bytes, plans: list[SectionPlan | None], end_magic: bytes) -> int:
    """Write ``header``, the sections back to back, and the trailer; the trailer's skeleton digest.

    Tensor bytes are hashed and written in one pass, chunk by chunk (the chunk is
    still in cache when it is written); each section's index is re-written in place with
    the real digests once its data is written, and the skeleton digest is computed last over
    the in-memory skeleton pieces (header, indexes, padding, compressed regions). Those
    indexes are the only bytes written twice: a :class:`~._io.Followed` file's reader is told
    each is held until it is final, and that each byte before the writer is final as it is
    written (spec/objectstore.md R-O52).
    """
    fd = f.fileno()
    write_all(fd, memoryview(header))
    pos = len(header)
    behind = WriteBehind(f)
    written: list[SectionPlan] = []
    for plan in plans:
        if plan is None:
            continue
        behind.hold(pos + 8, pos + 8 + len(plan.index))  # its digests are filled in after its data
        write_all(fd, memoryview(_U64.pack(len(plan.index)) + plan.index))
        written.append(plan)
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
        os.pwrite(fd, plan.final_index(), pos + 8)  # its digests known: the index is final now
        behind.release(pos + 8, pos + 8 + len(plan.index))
        pos += plan.length
        behind.reached(pos)
    return _write_trailer(fd, header, written, pos, end_magic)


def _write_trailer(fd: int, header: bytes, written: list[SectionPlan], pos: int, end_magic: bytes) -> int:
    """The end of :func:`write_framed`: the trailer at ``pos`` with the skeleton digest of the
    ``written`` sections, which is returned."""
    skeleton = xxhash.xxh3_64(header)
    for plan in written:
        final = plan.final_index()
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
    return skeleton.intdigest()


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
