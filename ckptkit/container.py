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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import xxhash

from .errors import (
    BadMagic,
    CheckpointError,
    CheckpointNotFound,
    ChecksumMismatch,
    FormatError,
    MalformedIndex,
    ReservedBitSet,
    TruncatedFile,
    UnsupportedVersion,
)
from .section import SectionIndex, SectionPlan, decode_index

__all__ = [
    "FLAG_FP32_FALLBACK",
    "FLAG_NAMES",
    "LEGACY_MISSING",
    "MAGIC",
    "Layout",
    "Report",
    "SECTIONS",
    "SectionInfo",
    "VERSION",
    "HEADER_SIZE",
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


# ---------------------------------------------------------------------------- reading


class Source:
    """Positional reads from a file or bytes, raising TruncatedFile on a short read."""

    def __init__(self, path: str | os.PathLike[str] | None = None, data: bytes | None = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self._data = data
        self._fd = -1
        if data is None:
            assert self.path is not None
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointNotFound(f"{self.path}: no such checkpoint file") from None
            except IsADirectoryError:
                raise CheckpointNotFound(f"{self.path}: is a directory, not a checkpoint file") from None
            self.size = os.fstat(self._fd).st_size
        else:
            self.size = len(data)

    @property
    def fd(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pread(self, offset: int, n: int, field: str) -> bytes:
        if offset + n > self.size:
            raise TruncatedFile(
                f"needs {n} bytes but the file ends at {self.size}",
                path=self.path, offset=offset, field=field, expected=offset + n, actual=self.size,
            )
        if self._data is not None:
            return self._data[offset : offset + n]
        out = os.pread(self._fd, n, offset)
        if len(out) != n:  # the file shrank under us
            raise TruncatedFile("file shrank while reading", path=self.path, offset=offset, field=field)
        return out

    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset`` (the caller has checked the bounds)."""
        if self._data is not None:
            buf[:] = self._data[offset : offset + buf.nbytes]
            return
        done = 0
        while done < buf.nbytes:
            got = os.preadv(self._fd, [buf[done:]], offset + done)
            if got <= 0:
                raise TruncatedFile("file shrank while reading", path=self.path, offset=offset + done)
            done += got

    def chunks(self, start: int, end: int, scratch: bytearray) -> Iterator[memoryview]:
        """Yield the bytes of ``[start, end)`` in chunks, reusing ``scratch``."""
        mv = memoryview(scratch)
        pos = start
        while pos < end:
            n = min(len(scratch), end - pos)
            self.readinto(pos, mv[:n])
            yield mv[:n]
            pos += n


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
        return _read_v2(src, head)
    return _read_v1(src, head)


def _read_v2(src: Source, head: bytes) -> Layout:
    if len(head) < 8 or head[4] != 0 or head[7] != 0:
        raise BadMagic("malformed magic", path=src.path, offset=0, field="magic",
                       expected=repr(MAGIC), actual=repr(head), hint="R-001")
    version = struct.unpack_from("<H", head, 5)[0]
    if version != VERSION:
        newer = "a newer ckptkit wrote it; upgrade ckptkit" if version > VERSION else "not a version ckptkit ever wrote"
        raise UnsupportedVersion(f"container version {version} is not supported", path=src.path, offset=5,
                                 field="magic", expected=f"version {VERSION} (or a legacy v1 file)",
                                 actual=version, hint=f"{newer} (R-002)")
    _, step, m, o, t, flags, mon = _HEADER.unpack(src.pread(0, _HEADER.size, "header"))
    lengths = {"model": m, "optim": o, "teacher": t, "monitor": mon}
    offsets = {name: _FIELD_OFFSET[name] for name in lengths}
    sections, trailer_at, digest = read_framed(src, _HEADER.size, lengths, offsets, _TRAILER_MAGIC)
    return Layout(src.path, VERSION, step, flags, sections, False, (), src.size, trailer_at, digest)


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
        raise BadMagic("trailer end magic is wrong", path=src.path, offset=trailer_at + 8, field="trailer",
                       expected=repr(end_magic), actual=repr(got_magic), hint="R-005")
    sections = {name: _read_section(src, name, starts[name], n, legacy=False) for name, n in lengths.items()}
    return sections, trailer_at, digest


def _read_v1(src: Source, head: bytes) -> Layout:
    if src.size < _V1_HEADER.size:
        raise BadMagic("not a ckptkit checkpoint: too short for any header", path=src.path, offset=0,
                       field="magic", expected=f">= {_V1_HEADER.size} bytes", actual=src.size, hint=_foreign_hint(head))
    step, m, o = _V1_HEADER.unpack(src.pread(0, _V1_HEADER.size, "v1 header"))
    if _V1_HEADER.size + m + o != src.size:
        raise BadMagic(
            f"no DMCK magic, and not a legacy v1 container either: its header claims "
            f"24 + model {m} + optim {o} bytes",
            path=src.path, offset=0, field="magic", expected=f"file size {_V1_HEADER.size + m + o}",
            actual=src.size, hint=_foreign_hint(head),
        )
    lengths = {"model": m, "optim": o}
    starts = _place_sections(src, _V1_HEADER.size, lengths, {"model": 8, "optim": 16}, reserve=0)
    sections: dict[str, SectionIndex | None] = {
        name: _read_section(src, name, starts[name], lengths[name], legacy=True) for name in _V1_SECTIONS
    }
    sections.update({"teacher": None, "monitor": None})
    return Layout(src.path, 1, step, 0, sections, True, LEGACY_MISSING, src.size, None, None, _V1_HEADER.size)


def _foreign_hint(head: bytes) -> str:
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return ("this looks like a torch.save (zip/pickle) file; ckptkit never unpickles — "
                "import it once with ckptkit.import_torch_checkpoint (R-001)")
    return "R-001"


def _place_sections(
    src: Source, first: int, lengths: dict[str, int], len_offsets: dict[str, int], *, reserve: int
) -> dict[str, int]:
    starts, pos = {}, first
    for name, n in lengths.items():
        if pos + n + reserve > src.size:
            raise TruncatedFile(
                f"{name} section of {n} bytes at offset {pos} runs past the end of the file",
                path=src.path, offset=len_offsets[name],
                field=f"{name}_len", expected=f"<= {src.size - pos - reserve}", actual=n, hint="R-003",
            )
        starts[name] = pos
        pos += n
    if pos + reserve != src.size:
        raise TruncatedFile(f"{src.size - pos - reserve} unexpected bytes after the last section",
                            path=src.path, offset=pos, field="trailer", expected=pos + reserve,
                            actual=src.size, hint="R-003")
    return starts


def _read_section(src: Source, name: str, start: int, length: int, *, legacy: bool) -> SectionIndex | None:
    if length == 0:
        return None
    if length < 8:
        raise TruncatedFile(f"{name} section is {length} bytes, shorter than its index_len field",
                            path=src.path, offset=start, field=name, expected=">= 8", actual=length, hint="R-004")
    index_len = _U64.unpack(src.pread(start, 8, f"{name} index_len"))[0]
    if 8 + index_len > length:
        raise TruncatedFile(f"{name} index of {index_len} bytes does not fit in its {length}-byte section",
                            path=src.path, offset=start, field=f"{name} index_len",
                            expected=f"<= {length - 8}", actual=index_len, hint="R-004")
    raw = src.pread(start + 8, index_len, f"{name} index")
    return decode_index(raw, name=name, start=start, length=length, index_len=index_len, legacy=legacy,
                        path=src.path)


def skeleton_extents(layout: Layout) -> list[tuple[int, int]]:
    """Absolute byte ranges covered by the skeleton digest, in file order."""
    assert layout.trailer_offset is not None
    out = [(0, layout.header_size)]
    for sec in layout.sections.values():
        if sec is not None:
            out.extend(sec.skeleton_extents())
    out.append((layout.trailer_offset, layout.trailer_offset))  # digest field itself excluded
    return [(a, b) for a, b in out if b > a]


def check_skeleton(src: Source, layout: Layout, scratch: bytearray | None = None) -> None:
    """Hash every non-tensor byte and compare with the trailer (R-005).

    Raises:
        ChecksumMismatch: naming the trailer offset and both digests.
    """
    h = xxhash.xxh3_64()
    scratch = scratch if scratch is not None else bytearray(_CHUNK)
    for a, b in skeleton_extents(layout):
        for chunk in src.chunks(a, b, scratch):
            h.update(chunk)
    got = h.intdigest()
    if got != layout.skeleton_digest:
        raise ChecksumMismatch(
            "skeleton digest (header, indexes, padding) does not match",
            path=src.path, offset=layout.trailer_offset, field="trailer",
            expected=f"0x{layout.skeleton_digest:016x}", actual=f"0x{got:016x}",
            hint="the file is corrupt; resume from an earlier checkpoint (R-005)",
        )


def check_flags(layout: Layout) -> None:
    """Refuse flag bits this reader cannot honour (R-006)."""
    unknown = layout.flags & ~_KNOWN_FLAGS
    if unknown:
        bit = (unknown & -unknown).bit_length() - 1
        raise ReservedBitSet(
            f"reserved bit {bit} set", path=layout.path, offset=_FIELD_OFFSET["flags"], field="flags",
            expected=0, actual=f"0x{unknown:x}",
            hint="a newer ckptkit wrote state this reader cannot restore; upgrade ckptkit (R-006)",
        )


def tensor_mismatch(src_path: str | None, sec: SectionIndex, i: int, got: int) -> ChecksumMismatch:
    rec = sec.tensors[i]
    where = sec.data_start + rec.offset if sec.codec == "raw" else sec.data_start
    return ChecksumMismatch(
        f"tensor {i} ({rec.dtype}{list(rec.shape)}) digest does not match its bytes",
        path=src_path, offset=where, field=f"{sec.name} data",
        expected=f"0x{rec.digest:016x}", actual=f"0x{got:016x}",
        hint="the file is corrupt; resume from an earlier checkpoint (R-007)",
    )


def decoded_region(src: Source, sec: SectionIndex) -> bytes:
    """The raw data region of a compressed section, decompressed and length-checked (R-008)."""
    import zstandard

    stored = src.pread(sec.data_start, sec.data_len, f"{sec.name} data")
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False)
        while len(out) <= sec.raw_len:
            piece = reader.read(min(_CHUNK, sec.raw_len + 1 - len(out)))
            if not piece:
                break
            out += piece
    except zstandard.ZstdError as e:
        raise MalformedIndex(f"zstd data region does not decompress: {e}", path=src.path,
                             offset=sec.data_start, field=f"{sec.name} data", hint="R-008") from None
    if len(out) != sec.raw_len:
        raise MalformedIndex("zstd data region decompresses to the wrong length", path=src.path,
                             offset=sec.data_start, field=f"{sec.name} data", expected=sec.raw_len,
                             actual=len(out) if len(out) <= sec.raw_len else f"> {sec.raw_len}", hint="R-008")
    return bytes(out)


def check_tensors(src: Source, sec: SectionIndex, scratch: bytearray) -> int:
    """Hash every tensor of a v2 section against its digest; returns bytes hashed (R-007)."""
    if sec.codec == "raw":
        total = 0
        for i, rec in enumerate(sec.tensors):
            h = xxhash.xxh3_64()
            a = sec.data_start + rec.offset
            for chunk in src.chunks(a, a + rec.nbytes, scratch):
                h.update(chunk)
            if h.intdigest() != rec.digest:
                raise tensor_mismatch(src.path, sec, i, h.intdigest())
            total += rec.nbytes
        return total
    region = decoded_region(src, sec)
    for i, rec in enumerate(sec.tensors):
        got = xxhash.xxh3_64_intdigest(memoryview(region)[rec.offset : rec.offset + rec.nbytes])
        if got != rec.digest:
            raise tensor_mismatch(src.path, sec, i, got)
    return sec.raw_len


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


def section_infos(layout: Layout) -> tuple[SectionInfo, ...]:
    """Per-section summary for reports (absent sections included, length 0)."""
    out, pos = [], 8 * 3 if layout.legacy else _HEADER.size
    names = _V1_SECTIONS if layout.legacy else SECTIONS
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
        path: a checkpoint file.

    Returns:
        A :class:`Report`; ``report.ok`` is False and ``report.error`` holds the typed
        error when the file is corrupt, truncated, of an unknown version, or has a
        reserved flag set. A legacy v1 file that parses is ``ok`` (it has no digests to
        check; ``missing`` says so).

    Raises:
        CheckpointNotFound: ``path`` does not exist or is a directory.

    Example:
        >>> report = verify("run/step-00000100.ckpt")  # doctest: +SKIP
        >>> report.ok, report.step
        (True, 100)
    """
    path = os.fspath(path)
    with Source(path) as src:
        layout: Layout | None = None
        hashed = 0
        try:
            layout = read_layout(src)
            if not layout.legacy:
                scratch = bytearray(_CHUNK * 4)
                check_skeleton(src, layout, scratch)
                check_flags(layout)
                for sec in layout.sections.values():
                    if sec is not None:
                        hashed += check_tensors(src, sec, scratch)
        except FormatError as e:
            return _report(path, src.size, layout, e, hashed)
        return _report(path, src.size, layout, None, hashed)


def _report(path: str, size: int, layout: Layout | None, error: CheckpointError | None, hashed: int) -> Report:
    if layout is None:
        return Report(path, False, error, None, None, (), False, (), (), size, hashed)
    return Report(path, error is None, error, layout.version, layout.step, layout.flag_names, layout.legacy,
                  layout.missing, section_infos(layout), size, hashed)


# ---------------------------------------------------------------------------- writing


def _write_all(fd: int, buf: memoryview) -> None:
    while buf.nbytes:
        n = os.write(fd, buf)
        buf = buf[n:]


_ZEROS = memoryview(bytes(4096))


def _write_zeros(fd: int, n: int) -> None:
    while n:
        k = min(n, len(_ZEROS))
        _write_all(fd, _ZEROS[:k])
        n -= k


def write_container(f: BinaryIO, *, step: int, flags: int, plans: dict[str, SectionPlan | None]) -> None:
    """Stream a v2 container into ``f`` (an unbuffered binary file at position 0).

    Raises:
        OSError: from the writes (the caller, :func:`ckptkit.atomic.atomic_write`,
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
    _write_all(fd, memoryview(header))
    pos = len(header)
    index_at: list[tuple[int, SectionPlan]] = []
    for plan in plans:
        if plan is None:
            continue
        _write_all(fd, memoryview(_U64.pack(len(plan.index)) + plan.index))
        index_at.append((pos + 8, plan))
        _write_zeros(fd, plan.data_start_rel - 8 - len(plan.index))
        plan.digests = []
        if plan.codec == "raw":
            off = 0
            for rec, buf in zip(plan.records, plan.buffers):
                _write_zeros(fd, rec[2] - off)
                h = xxhash.xxh3_64()
                for i in range(0, buf.nbytes, _CHUNK):
                    piece = buf[i : i + _CHUNK]
                    h.update(piece)
                    _write_all(fd, piece)
                plan.digests.append(h.intdigest())
                off = rec[2] + rec[3]
            _write_zeros(fd, plan.data_len - off)
        else:
            assert plan.stored is not None
            plan.digests = [xxhash.xxh3_64_intdigest(b) for b in plan.buffers]
            _write_all(fd, memoryview(plan.stored))
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
        k = min(n, len(_ZEROS))
        h.update(_ZEROS[:k])
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
        for rec, buf in zip(plan.records, plan.buffers):
            region[rec[2] : rec[2] + rec[3]] = buf
        out += region
    return bytes(out)
