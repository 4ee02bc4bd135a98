"""Private: the container's tensor engine: reading tensors into their destinations and
hashing them against their digests, in parallel, with bounded memory (R-007, R-008).

:mod:`~ckptkit.format._container` says where the bytes lie and what a digest must be
(:class:`~ckptkit.format._container.TensorCheck`); this module moves them: raw sections
by positional reads hashed piece by piece, a zstd section decoded as a stream (one frame,
the window bounded, never held whole), small tensors in batches, the earliest failure in
the file reported. ``spec/performance.md`` says why each knob has its value.
"""

from __future__ import annotations

import functools
import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import FormatError, MalformedIndex
from ._container import _CHUNK, Layout, TensorCheck
from ._io import Source, cpus, run_keyed
from ._section import SectionIndex

__all__ = ["MAX_ZSTD_WINDOW", "check_all_tensors", "check_mapped", "check_tensors", "read_tensors"]

# Performance knobs (none of them is format; spec/performance.md says why each value).
_PARALLEL_MIN = 32 << 20  # read_tensors uses threads only when there is at least this much to read
_READ_PIECE = 256 << 10  # read_tensors: a piece read into its destination is hashed while still in L2
_BATCH_BYTES = 4 << 20  # tensors smaller than this are read and checked in batches of about this many bytes...
_BATCH_COUNT = 1024  # ... or of this many tensors: one task per batch, not per tensor (G-04)


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
