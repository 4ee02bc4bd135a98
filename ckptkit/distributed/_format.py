"""The files of a distributed checkpoint directory: per-rank data, metadata last.

A distributed checkpoint (``spec/distributed.md``) is a directory::

    rank-00000.ckdcp ... rank-<W-1>.ckdcp   one data file per rank, written by that rank
    metadata.ckdcp                          written by the coordinator, last: the commit

A data file is a small header, one section in the container's section encoding
(``spec/container.md`` §5: msgpack index, 64-byte aligned raw tensor bytes, one
xxh3-64 digest per stored chunk) and the container's trailer shape. The metadata
file has the same frame around one tensor-free section holding DCP's ``Metadata``
as plain msgpack: tensor properties, chunk boxes, where each chunk lives (rank,
offset, length, digest), the non-tensor leaves themselves, the planner's key
mapping. Nothing is pickle. A directory without ``metadata.ckdcp`` is an
incomplete checkpoint: the save did not commit on every rank.

This module is torch-free (``ckptkit verify DIR`` starts in milliseconds); the DCP
storage classes in :mod:`ckptkit.distributed._storage` use it.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

from ..errors import (
    BadMagic,
    CheckpointError,
    CheckpointNotFound,
    ChecksumMismatch,
    FormatError,
    IncompleteCheckpoint,
    MalformedIndex,
    UnreadableFile,
)
from ..format._atomic import atomic_write
from ..format._container import Layout, Source, check_magic, check_skeleton, read_framed, write_framed
from ..format._section import DTYPE_SIZES, MAX_NDIM, SectionIndex, TensorRecord, TensorRef, check_plain, plan_section

__all__ = [
    "DCP_DEFAULT_METADATA",
    "FORMAT_VERSION",
    "METADATA_NAME",
    "Chunk",
    "DataChunks",
    "DataFile",
    "DirMetadata",
    "DirReport",
    "RankFile",
    "TensorEntry",
    "data_name",
    "read_metadata",
    "metadata_writer",
    "verify_directory",
    "write_data",
    "write_data_file",
    "write_metadata",
]

FORMAT_VERSION = 1
#: The commit: written by the coordinator after every rank's data file is durable.
METADATA_NAME = "metadata.ckdcp"
#: What DCP's default filesystem backend names its (pickled) metadata.
DCP_DEFAULT_METADATA = ".metadata"
_DATA_MAGIC = b"DMDR\x00" + struct.pack("<H", FORMAT_VERSION) + b"\x00"
_DATA_END = b"DMDREND\x00"
_META_MAGIC = b"DMDM\x00" + struct.pack("<H", FORMAT_VERSION) + b"\x00"
_META_END = b"DMDMEND\x00"
_DATA_HEADER = struct.Struct("<8sQQQ")  # magic, rank, world_size, data_len
_META_HEADER = struct.Struct("<8sQQ")  # magic, world_size, meta_len
_TRAILER_LEN = 16
_U64 = struct.Struct("<Q")
_META_KEYS = ("dcp_version", "files", "planner_data", "tensors", "values", "world_size")
#: Most ranks a metadata file may name: bounds what a hostile file makes a reader stat.
MAX_WORLD = 1 << 20


def data_name(rank: int) -> str:
    """The file name of ``rank``'s data file (fixed: the metadata never carries paths)."""
    return f"rank-{rank:05d}.ckdcp"


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: where it sits in the tensor and in the files."""

    offsets: tuple[int, ...]  # first element of the box, per dimension
    sizes: tuple[int, ...]  # extent of the box, per dimension
    rank: int  # whose data file holds it
    offset: int  # absolute byte offset in that file (64-aligned)
    nbytes: int  # stored length: prod(sizes) x itemsize, or the transformed length
    digest: int  # xxh3-64 of the nbytes stored bytes: the whole chunk is the unit of verification
    transforms: tuple[str, ...] = ()  # DCP stream-extension descriptors, in reading order (R-DC11)


@dataclass(frozen=True)
class TensorEntry:
    """A logical tensor of the checkpoint: dtype, global size, and its chunks."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class RankFile:
    """What the metadata records about one rank's data file."""

    size: int
    digest: int  # the data file's skeleton digest (its trailer), binding it to this commit


@dataclass(frozen=True)
class DirMetadata:
    """The decoded ``metadata.ckdcp``."""

    world_size: int
    dcp_version: str | None
    files: tuple[RankFile, ...]
    tensors: dict[str, TensorEntry]
    values: dict[str, Any]  # the non-tensor leaves (step, lr, param_groups...), as plain values
    planner_data: Any


# ---------------------------------------------------------------------------- writing


#: ``(fqn, offsets, dtype, sizes, bytes)`` per stored chunk of a rank, in plan order.
DataChunks = list[tuple[str, tuple[int, ...], str, tuple[int, ...], memoryview]]
#: A written data file: its record for the metadata, and ``(absolute offset, nbytes, digest)`` per chunk.
DataFile = tuple[RankFile, list[tuple[int, int, int]]]


def write_data_file(directory: str, rank: int, world_size: int, chunks: DataChunks) -> DataFile:
    """Write one rank's data file atomically (temp file, fsync, rename, fsync dir): :func:`write_data`'s
    bytes and results.

    Raises:
        SaveFailed: the write failed; nothing of a previous commit is touched.
    """
    out: list[DataFile] = []
    path = os.path.join(directory, data_name(rank))
    atomic_write(path, lambda f: out.append(write_data(f, rank, world_size, chunks)))
    return out[0]


def write_data(f: BinaryIO, rank: int, world_size: int, chunks: DataChunks) -> DataFile:
    """Write one rank's data file into ``f`` (an unbuffered file at position 0; a
    :class:`~ckptkit.format._io.Followed` one is uploaded while it is written, spec/objectstore.md R-O52).

    Raises:
        OSError: from the writes.
    """
    tree = [[fqn, list(offsets), TensorRef(i)] for i, (fqn, offsets, _, _, _) in enumerate(chunks)]
    plan = plan_section(tree, [(dt, sizes, buf) for _, _, dt, sizes, buf in chunks], start=_DATA_HEADER.size)
    header = _DATA_HEADER.pack(_DATA_MAGIC, rank, world_size, plan.length)
    digest = write_framed(f, header, [plan], _DATA_END)
    base = _DATA_HEADER.size + plan.data_start_rel
    placed = [(base + rec[2], rec[3], d) for rec, d in zip(plan.records, plan.digests, strict=True)]
    return RankFile(_DATA_HEADER.size + plan.length + _TRAILER_LEN, digest), placed


def write_metadata(directory: str, md: DirMetadata) -> None:
    """Commit the checkpoint: write ``metadata.ckdcp`` atomically, last.

    Raises:
        UnsupportedValue: a non-tensor leaf or planner datum that is not plain data.
        SaveFailed: the write failed; the directory stays an incomplete checkpoint.
    """
    atomic_write(os.path.join(directory, METADATA_NAME), metadata_writer(md))


def metadata_writer(md: DirMetadata) -> Callable[[BinaryIO], object]:
    """``write(f)``, which writes ``md`` as ``metadata.ckdcp`` into ``f`` (an unbuffered file at
    position 0), planned now: for :func:`write_metadata`, and for the object a save to ``s3://``
    uploads as it is written (spec/objectstore.md R-O52).

    Raises:
        UnsupportedValue: a non-tensor leaf or planner datum that is not plain data (nothing is written).
    """
    tree = check_plain(_metadata_tree(md), "metadata")
    plan = plan_section(tree, [], start=_META_HEADER.size)
    header = _META_HEADER.pack(_META_MAGIC, md.world_size, plan.length)
    return lambda f: write_framed(f, header, [plan], _META_END)


def _metadata_tree(md: DirMetadata) -> dict[str, Any]:
    return {
        "dcp_version": md.dcp_version,
        "files": [[f.size, _U64.pack(f.digest)] for f in md.files],
        "planner_data": md.planner_data,
        "tensors": {
            fqn: [
                t.dtype,
                list(t.size),
                [_chunk_entry(c) for c in t.chunks],
            ]
            for fqn, t in md.tensors.items()
        },
        "values": dict(md.values),
        "world_size": md.world_size,
    }


def _chunk_entry(c: Chunk) -> list[Any]:
    entry = [list(c.offsets), list(c.sizes), c.rank, c.offset, c.nbytes, _U64.pack(c.digest)]
    return [*entry, list(c.transforms)] if c.transforms else entry


def stored_record(dtype: str, c: Chunk) -> tuple[str, tuple[int, ...]]:
    """The dtype and shape of ``c``'s record in its data file: the chunk's own, or, for a
    transformed chunk, its stored bytes as ``uint8[nbytes]``."""
    return ("uint8", (c.nbytes,)) if c.transforms else (dtype, c.sizes)


# ---------------------------------------------------------------------------- reading


def _meta_layout(src: Source) -> Layout:
    check_magic(src, _META_MAGIC, "distributed metadata file", "R-DC01", hint="the file is damaged or foreign (R-DC01)")
    _, world, n = _META_HEADER.unpack(src.pread(0, _META_HEADER.size, "metadata header"))
    sections, trailer_at, digest = read_framed(src, _META_HEADER.size, {"metadata": n}, {"metadata": 16}, _META_END)
    return Layout(
        src.path, FORMAT_VERSION, world, 0, sections, False, (), src.size, trailer_at, digest, _META_HEADER.size
    )


def data_layout(src: Source) -> tuple[Layout, int]:
    """Parse a data file's frame; returns the layout (``step`` holds the rank) and the world size."""
    check_magic(src, _DATA_MAGIC, "distributed data file", "R-DC02", hint="the file is damaged or foreign (R-DC02)")
    _, rank, world, n = _DATA_HEADER.unpack(src.pread(0, _DATA_HEADER.size, "data header"))
    sections, trailer_at, digest = read_framed(src, _DATA_HEADER.size, {"data": n}, {"data": 24}, _DATA_END)
    return Layout(
        src.path, FORMAT_VERSION, rank, 0, sections, False, (), src.size, trailer_at, digest, _DATA_HEADER.size
    ), world


def check_directory(directory: str) -> str:
    """The metadata path of a committed ckptkit checkpoint in ``directory``, or a typed refusal.

    Raises:
        CheckpointNotFound: no such directory.
        BadMagic: a DCP default-backend checkpoint (pickled metadata; never read).
        IncompleteCheckpoint: rank files but no metadata: a save that did not commit.
    """
    meta = os.path.join(directory, METADATA_NAME)
    if os.path.lexists(meta):  # a FIFO or a directory there is refused by the reader, unread
        return meta
    if not os.path.isdir(directory):
        raise CheckpointNotFound(f"{directory}: no such checkpoint directory")
    if os.path.exists(os.path.join(directory, DCP_DEFAULT_METADATA)):
        raise BadMagic(
            "a checkpoint written by DCP's default filesystem backend: its .metadata is a pickle and its "
            ".distcp files hold torch.save data, which ckptkit never unpickles",
            path=directory,
            field=DCP_DEFAULT_METADATA,
            hint="load it once in a trusted environment with FileSystemReader and save it again with "
            "ckptkit.distributed.save (R-DC10)",
        )
    present = sorted(n for n in os.listdir(directory) if n.startswith("rank-") and n.endswith(".ckdcp"))
    raise IncompleteCheckpoint(
        f"{directory}: incomplete distributed checkpoint: {METADATA_NAME} is missing "
        f"({len(present)} rank data file{'s' if len(present) != 1 else ''} present); the save did not commit on "
        "every rank (a rank failed or was killed); load the previous checkpoint (R-DC03)",
        missing=(METADATA_NAME,),
    )


def read_metadata(directory: str, *, check_files: bool = True) -> DirMetadata:
    """Read and verify ``metadata.ckdcp`` (every byte is digested) and, optionally, every rank file but its chunks.

    With ``check_files`` (what every load does before it reads a chunk, and what ``verify`` checks
    before it hashes them): each rank file is there with its recorded size (R-DC04), and its frame,
    header, skeleton and index are those of this commit, the index naming each chunk where the
    metadata does (R-DC06, :func:`check_data_files`).

    Raises:
        CheckpointNotFound, BadMagic, IncompleteCheckpoint: see :func:`check_directory`;
            ``IncompleteCheckpoint`` also when a rank's data file is missing or has the wrong size.
        FormatError: a damaged or malformed metadata file (names the offset and field), or a rank
            file that is not the one this commit wrote (R-DC02, R-DC06, R-005).
    """
    path = check_directory(directory)
    with Source(path) as src:
        layout = _meta_layout(src)
        check_skeleton(src, layout)
        sec = layout.sections["metadata"]
        md = _decode(sec.tree if sec is not None else None, src.path, sec, layout.step)
    if check_files:
        check_data_files(directory, md)
    return md


def _check_sizes(directory: str, md: DirMetadata) -> None:
    """Every rank file the metadata names is there with the size it records (R-DC04)."""
    problems = []
    for rank, f in enumerate(md.files):
        p = os.path.join(directory, data_name(rank))
        try:
            size = os.stat(p).st_size
        except FileNotFoundError:
            problems.append(f"{data_name(rank)} (rank {rank}) is missing")
            continue
        if size != f.size:
            problems.append(f"{data_name(rank)} (rank {rank}) is {size} bytes, the metadata says {f.size}")
    if problems:
        raise IncompleteCheckpoint(
            f"{directory}: " + "; ".join(problems) + " (R-DC04)", missing=tuple(p.split(" ")[0] for p in problems)
        )


def check_data_files(
    directory: str, md: DirMetadata, on_chunk: Callable[[Source, str, Chunk], None] | None = None
) -> None:
    """R-DC04 and R-DC06 for every rank file: the checks ``verify``, ``load`` and the DCP ``Reader``
    share, so that a metadata file rewritten to point a chunk at other bytes (another chunk's, a
    file's header), its digests made to match, is refused by each of them alike.

    Args:
        on_chunk: called with each data file's open source and each chunk it holds, once the
            file's index matched the metadata (``verify`` hashes the chunk there).

    Raises:
        IncompleteCheckpoint: a rank file missing or of another size (R-DC04).
        FormatError: a rank file that is not this commit's, or whose index names other chunks (R-DC02, R-DC06, R-005).
    """
    _check_sizes(directory, md)
    expect: _Expected = {(fqn, c.offsets): (t.dtype, c) for fqn, t in md.tensors.items() for c in t.chunks}
    for rank, f in enumerate(md.files):
        path = os.path.join(directory, data_name(rank))
        with Source(path) as src:
            for fqn, c in _file_chunks(src, rank, md.world_size, f, expect):
                if on_chunk is not None:
                    on_chunk(src, fqn, c)
    if expect:
        (fqn, offsets), (_, c) = min(expect.items(), key=lambda kv: (kv[0][0], kv[0][1]))
        raise MalformedIndex(
            f"tensor {fqn!r} chunk at {list(offsets)} is in the metadata but in no data file",
            path=os.path.join(directory, data_name(c.rank)),
            field="data index",
            hint="the data file does not belong to this commit (R-DC06)",
        )


def _decode(tree: Any, path: str | None, sec: SectionIndex | None, header_world: int) -> DirMetadata:
    at = None if sec is None else sec.start + 8

    def bad(problem: str, actual: Any = None, rule: str = "R-DC05") -> FormatError:
        return MalformedIndex(
            problem,
            path=path,
            offset=at,
            field="metadata",
            actual=actual,
            hint=f"the metadata is damaged or was not written by ckptkit ({rule})",
        )

    if not isinstance(tree, dict) or sorted(tree) != list(_META_KEYS):
        raise bad(
            "the metadata must be a map with exactly the keys " + ", ".join(_META_KEYS),
            sorted(map(str, tree)) if isinstance(tree, dict) else type(tree).__name__,
        )
    world = tree["world_size"]
    if not _uint(world) or not 1 <= world <= MAX_WORLD or world != header_world:
        raise bad(f"world_size must be 1..{MAX_WORLD} and equal the header's {header_world}", world)
    version = tree["dcp_version"]
    if version is not None and not isinstance(version, str):
        raise bad("dcp_version must be a string or nil", type(version).__name__)
    files = tree["files"]
    if not isinstance(files, list) or len(files) != world:
        raise bad(f"files must list one entry per rank ({world})", _len(files))
    out_files = []
    for f in files:
        if not (isinstance(f, list) and len(f) == 2 and _uint(f[0]) and _digest(f[1])):
            raise bad("a files entry must be [size, digest(bin 8)]", repr(f)[:60])
        out_files.append(RankFile(f[0], _U64.unpack(f[1])[0]))
    tensors, values = tree["tensors"], tree["values"]
    if not isinstance(tensors, dict) or not isinstance(values, dict):
        raise bad("tensors and values must be maps")
    both = set(tensors) & set(values)
    if both:
        raise bad("a key is both a tensor and a value", sorted(both)[0])
    out_tensors = {}
    for fqn, t in tensors.items():
        out_tensors[fqn] = _decode_tensor(fqn, t, out_files, bad)
    _check_extents(out_tensors, bad)
    return DirMetadata(world, version, tuple(out_files), out_tensors, values, tree["planner_data"])


def _decode_tensor(fqn: Any, t: Any, files: list[RankFile], bad: Callable[..., FormatError]) -> TensorEntry:
    if not isinstance(fqn, str):
        raise bad("tensor keys must be strings", repr(fqn)[:60])
    if not (isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and isinstance(t[2], list)):
        raise bad(f"{fqn}: entry must be [dtype, size, chunks]")
    dtype, size, chunks = t
    if dtype not in DTYPE_SIZES:
        raise bad(f"{fqn}: unknown dtype", dtype[:40])
    if not _dims(size):
        raise bad(f"{fqn}: size must be at most {MAX_NDIM} non-negative integers", repr(size)[:60])
    out = []
    for c in chunks:
        if not (
            isinstance(c, list)
            and len(c) in (6, 7)
            and _dims(c[0])
            and _dims(c[1])
            and len(c[0]) == len(size)
            and len(c[1]) == len(size)
            and all(_uint(v) for v in c[2:5])
            and _digest(c[5])
        ):
            raise bad(f"{fqn}: a chunk must be [offsets, sizes, rank, offset, nbytes, digest]", repr(c)[:80])
        offsets, sizes, rank, offset, nbytes = c[:5]
        transforms = _transforms(c[6], fqn, bad) if len(c) == 7 else ()
        if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=False)):
            raise bad(f"{fqn}: chunk at {offsets} of {sizes} runs past the tensor's size {size}")
        if not transforms and nbytes != math.prod(sizes) * DTYPE_SIZES[dtype]:
            raise bad(f"{fqn}: chunk nbytes disagrees with its sizes x itemsize", nbytes)
        if rank >= len(files) or offset + nbytes > files[rank].size:
            raise bad(f"{fqn}: chunk extent [{offset}, {offset + nbytes}) is outside rank {rank}'s data file")
        out.append(Chunk(tuple(offsets), tuple(sizes), rank, offset, nbytes, _U64.unpack(c[5])[0], transforms))
    _check_tiling(fqn, tuple(size), out, bad)
    return TensorEntry(dtype, tuple(size), tuple(out))


#: Most chunk corners R-DC20 sums for one tensor: chunks x 2^(dimensions the chunks split).
MAX_CORNERS = 1 << 22


def _check_tiling(fqn: str, size: tuple[int, ...], chunks: list[Chunk], bad: Callable[..., FormatError]) -> None:
    """R-DC20: the chunks tile the tensor: every element in exactly one chunk, no chunk listed twice.

    Bounded by the metadata, never by the tensor: the signed corners of every chunk
    (a box's corner carries ``(-1)^(upper coordinates)``) sum to the tensor's own corners
    exactly when the chunks cover every element once (the mixed difference of the
    coverage count). Only dimensions some chunk splits are counted; the smallest
    point where the sums differ is an element covered by 0 or by 2+ chunks.
    """
    starts: set[tuple[int, ...]] = set()
    for c in chunks:
        if c.offsets in starts:
            raise bad(f"{fqn}: two chunks start at {list(c.offsets)} (a chunk listed twice)", rule="R-DC20")
        starts.add(c.offsets)
    if math.prod(size) == 0:
        return  # no element to cover; each chunk lies inside the bounds (R-DC05)
    boxes = [c for c in chunks if math.prod(c.sizes)]
    split = [d for d in range(len(size)) if any(c.offsets[d] or c.sizes[d] != size[d] for c in boxes)]
    if len(boxes) == 1 and not split:
        return
    if len(boxes) << len(split) > MAX_CORNERS:
        raise bad(f"{fqn}: {len(boxes)} chunks splitting {len(split)} dimensions are too many to check", rule="R-DC20")
    sums: dict[tuple[int, ...], int] = {}
    whole = [(tuple(0 for _ in size), size, -1)]
    for lo, extent, weight in whole + [(c.offsets, c.sizes, 1) for c in boxes]:
        for mask in range(1 << len(split)):
            point = tuple(lo[d] + extent[d] if mask >> i & 1 else lo[d] for i, d in enumerate(split))
            sums[point] = sums.get(point, 0) + (-weight if mask.bit_count() & 1 else weight)
    wrong = [p for p, v in sums.items() if v]
    if not wrong:
        return
    element = [0] * len(size)
    for d, v in zip(split, min(wrong), strict=True):
        element[d] = v
    n = sum(all(o <= e < o + s for o, s, e in zip(c.offsets, c.sizes, element, strict=True)) for c in boxes)
    held = sum(math.prod(c.sizes) for c in boxes)
    raise bad(
        f"{fqn}: the chunks do not tile the tensor's size {list(size)}: element {element} is in {n} chunks, "
        f"not 1 ({'a gap' if n == 0 else 'an overlap'}; the chunks hold {held} of its {math.prod(size)} elements)",
        rule="R-DC20",
    )


def _check_extents(tensors: dict[str, TensorEntry], bad: Callable[..., FormatError]) -> None:
    """R-DC21: no two chunks share a byte of a data file, so the tensors' stored bytes are bytes present."""
    extents = sorted(
        (c.rank, c.offset, c.nbytes, fqn, list(c.offsets)) for fqn, t in tensors.items() for c in t.chunks if c.nbytes
    )
    for (rank, offset, nbytes, fqn, at), (rank2, offset2, _, fqn2, at2) in itertools.pairwise(extents):
        if rank == rank2 and offset2 < offset + nbytes:
            raise bad(
                f"the chunk of {fqn} at {at} (bytes [{offset}, {offset + nbytes}) of rank {rank}'s data file) and "
                f"the chunk of {fqn2} at {at2} (from byte {offset2}) share bytes",
                rule="R-DC21",
            )


def _transforms(v: Any, fqn: str, bad: Callable[..., FormatError]) -> tuple[str, ...]:
    """A chunk's transforms: a non-empty array of descriptor strings (R-DC11)."""
    if not (isinstance(v, list) and v and all(isinstance(d, str) and 0 < len(d) <= 200 for d in v)):
        raise bad(f"{fqn}: a chunk's transforms must be a non-empty array of descriptor strings", repr(v)[:60])
    return tuple(v)


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _dims(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_NDIM and all(_uint(d) and d < 2**63 for d in v)


def _digest(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) == 8


def _len(v: Any) -> Any:
    return len(v) if isinstance(v, list) else type(v).__name__


def chunk_mismatch(path: str, fqn: str, c: Chunk, got: int) -> ChecksumMismatch:
    """The error for a chunk of the rank file ``path`` (or object URL) whose bytes do not match the
    digest in the metadata."""
    return ChecksumMismatch(
        f"tensor {fqn!r} chunk at {list(c.offsets)} of {list(c.sizes)} ({c.nbytes} bytes): digest does not match",
        path=path,
        offset=c.offset,
        expected=f"0x{c.digest:016x}",
        actual=f"0x{got:016x}",
        hint="the rank data file is damaged; load an earlier checkpoint (R-DC07)",
    )


# ---------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class DirReport:
    """The verdict of :func:`verify_directory`. ``ok`` is False iff ``error`` is set."""

    path: str
    ok: bool
    error: CheckpointError | None
    world_size: int | None
    tensors: int
    chunks: int
    values: int
    size: int  # bytes of every file of the checkpoint
    bytes_hashed: int


def verify_directory(directory: str | os.PathLike[str]) -> DirReport:
    """Check every byte of a distributed checkpoint directory; never raises for bad bytes.

    The metadata's digest, every data file's frame, index and skeleton digest,
    every chunk's digest, and that the data files hold exactly the chunks the
    metadata names, where it names them.

    Raises:
        CheckpointNotFound: no such directory.
    """
    directory = os.fspath(directory)
    md: DirMetadata | None = None
    hashed = [0]
    try:
        md = read_metadata(directory, check_files=False)
        scratch = bytearray(1 << 20)

        def check_chunk(src: Source, fqn: str, c: Chunk) -> None:
            h = xxhash.xxh3_64()
            src.feed(c.offset, c.offset + c.nbytes, h.update, scratch)
            if h.intdigest() != c.digest:
                raise chunk_mismatch(str(src.path), fqn, c, h.intdigest())
            hashed[0] += c.nbytes

        check_data_files(directory, md, check_chunk)
    except CheckpointNotFound as e:
        if not os.path.isdir(directory):
            raise
        return DirReport(directory, False, e, None, 0, 0, 0, _size(directory, md), hashed[0])
    except (FormatError, UnreadableFile) as e:
        world = None if md is None else md.world_size
        return DirReport(directory, False, e, world, 0, 0, 0, _size(directory, md), hashed[0])
    n_chunks = sum(len(t.chunks) for t in md.tensors.values())
    return DirReport(
        directory, True, None, md.world_size, len(md.tensors), n_chunks, len(md.values), _size(directory, md), hashed[0]
    )


def _size(directory: str, md: DirMetadata | None) -> int:
    """Bytes of a checkpoint's files as its metadata records them (0 before the metadata is read)."""
    if md is None:
        return 0
    return os.path.getsize(os.path.join(directory, METADATA_NAME)) + sum(f.size for f in md.files)


_Expected = dict[tuple[str, tuple[int, ...]], tuple[str, Chunk]]  # (fqn, chunk offsets) -> (dtype, chunk)


def _file_chunks(src: Source, rank: int, world: int, f: RankFile, expect: _Expected) -> list[tuple[str, Chunk]]:
    """The chunks of rank ``rank``'s data file, each popped from ``expect`` once its record matched it (R-DC06)."""
    sec = _check_data_frame(src, rank, world, f).sections["data"]
    if sec is None:
        return []
    path = src.path or ""
    return [
        (fqn, _expected_chunk(expect, fqn, offsets, sec, sec.tensors[ref.id], rank, path))
        for fqn, offsets, ref in _data_entries(sec, path)
    ]


def _check_data_frame(src: Source, rank: int, world: int, f: RankFile) -> Layout:
    """The data file's layout, once it is rank ``rank``'s of ``world``, the one this commit wrote, and whole."""
    path = src.path
    layout, file_world = data_layout(src)
    if layout.step != rank or file_world != world:
        raise MalformedIndex(
            "data file belongs to another rank or world size",
            path=path,
            offset=8,
            field="data header",
            expected=f"rank {rank} of {world}",
            actual=f"rank {layout.step} of {file_world}",
            hint="R-DC06",
        )
    if layout.skeleton_digest != f.digest:
        raise ChecksumMismatch(
            "data file is not the one this commit wrote (its digest differs from the metadata's)",
            path=path,
            offset=layout.trailer_offset,
            field="trailer",
            expected=f"0x{f.digest:016x}",
            actual=f"0x{layout.skeleton_digest:016x}",
            hint="a stray or damaged rank file; load an earlier checkpoint (R-DC06)",
        )
    check_skeleton(src, layout)
    return layout


def _data_entries(sec: SectionIndex, path: str) -> list[tuple[str, list[int], TensorRef]]:
    """The data section's tree, checked to be a list of ``[fqn, offsets, tensor]`` (R-DC02)."""
    entries = sec.tree
    if not isinstance(entries, list) or not all(
        isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and _dims(e[1]) and isinstance(e[2], TensorRef)
        for e in entries
    ):
        raise MalformedIndex(
            "data tree must be a list of [fqn, offsets, tensor]",
            path=path,
            offset=sec.start + 8,
            field="data index",
            hint="R-DC02",
        )
    return [(fqn, offsets, ref) for fqn, offsets, ref in entries]


def _expected_chunk(
    expect: _Expected,
    fqn: str,
    offsets: list[int],
    sec: SectionIndex,
    rec: TensorRecord,
    rank: int,
    path: str,
) -> Chunk:
    """The metadata's chunk for a data file's entry, taken from ``expect``; the two must agree (R-DC06)."""
    got = expect.pop((fqn, tuple(offsets)), None)
    if got is None:
        raise MalformedIndex(
            f"tensor {fqn!r} chunk at {offsets} is not in the metadata",
            path=path,
            offset=sec.start + 8,
            field="data index",
            hint="R-DC06",
        )
    dtype, c = got
    want_dtype, want_shape = stored_record(dtype, c)
    stored = (rec.dtype, rec.shape, sec.data_start + rec.offset, rec.nbytes, rec.digest, rank)
    if stored != (want_dtype, want_shape, c.offset, c.nbytes, c.digest, c.rank):
        raise MalformedIndex(
            f"tensor {fqn!r} chunk at {offsets}: the data index and the metadata disagree",
            path=path,
            offset=sec.start + 8,
            field="data index",
            expected=f"{want_dtype}{list(want_shape)} at {c.offset}",
            actual=f"{rec.dtype}{list(rec.shape)} at {sec.data_start + rec.offset}",
            hint="R-DC06",
        )
    return c
