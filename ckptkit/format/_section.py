"""One section of a container: a msgpack index followed by aligned tensor bytes.

A section carries one state tree (a model's ``state_dict()``, an optimizer's nested
state, monitor values...) as data, never code: the tree is msgpack with three
extension types (a tensor reference, a tuple marker, a typed-value marker: §5.4 and
:mod:`ckptkit.format._values`) and the tensors are raw little-endian bytes at 64-byte
aligned offsets, so a reader can map them without copying. Each tensor carries its own
xxh3-64 digest, so a lazy reader can check exactly the tensors it touches.

This module is torch-free: tensors enter as byte buffers (``memoryview``) and leave
as :class:`TensorRecord` extents. ``spec/container.md`` ("Section") is the contract;
the rule ids in error messages point there.

Invariants:
    * The encoding is canonical: map keys sorted (integers, then strings), tensors
      laid out in first-reference order, padding zero. Same tree, same bytes.
    * The parser validates every length and offset against the section bounds
      before anything is allocated, and only ever raises :mod:`ckptkit.errors`.
"""

from __future__ import annotations

import array
import collections
import math
import reprlib
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..errors import FormatError, MalformedIndex, TruncatedFile, UnsupportedValue, UnsupportedVersion
from ._values import (
    CONTAINER_TYPES,
    EXT_TYPED,
    TypedValue,
    decode_leaf,
    encode_numpy,
    encode_torch,
    loaded_key,
    refusal,
)

__all__ = [
    "ALIGN",
    "CODECS",
    "DTYPE_SIZES",
    "MAX_DEPTH",
    "SectionIndex",
    "SectionPlan",
    "TensorRecord",
    "TensorRef",
    "TensorTable",
    "align_up",
    "canonical_bytes",
    "decode_index",
    "plan_section",
]

#: Alignment of every tensor's first byte. 64 covers every dtype and a cache line,
#: and is what mmap-based loaders (and safetensors' users) expect.
ALIGN = 64
#: Deepest nesting of lists/maps in a tree; real state dicts nest ~5 deep. The cap
#: bounds the reader's recursion on hostile input.
MAX_DEPTH = 64
#: Most dimensions a tensor record may claim; the writer refuses more. Real tensors
#: have a handful; the cap bounds the shape product a hostile index can ask for.
MAX_NDIM = 64
#: The most a zstd frame can expand: a block decodes to at most 128 KiB and takes at
#: least 4 bytes (an RLE block). Bounds what a compressed section may claim, so a
#: reader never allocates more than this multiple of what the file holds.
MAX_ZSTD_RATIO = 32768
#: Data region encodings. "zstd": the data region is one zstd frame of the raw region.
CODECS = ("raw", "zstd")

#: The dtype table: name on disk -> bytes per element. Names are torch's, without
#: the ``torch.`` prefix; all multi-byte types are little-endian on disk.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_EXT_TENSOR = 1  # payload: u32le index into the section's tensor table
_EXT_TUPLE = 2  # empty payload; first element of an array that is a tuple
_TUPLE_MARK = msgpack.ExtType(_EXT_TUPLE, b"")
_INDEX_KEYS = ("codec", "data_len", "raw_len", "tensors", "tree")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_DIGEST_PLACEHOLDER = b"\0" * 8


def align_up(n: int, a: int = ALIGN) -> int:
    """Smallest multiple of ``a`` that is >= ``n``."""
    return (n + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A reference from a decoded tree to entry ``id`` of the section's tensor table."""

    id: int


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes live, relative to its section's data region.

    ``digest`` is the xxh3-64 of the ``nbytes`` raw bytes, or ``None`` in a legacy
    (v1) section, which carried none.
    """

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    digest: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_DTYPE_LIST = tuple(DTYPE_SIZES)
_DTYPE_CODE = {name: code for code, name in enumerate(_DTYPE_LIST)}


class TensorTable:
    """A section's tensor table as flat arrays: 33 bytes a tensor and 8 a dimension, whatever the count.

    A file may declare millions of tensors (a million empty ones take 23 bytes each
    in the index); one Python object per record would cost twenty times what the
    file holds (G-04, G-70). Indexing builds a :class:`TensorRecord` on demand; the
    readers that walk every tensor use the arrays (:attr:`offsets`, :attr:`sizes`).
    """

    __slots__ = ("_digests", "_dim_at", "_dims", "_dtypes", "legacy", "offsets", "sizes")

    def __init__(self, legacy: bool) -> None:
        self.legacy = legacy  # a v1 table: no digests
        self._dtypes = array.array("B")  # index into the dtype table
        self.offsets = array.array("Q")  # relative to the decoded data region
        self.sizes = array.array("Q")  # nbytes
        self._digests = array.array("Q")
        self._dims = array.array("Q")  # every shape, back to back
        self._dim_at = array.array("Q", [0])  # tensor i's dimensions are _dims[_dim_at[i]:_dim_at[i + 1]]

    def append(self, dtype: str, shape: list[int], offset: int, nbytes: int, digest: int | None) -> None:
        """Add the record of the next tensor id (its fields already checked)."""
        self._dtypes.append(_DTYPE_CODE[dtype])
        self.offsets.append(offset)
        self.sizes.append(nbytes)
        self._dims.extend(shape)
        self._dim_at.append(len(self._dims))
        if digest is not None:
            self._digests.append(digest)

    def __len__(self) -> int:
        return len(self.offsets)

    def dtype(self, i: int) -> str:
        return _DTYPE_LIST[self._dtypes[i]]

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self._dims[self._dim_at[i] : self._dim_at[i + 1]])

    def digest(self, i: int) -> int | None:
        return None if self.legacy else self._digests[i]

    def __getitem__(self, i: int) -> TensorRecord:
        n = len(self.offsets)
        if not -n <= i < n:
            raise IndexError(f"tensor {i} of a table of {n}")
        i %= n
        return TensorRecord(self.dtype(i), self.shape(i), self.offsets[i], self.sizes[i], self.digest(i))

    def __iter__(self) -> Iterator[TensorRecord]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorTable):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors)"

    def total_nbytes(self) -> int:
        return sum(self.sizes)


class _Body:
    """A section's tensor table and tree: decoded at once, or on first use (the lazy reader's sections).

    A deferred body holds the undecoded index values and the tensor extents (offset and
    size of every record, all the skeleton digest needs); the first use of the table or
    the tree decodes and checks both (R-013..R-018), as :func:`decode_index` does at once.
    Two threads may both decode it: the work is pure and either result is the same.
    """

    __slots__ = ("_bad", "_done", "_extents", "_legacy", "_raw_len", "_values")

    def __init__(
        self,
        extents: tuple[array.array[int], array.array[int]] | None,
        values: dict[str, memoryview],
        raw_len: int,
        legacy: bool,
        bad: Callable[..., FormatError],
    ) -> None:
        self._done: tuple[TensorTable, Any] | None = None
        self._extents: tuple[array.array[int], array.array[int]] | None = extents
        self._values: dict[str, memoryview] | None = values
        self._raw_len, self._legacy, self._bad = raw_len, legacy, bad

    def decoded(self) -> tuple[TensorTable, Any]:
        """``(table, tree)``, decoded and checked on the first call.

        Raises:
            MalformedIndex, UnsupportedVersion: a record or the tree breaks a rule (R-013..R-018).
        """
        done = self._done
        if done is not None:
            return done
        values = self._values
        if values is None:  # another thread finished meanwhile: it sets _done before it drops _values
            done = self._done
            assert done is not None
            return done
        records = _decode_records(values["tensors"], self._raw_len, legacy=self._legacy, bad=self._bad)
        tree = _decode_section_tree(_unpack_value(values["tree"], _Exts(len(records)), self._bad), records, self._bad)
        done = self._done = (records, tree)
        self._values = self._extents = None  # the index bytes go; the table holds the extents now
        return done

    def extents(self) -> tuple[array.array[int], array.array[int]]:
        extents = self._extents
        if extents is None:
            table = self.decoded()[0]
            return table.offsets, table.sizes
        return extents


@dataclass(frozen=True)
class SectionIndex:
    """A parsed section: its tree, tensor table and absolute placement in the file.

    The placement and the index's lengths are checked when it is made; the table and the
    tree are checked then too, or on their first use for a section made with
    ``decode_index(..., deferred=True)`` (the lazy reader's: spec/guarantees.md G-71).
    """

    name: str
    start: int  # absolute offset of the section's first byte
    length: int  # the section length from the container header
    index_len: int
    data_start: int  # absolute offset of the data region
    codec: str
    data_len: int  # stored bytes of the data region
    raw_len: int  # bytes of the data region once decoded
    body: _Body = field(repr=False, compare=False)

    @property
    def tensors(self) -> TensorTable:
        """The tensor table (decoded and checked on first use for a deferred section)."""
        return self.body.decoded()[0]

    @property
    def tree(self) -> Any:
        """The state tree, tensors as :class:`TensorRef` (decoded and checked on first use)."""
        return self.body.decoded()[1]

    def skeleton_extents(self) -> Iterator[tuple[int, int]]:
        """Absolute ``(start, end)`` byte ranges of this section not inside a tensor, in file order.

        These bytes are covered by the container's skeleton digest; a raw
        section's tensor bytes are covered by their own digests instead. A
        generator: a million tensors are a million ranges, never held at once.
        """
        if self.codec != "raw":
            yield (self.start, self.start + self.length)
            return
        pos, base = self.start, self.data_start
        offsets, sizes = self.body.extents()
        for off, n in zip(offsets, sizes, strict=True):
            a = base + off
            if a > pos:
                yield (pos, a)
            if a + n > pos:  # always true (R-014 keeps extents in order, disjoint); a test is cheaper than max()
                pos = a + n
        end = self.start + self.length
        if end > pos:
            yield (pos, end)


# ---------------------------------------------------------------------------- writing


@dataclass
class SectionPlan:
    """A section laid out but not yet written: everything but the tensor digests.

    ``index`` is packed with placeholder digests of the same size as the real
    ones, so the layout (and the container header) is final before any tensor
    byte is written; :meth:`final_index` re-packs it once the digests are known.
    """

    tree: Any
    records: list[list[Any]]
    buffers: list[memoryview]
    codec: str
    data_len: int
    raw_len: int
    index: bytes
    data_start_rel: int  # data region offset from the section start
    stored: bytes | None = None  # the compressed data region, when codec != "raw"
    digests: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.data_start_rel + self.data_len

    def final_index(self) -> bytes:
        if len(self.digests) != len(self.records):
            raise AssertionError("final_index() before every tensor was hashed")
        recs = [[*r[:4], _U64.pack(d)] for r, d in zip(self.records, self.digests, strict=True)]
        out = _pack_index(self.codec, self.data_len, self.raw_len, recs, self.tree)
        if len(out) != len(self.index):
            raise AssertionError("index length changed when digests were filled in")
        return out


def _pack_index(codec: str, data_len: int, raw_len: int, records: list[list[Any]], tree: Any) -> bytes:
    index = {"codec": codec, "data_len": data_len, "raw_len": raw_len, "tensors": records, "tree": tree}
    packed: bytes = msgpack.packb(index, use_bin_type=True)
    return packed


def plan_section(
    tree: Any,
    tensors: list[tuple[str, tuple[int, ...], memoryview]],
    *,
    start: int,
    codec: str = "raw",
    compress: Callable[[bytes], bytes] | None = None,
    legacy: bool = False,
) -> SectionPlan:
    """Lay out one section.

    Args:
        tree: the state tree with tensors already replaced by :class:`TensorRef`
            (see :func:`encode_tree`), in canonical order.
        tensors: ``(dtype name, shape, contiguous little-endian bytes)`` per
            tensor id, in first-reference order.
        start: absolute file offset where the section will begin; tensor bytes are
            aligned to :data:`ALIGN` in absolute file terms.
        codec: ``"raw"`` or ``"zstd"``.
        compress: for ``"zstd"``, the function that compresses the raw data region.
        legacy: lay out a v1 section (tensor records without digests); only the
            fixture generator and tests write those.

    Returns:
        The plan; its ``length`` is the section length for the container header.
    """
    if codec not in CODECS:
        raise UnsupportedValue(f"compression must be one of {', '.join(CODECS)} (got {codec!r})")
    records, buffers, off = [], [], 0
    for dtype, shape, buf in tensors:
        off = align_up(off)
        records.append([dtype, list(shape), off, buf.nbytes] + ([] if legacy else [_DIGEST_PLACEHOLDER]))
        buffers.append(buf)
        off += buf.nbytes
    raw_len = off
    stored = None
    data_len = raw_len
    if codec != "raw":
        assert compress is not None, "zstd codec needs a compress function"
        stored = compress(_raw_region(records, buffers, raw_len))
        data_len = len(stored)
    packed = _pack_tree(tree)
    index = _pack_index(codec, data_len, raw_len, records, packed)
    data_start_rel = align_up(start + 8 + len(index)) - start
    return SectionPlan(packed, records, buffers, codec, data_len, raw_len, index, data_start_rel, stored)


def _raw_region(records: list[list[Any]], buffers: list[memoryview], raw_len: int) -> bytes:
    out = bytearray(raw_len)
    for rec, buf in zip(records, buffers, strict=True):
        out[rec[2] : rec[2] + rec[3]] = buf
    return bytes(out)


def _pack_tree(value: Any) -> Any:
    """Replace refs and tuples by msgpack extension values (trees are pre-sorted)."""
    if isinstance(value, TensorRef):
        return msgpack.ExtType(_EXT_TENSOR, struct.pack("<I", value.id))
    if isinstance(value, tuple):
        return [_TUPLE_MARK, *(_pack_tree(v) for v in value)]
    if isinstance(value, list):
        return [_pack_tree(v) for v in value]
    if isinstance(value, dict):
        return {k: _pack_tree(v) for k, v in value.items()}
    if isinstance(value, TypedValue):
        return [msgpack.ExtType(EXT_TYPED, value.name.encode()), *(_pack_tree(v) for v in value.fields)]
    return value


def sort_key(k: Any) -> tuple[int, Any]:
    """Canonical map-key order: integers ascending, then strings by code point."""
    return (0, k) if isinstance(k, int) else (1, k)


def check_plain(value: Any, where: str, depth: int = 0, on_leaf: Callable[[Any, str], Any] | None = None) -> Any:
    """Return ``value`` in canonical form, refusing what a section cannot carry.

    Allowed: None, bool, int (-2**63 .. 2**64-1), float, str, bytes, list, tuple,
    dict with str or int keys, and the typed values of ``spec/container.md`` §5.4
    (sets, frozensets, ordered dicts, numpy arrays and scalars; the codec adds torch
    dtypes, devices and sizes). Types are matched exactly: a subclass of one of these
    would load as the base type, so it is refused. ``on_leaf(value, where)`` is asked
    first for every value and may return a replacement (the torch codec turns tensors
    into refs); it returns ``NotImplemented`` to decline.

    Raises:
        UnsupportedValue: naming ``where`` (e.g. ``optim['state'][3]['exp_avg']``) and
            the conversion to make.
    """
    if depth > MAX_DEPTH:
        raise UnsupportedValue(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if on_leaf is not None:
        got = on_leaf(value, where)
        if got is not NotImplemented:
            return got
    t = type(value)
    if t is str:
        _check_utf8(value, where)
        return value
    if value is None or t in (bool, bytes, float):
        return value
    if t is TypedValue:  # already canonical (a tree checked before, e.g. staged by an async save)
        return TypedValue(value.name, tuple(check_plain(v, where, depth + 1, on_leaf) for v in value.fields))
    if t is int:
        if not -(2**63) <= value < 2**64:
            raise UnsupportedValue(f"{where}: integer {value} does not fit in 64 bits")
        return value
    if t is tuple:
        return tuple(check_plain(v, f"{where}[{i}]", depth + 1, on_leaf) for i, v in enumerate(value))
    if t is list:
        return [check_plain(v, f"{where}[{i}]", depth + 1, on_leaf) for i, v in enumerate(value)]
    if t is dict:
        for k in value:
            _check_key(k, where)
        return {k: check_plain(value[k], f"{where}[{k!r}]", depth + 1, on_leaf) for k in sorted(value, key=sort_key)}
    if t is collections.OrderedDict:
        pairs: list[Any] = []
        for k, v in value.items():
            _check_key(k, where)
            pairs += [k, check_plain(v, f"{where}[{k!r}]", depth + 1, on_leaf)]
        return TypedValue("collections.OrderedDict", tuple(pairs))
    if t in (set, frozenset):
        return _plain_set(value, where, depth, on_leaf)
    typed = encode_numpy(value, where) or encode_torch(value, where)
    if typed is None:
        raise UnsupportedValue(refusal(value, where, tensors=on_leaf is not None))
    return typed


def _check_key(k: Any, where: str) -> None:
    """Refuse a map key other than a str or an int that fits in 64 bits (a bool is not an int key)."""
    if type(k) is str:
        _check_utf8(k, where)
    elif type(k) is not int:
        raise UnsupportedValue(f"{where}: map key {k!r} is a {type(k).__name__}; only str and int keys are stored")
    elif not -(2**63) <= k < 2**64:
        raise UnsupportedValue(f"{where}: map key {k} does not fit in 64 bits")


def _plain_set(value: set[Any] | frozenset[Any], where: str, depth: int, on_leaf: Any) -> TypedValue:
    """A set's typed value: its elements in canonical order (by their msgpack bytes), no tensors."""
    items = [check_plain(v, f"{where}<element {v!r:.40}>", depth + 1, on_leaf) for v in value]
    for v in items:
        if any(True for _ in iter_refs(v)):
            raise UnsupportedValue(f"{where}: a {type(value).__name__} holding a tensor cannot be stored; use a list")
    packed = sorted((_packb(v), i) for i, v in enumerate(items))
    return TypedValue(type(value).__name__, tuple(items[i] for _, i in packed))


def _packb(plain: Any) -> bytes:
    out: bytes = msgpack.packb(_pack_tree(plain), use_bin_type=True)
    return out


def canonical_bytes(value: Any, where: str) -> bytes:
    """The canonical msgpack bytes of a tensor-free value, as a tree stores it (a typed value's, a set's).

    Raises:
        UnsupportedValue: a value a tree cannot hold, named by ``where``.
    """
    return _packb(check_plain(value, where))


def _check_utf8(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedValue(f"{where}: string {s[:20]!r} is not valid UTF-8 ({e.reason})") from None


# ---------------------------------------------------------------------------- reading


def decode_index(
    raw: bytes,
    *,
    name: str,
    start: int,
    length: int,
    index_len: int,
    legacy: bool,
    path: str | None,
    deferred: bool = False,
) -> SectionIndex:
    """Parse and validate a section index (the bytes after its ``index_len`` field).

    Args:
        raw: the ``index_len`` index bytes.
        name: the section name for messages (``model``, ``optim``...).
        start, length: absolute placement of the section, from the header.
        index_len: the declared index length (already checked to fit).
        legacy: a v1 section, whose tensor records carry no digest.
        path: file name for messages.
        deferred: check now only the index map, the lengths and the tensor extents
            (each record's offset and size, R-014's order and bounds: what the skeleton
            digest needs); check the rest of the records and the tree on their first use.

    Raises:
        MalformedIndex: msgpack that does not decode, or violates R-010..R-016
            (with ``deferred``, only the map and the extents; the table's and the tree's
            first use raises the rest).
        UnsupportedVersion: an unknown data codec.
        TruncatedFile: the data region does not fit in the section.
    """
    at = start + 8

    def bad(problem: str, **kw: Any) -> FormatError:
        return MalformedIndex(problem, path=path, offset=at, field=f"{name} index", **kw)

    values = _index_values(raw, bad)
    index = {k: _unpack_value(values[k], _Exts(0), bad) for k in ("codec", "data_len", "raw_len")}
    codec = index["codec"]
    if codec not in CODECS:
        raise UnsupportedVersion(
            "unknown data codec",
            path=path,
            offset=at,
            field=f"{name} index",
            expected=" or ".join(CODECS),
            actual=_show(codec, 40),
            hint="written by a newer ckptkit? (R-011)",
        )
    data_start = align_up(start + 8 + index_len)
    data_len, raw_len = _check_data_lengths(index, data_start, start + length, name=name, path=path, bad=bad)
    extents = _record_extents(values["tensors"], raw_len, 4 if legacy else 5) if deferred else None
    body = _Body(extents, values, raw_len, legacy, bad)
    if extents is None:  # not deferred, or records the extents pass leaves to the full check at once
        body.decoded()
    return SectionIndex(name, start, length, index_len, data_start, codec, data_len, raw_len, body)


def _record_extents(
    raw_records: memoryview, raw_len: int, width: int
) -> tuple[array.array[int], array.array[int]] | None:
    """Offset and size of every record, in order and inside the data region (R-014), or None.

    The deferred index's pass: one record at a time (G-70), only the two fields the
    skeleton digest needs. None for anything else than well-formed extents; the full
    check (:func:`_decode_records`) then runs at once and names the problem.
    """
    u = _unpacker(raw_records, _Exts(0))
    offsets, sizes = array.array("Q"), array.array("Q")
    end_prev = 0
    try:
        for _ in range(u.read_array_header()):
            r = u.unpack()
            if type(r) is not list or len(r) != width:
                return None
            offset, nbytes = r[2], r[3]
            if type(offset) is not int or type(nbytes) is not int or nbytes < 0:
                return None
            if offset % ALIGN or offset < end_prev or offset + nbytes > raw_len:
                return None
            offsets.append(offset)
            sizes.append(nbytes)
            end_prev = offset + nbytes
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - msgpack raises many types; the full check names the problem
        return None
    return offsets, sizes


def _unpacker(buf: memoryview, exts: _Exts) -> msgpack.Unpacker:
    """A streaming decoder over ``buf``, with the limits and hooks of :func:`_unpack_value`."""
    u = msgpack.Unpacker(
        raw=False,
        strict_map_key=False,
        use_list=True,
        object_pairs_hook=_map,
        ext_hook=exts.hook,
        max_buffer_size=max(len(buf), 1),  # as unpackb: no string, array or map may claim more than the bytes
    )
    u.feed(buf)
    return u


def _unpack_value(buf: memoryview, exts: _Exts, bad: Callable[..., FormatError]) -> Any:
    """One msgpack value of the index, decoded whole (its bytes were checked by :func:`_index_values`)."""
    try:
        return msgpack.unpackb(
            buf, raw=False, strict_map_key=False, use_list=True, object_pairs_hook=_map, ext_hook=exts.hook
        )
    except Exception as e:  # noqa: BLE001 - e.g. UnicodeDecodeError, which skipping a value does not see
        raise _not_msgpack(e, bad) from None


def _not_msgpack(e: BaseException, bad: Callable[..., FormatError]) -> FormatError:
    """The R-010 error for a decoder failure; running out of memory is no damage of the file and is re-raised."""
    if isinstance(e, MemoryError):
        raise e
    why = f"msgpack {type(e).__name__}" + (f": {e}" if str(e) else "")
    return bad(f"not a valid msgpack index ({why})", hint="R-010")


def _index_values(raw: bytes, bad: Callable[..., FormatError]) -> dict[str, memoryview]:
    """The bytes of each of the five values of the index map (R-010), found without decoding them.

    The index is walked as a stream (``skip`` checks each value's structure and
    limits but builds nothing), so a table of a million records costs no memory
    here. An index that is not such a map is decoded whole by the reader of
    record, :func:`_unpack_index`, to say exactly why.
    """
    whole = memoryview(raw)
    u = _unpacker(whole, _Exts(0))
    out: dict[str, memoryview] = {}
    try:
        well_formed = u.read_map_header() == len(_INDEX_KEYS)
        while well_formed and len(out) < len(_INDEX_KEYS):
            key = u.unpack()
            at = u.tell()
            u.skip()
            well_formed = type(key) is str and key in _INDEX_KEYS and key not in out
            if well_formed:
                out[key] = whole[at : u.tell()]
        well_formed = well_formed and u.tell() == len(raw)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - msgpack raises many types; the whole decode below names the problem
        well_formed = False
    if not well_formed:
        _unpack_index(raw, bad)  # raises: the same words for every way an index map can be wrong
        raise bad("not a valid msgpack index (its map does not decode as a stream)", hint="R-010")
    return out


def _unpack_index(raw: bytes, bad: Callable[..., FormatError]) -> dict[str, Any]:
    """The index bytes decoded whole, as a map with exactly the keys :data:`_INDEX_KEYS` (R-010).

    Used to report an index that :func:`_index_values` cannot walk: the first
    problem of the whole index is found the way a full decode finds it.
    """
    try:
        index = msgpack.unpackb(
            raw, raw=False, strict_map_key=False, use_list=True, object_pairs_hook=_map, ext_hook=_Exts(0).hook
        )
    except Exception as e:  # noqa: BLE001 - msgpack raises many types (ValueError, StackError, ExtraData...)
        raise _not_msgpack(e, bad) from None
    if isinstance(index, _BadMap):
        raise bad(f"the index {index.problem}", hint="R-010")
    if not isinstance(index, dict) or sorted(index, key=str) != sorted(_INDEX_KEYS):
        got = sorted(map(str, index)) if isinstance(index, dict) else type(index).__name__
        raise bad("index must be a map with exactly the keys " + ", ".join(_INDEX_KEYS), actual=got, hint="R-010")
    return index


def _check_data_lengths(
    index: dict[str, Any],
    data_start: int,
    section_end: int,
    *,
    name: str,
    path: str | None,
    bad: Callable[..., FormatError],
) -> tuple[int, int]:
    """``(data_len, raw_len)`` once they are checked against the section and the codec (R-008, R-010, R-012)."""
    data_len, raw_len = index["data_len"], index["raw_len"]
    for key, v in (("data_len", data_len), ("raw_len", raw_len)):
        if not _is_uint(v):
            raise bad(f"{key} must be a non-negative integer", actual=_show(v, 40), hint="R-010")
    if data_start + data_len != section_end:
        raise TruncatedFile(
            f"data region of {data_len} bytes at offset {data_start} does not end at the section end",
            path=path,
            offset=data_start,
            field=f"{name} data",
            expected=section_end,
            actual=data_start + data_len,
            hint="R-012",
        )
    if index["codec"] == "zstd" and raw_len > data_len * MAX_ZSTD_RATIO + (1 << 20):
        raise bad(
            "raw_len exceeds what any zstd frame of data_len bytes can decode to",
            expected=f"<= {data_len * MAX_ZSTD_RATIO + (1 << 20)}",
            actual=raw_len,
            hint="R-008",
        )
    if index["codec"] == "raw" and raw_len != data_len:
        raise bad("raw_len must equal data_len for codec 'raw'", expected=data_len, actual=raw_len, hint="R-012")
    return data_len, raw_len


def _decode_section_tree(raw_tree: Any, records: TensorTable, bad: Callable[..., FormatError]) -> Any:
    """The section's tree, every tensor record referenced by it (R-015, R-016)."""
    if raw_tree is None:
        raise bad("the tree of a present section is nil (a section without state is absent: length 0)", hint="R-016")
    referenced = bytearray(len(records))  # one byte a tensor, not a set of a million ints
    tree = _unpack_tree(raw_tree, len(records), referenced, bad, 0)
    orphan = referenced.find(0)
    if orphan >= 0:
        raise bad(f"tensor {orphan} is never referenced by the tree", hint="R-015")
    return tree


_SHOW = reprlib.Repr()
_SHOW.maxlevel = 4  # a hostile value may nest 1000 deep: never recurse that far to describe it
_SHOW.maxlist = _SHOW.maxdict = _SHOW.maxtuple = 8
_SHOW.maxstring = _SHOW.maxother = 80


def _show(v: Any, n: int) -> str:
    """A bounded ``repr`` of a value read from a file, for messages."""
    return _SHOW.repr(v)[:n]


class _BadMap:
    """A msgpack map that cannot be a dict of the format: a key that is not str or int, or one given twice.

    The decoder builds it in place of the dict, and the reader of the index or tree
    that meets it reports ``problem`` under its own rule (R-010 for the index map,
    R-016 for a tree map). Keys repeated would make the last one win silently, so two
    files with different bytes would load as the same state.
    """

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem

    def __repr__(self) -> str:
        return "<map: " + self.problem + ">"


def _map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any] | _BadMap:
    """msgpack's ``object_pairs_hook``: a dict, or a :class:`_BadMap` saying why not."""
    try:  # the common case at C speed: string or integer keys, none twice
        out: dict[Any, Any] = dict(pairs)
    except TypeError:  # an unhashable key: the loop below names it
        out = {}
    if len(out) == len(pairs) and all(type(k) is str or type(k) is int for k in out):  # a bool is no key
        return out
    out = {}
    for k, v in pairs:
        if isinstance(k, bool) or not isinstance(k, (int, str)):
            return _BadMap(f"map key {_show(k, 40)} is not a string or integer")
        if k in out:
            return _BadMap(f"map key {_show(k, 40)} appears twice")
        out[k] = v
    return out


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _decode_records(
    raw_records: memoryview, raw_len: int, *, legacy: bool, bad: Callable[..., FormatError]
) -> TensorTable:
    """The tensor table (R-013, R-014), decoded one record at a time into flat arrays.

    A record is a few Python objects only while it is checked; the table keeps
    its fields, not the objects.
    """
    u = _unpacker(raw_records, _Exts(0))
    try:
        n = u.read_array_header()
    except ValueError:
        got = _unpack_value(raw_records, _Exts(0), bad)
        raise bad("tensors must be an array", actual=type(got).__name__, hint="R-013") from None
    table = TensorTable(legacy)
    width, end_prev = 4 if legacy else 5, 0
    for i in range(n):
        try:
            r = u.unpack()
        except Exception as e:  # noqa: BLE001 - a string that is not UTF-8 (skipping does not decode strings)
            raise _not_msgpack(e, bad) from None
        digest = _plain_record(r, width, end_prev, raw_len)
        if digest is None:  # not the common case: the full check, which names what is wrong
            digest = _check_record(f"tensor {i}", r, width, end_prev, raw_len, bad)
        table.append(r[0], r[1], r[2], r[3], digest)
        end_prev = r[2] + r[3]
    return table


def _plain_record(r: Any, width: int, end_prev: int, raw_len: int) -> int | None:
    """The digest of a well-formed v2 record of a non-empty tensor, else None (then :func:`_check_record` decides).

    The fast path of the index parse: it accepts a subset of what :func:`_check_record`
    accepts, in one pass of cheap tests, so a table of 500 records costs a fraction of a
    millisecond (the lazy reader parses every index to check the skeleton, spec/performance.md).
    """
    if type(r) is not list or len(r) != width or width != 5:
        return None
    dtype, shape, offset, nbytes, d = r
    item = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if item is None or type(shape) is not list or len(shape) > MAX_NDIM or type(offset) is not int:
        return None
    for x in shape:  # a plain loop: the cheapest test in CPython (all() over a generator costs 2x)
        if type(x) is not int or x <= 0:  # a bool or float is no dimension; an empty tensor takes the full check
            return None
    if type(d) is not bytes or len(d) != 8:
        return None
    numel = math.prod(shape)
    if numel >= 2**63 or nbytes != numel * item or type(nbytes) is not int:
        return None
    if offset % ALIGN or offset < end_prev or offset + nbytes > raw_len:
        return None
    return int.from_bytes(d, "little")


def _check_record(
    where: str, r: Any, width: int, end_prev: int, raw_len: int, bad: Callable[..., FormatError]
) -> int | None:
    """Check one decoded tensor record (R-013, R-014); return its digest (None in a v1 record)."""
    if not isinstance(r, list) or len(r) != width:
        raise bad(f"{where}: record must be an array of {width} fields", actual=_show(r, 80), hint="R-013")
    dtype, shape, offset, nbytes = r[:4]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise bad(
            f"{where}: unknown dtype", expected="a name from the dtype table", actual=_show(dtype, 40), hint="R-013"
        )
    # type() is int: msgpack decodes integers as int, and a bool is not a dimension
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(
            f"{where}: shape must be at most {MAX_NDIM} non-negative integers",
            actual=_show(shape, 80),
            hint="R-013",
        )
    if max(shape, default=0) >= 2**63 or math.prod(d or 1 for d in shape) >= 2**63:
        raise bad(f"{where}: shape does not fit in int64 element counts", actual=_show(shape, 80), hint="R-013")
    if not _is_uint(offset) or not _is_uint(nbytes):
        raise bad(f"{where}: offset and nbytes must be non-negative integers", actual=_show(r[2:4], 80), hint="R-013")
    _check_extent(where, offset, nbytes, math.prod(shape) * DTYPE_SIZES[dtype], end_prev, raw_len, bad)
    if width == 4:
        return None
    d = r[4]
    if not isinstance(d, bytes) or len(d) != 8:
        raise bad(f"{where}: digest must be 8 bytes", actual=_show(d, 40), hint="R-013")
    digest: int = _U64.unpack(d)[0]
    return digest


def _check_extent(
    where: str, offset: int, nbytes: int, want: int, end_prev: int, raw_len: int, bad: Callable[..., FormatError]
) -> None:
    """R-014: a record's bytes are ``want`` long (shape x itemsize), aligned, after the previous
    tensor's and inside the data region of ``raw_len`` bytes."""
    if nbytes != want:
        raise bad(f"{where}: nbytes disagrees with shape x itemsize", expected=want, actual=nbytes, hint="R-014")
    if offset % ALIGN:
        raise bad(f"{where}: offset {offset} is not a multiple of {ALIGN}", hint="R-014")
    if offset < end_prev:
        raise bad(
            f"{where}: overlaps the previous tensor (tensors must be in offset order, disjoint)",
            expected=f">= {end_prev}",
            actual=offset,
            hint="R-014",
        )
    if offset + nbytes > raw_len:
        raise bad(
            f"{where}: extent [{offset}, {offset + nbytes}) runs past the data region",
            expected=f"end <= {raw_len}",
            actual=offset + nbytes,
            hint="R-014",
        )


class _Ext:
    """An extension value that is not a tensor reference: the tuple marker, or one the format lacks."""

    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code

    def __repr__(self) -> str:
        return f"ExtType({self.code})"


_TUPLE = _Ext(_EXT_TUPLE)


class _Exts:
    """msgpack's ``ext_hook`` for one index value: one :class:`TensorRef` object per tensor id.

    A tree may refer to one tensor a million times (spec: G-05); each reference then
    costs a pointer, not an object, and the tree walk below meets finished leaves.
    The cache is a list over the table's ``n`` ids (8 bytes a tensor); an id past
    the table gets a reference of its own, which the tree check refuses (R-015).
    """

    __slots__ = ("_refs",)

    def __init__(self, n: int) -> None:
        self._refs: list[TensorRef | None] = [None] * n

    def hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR and len(data) == 4:
            tid = _U32.unpack(data)[0]
            if tid >= len(self._refs):
                return TensorRef(tid)
            ref = self._refs[tid]
            if ref is None:
                ref = self._refs[tid] = TensorRef(tid)
            return ref
        if code == _EXT_TUPLE and not data:
            return _TUPLE
        if code == EXT_TYPED:
            return _TypeMark(data)
        return _Ext(code)


class _TypeMark(_Ext):
    """The marker of a typed value (§5.4): its raw name, decoded where it is used."""

    __slots__ = ("name",)

    def __init__(self, name: bytes) -> None:
        super().__init__(EXT_TYPED)
        self.name = name


_LEAVES = (type(None), bool, int, float, str, bytes)


def _unpack_tree(v: Any, n_tensors: int, referenced: bytearray, bad: Callable[..., FormatError], depth: int) -> Any:
    """Check a decoded tree (R-015, R-016) and turn tuple-marked arrays into tuples.

    Leaves are checked in the loop over their container rather than by a call
    each, so a tree of a million references costs a million byte stores.
    """
    if depth > MAX_DEPTH:
        raise bad(f"tree nested deeper than {MAX_DEPTH} levels", hint="R-016")
    if type(v) in _LEAVES:
        return v
    if isinstance(v, TensorRef):
        return _unpack_tree([v], n_tensors, referenced, bad, depth - 1)[0]  # the root is a tensor
    if isinstance(v, _BadMap):
        raise bad(v.problem, hint="R-016")
    if isinstance(v, (list, dict)):
        is_tuple = isinstance(v, list) and bool(v) and v[0] is _TUPLE
        typed = isinstance(v, list) and bool(v) and type(v[0]) is _TypeMark
        items = v[1:] if is_tuple or typed else v
        for k, x in items.items() if isinstance(items, dict) else enumerate(items):
            if type(x) is TensorRef:
                if x.id >= n_tensors:
                    raise bad(f"tree references tensor {x.id}, the table has {n_tensors}", hint="R-015")
                referenced[x.id] = 1
            elif type(x) not in _LEAVES:
                items[k] = _unpack_tree(x, n_tensors, referenced, bad, depth + 1)
        if depth == MAX_DEPTH and items:
            raise bad(f"tree nested deeper than {MAX_DEPTH} levels", hint="R-016")
        if typed:
            assert isinstance(items, list)
            return _typed(v[0].name, items, bad)
        return tuple(items) if is_tuple else items
    if isinstance(v, _Ext):
        raise bad(f"unexpected extension type {v.code} in the tree", hint="R-016")
    raise bad(f"unexpected value of type {type(v).__name__} in the tree (e.g. a msgpack timestamp)", hint="R-016")


def _typed(raw_name: bytes, fields: list[Any], bad: Callable[..., FormatError]) -> Any:
    """The value of a typed value whose fields are decoded (R-018)."""
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(f"typed value name {_show(raw_name, 40)} is not UTF-8", hint="R-018") from None
    if name in CONTAINER_TYPES:
        return _typed_container(name, fields, bad)
    if any(type(x) is TensorRef or any(True for _ in iter_refs(x)) for x in fields):
        raise bad(f"{name}: a typed value's fields hold no tensor references", hint="R-018")
    try:
        return decode_leaf(name, fields)
    except FormatError as e:  # raised without a place: give it the index's
        where = bad(e.problem)
        raise type(e)(e.problem, path=where.path, offset=where.offset, field=where.field, hint=e.hint) from None


def _typed_container(name: str, fields: list[Any], bad: Callable[..., FormatError]) -> Any:
    """A set, frozenset or ordered dict from its decoded fields: no element or key twice (R-018)."""
    if name == "collections.OrderedDict":
        if len(fields) % 2:
            raise bad("collections.OrderedDict: fields must be key/value pairs (an even count)", hint="R-018")
        made = _map(list(zip(fields[::2], fields[1::2], strict=True)))
        if isinstance(made, _BadMap):
            raise bad(f"collections.OrderedDict: {made.problem}", hint="R-018")
        return collections.OrderedDict(made)
    if any(isinstance(x, TensorRef) or any(True for _ in iter_refs(x)) for x in fields):
        raise bad(f"{name}: a set holds no tensor references", hint="R-018")
    try:
        out = frozenset(fields) if name == "frozenset" else set(fields)
        loaded = set(map(loaded_key, fields))
    except TypeError:
        raise bad(f"{name}: an element is not hashable (a list, map or array)", hint="R-018") from None
    if len(out) != len(fields):
        raise bad(f"{name}: an element appears twice", hint="R-018")
    if len(loaded) != len(fields):
        raise bad(
            f"{name}: two elements are one value once loaded (a torch.Size equals the tuple of its dimensions)",
            hint="R-032",
        )
    return out


def iter_refs(tree: Any) -> Iterable[TensorRef]:
    """Every :class:`TensorRef` in ``tree``, depth first."""
    if isinstance(tree, TensorRef):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from iter_refs(v)
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from iter_refs(v)
    elif isinstance(tree, TypedValue):
        yield from iter_refs(tree.fields)
