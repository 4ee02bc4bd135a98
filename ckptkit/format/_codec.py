"""Torch state trees <-> section trees: the dtype table and zero-copy tensor bytes.

The only module of the format core that imports torch. A state tree (a module's
``state_dict()``, an optimizer's nested ``state_dict()``, plain monitor values) is
turned into a plain tree whose tensors are :class:`~ckptkit.format._section.TensorRef`
entries plus one contiguous byte buffer per distinct tensor; decoding does the
reverse. Implements ``spec/container.md`` ("Tensor codec").

Invariants:
    * No pickle, ever: a tree holds None, bool, int, float, str, bytes, lists,
      tuples, dicts (str/int keys), tensors and the typed values of
      :mod:`ckptkit.format._values`; anything else is refused by name. The torch typed
      values (dtype, device, Size) become torch objects again here (:func:`torch_value`).
    * Two names for one tensor (same object, or the same storage, offset, shape and
      strides) are stored once and load as one tensor object.
    * Tensor bytes are handed to the writer as views: no copy unless the tensor is
      not contiguous, not on the CPU, or needs a dtype-preserving detach.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

import torch

from ..errors import InsufficientMemory, StateMismatch, UnsupportedValue, UnsupportedVersion
from ._container import Source
from ._read import read_tensors
from ._section import (
    CODECS,
    DTYPE_SIZES,
    MAX_NDIM,
    SectionIndex,
    SectionPlan,
    TensorRecord,
    TensorRef,
    check_plain,
    plan_section,
)
from ._values import TypedValue

__all__ = [
    "check_tensor",
    "decode_tree",
    "dtype_name",
    "encode_tree",
    "flat_bytes",
    "load_section",
    "load_sections",
    "mapped_tensor",
    "match_destinations",
    "plan_trees",
    "storage_key",
    "tensor_bytes",
    "torch_dtype",
    "torch_value",
]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPE_SIZES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _TORCH_DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - no such host in CI
    raise ImportError("ckptkit stores tensors little-endian and runs on little-endian hosts only")


def dtype_name(dtype: torch.dtype, where: str = "tensor") -> str:
    """The on-disk name of a torch dtype.

    Raises:
        UnsupportedValue: the dtype has no entry in the dtype table.
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise UnsupportedValue(
            f"{where}: dtype {dtype} is not in the dtype table ({', '.join(sorted(_TORCH_DTYPES))})"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for an on-disk dtype name (names come from a validated index)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise UnsupportedValue(f"dtype {name} is not available in torch {torch.__version__}") from None


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The memory of a contiguous CPU tensor as a 1-d ``uint8`` tensor (shared, not copied).

    The one place tensors become bytes (save, async save, ``load(into=...)``).
    ``is_contiguous()`` ignores the stride of a size-1 dimension, so a one-element
    view such as ``torch.ones(2)[::2]`` is "contiguous" with stride 2, and torch
    refuses to view it as bytes; its one element is dense, so it is re-viewed with a
    unit stride (same storage, same offset).
    """
    flat = t.detach().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def tensor_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A contiguous CPU tensor with the same values, and a byte view of its memory.

    The tensor is returned so the caller keeps the memory alive while writing.
    """
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()  # each a no-op when already so
    if t.numel() == 0:
        return t, memoryview(b"")
    return t, flat_bytes(t).numpy().data


def storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Two tensors with equal keys are one tensor on disk (stored once, loaded as one object)."""
    if not t.numel():
        return ("empty", id(t))
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def check_tensor(value: torch.Tensor, at: str) -> str:
    """Refuse a tensor the container cannot carry; return its on-disk dtype name.

    Raises:
        UnsupportedValue: a sparse or quantized tensor, too many dimensions, or a
            dtype not in the table.
    """
    if value.layout != torch.strided:
        raise UnsupportedValue(f"{at}: {value.layout} tensors cannot be stored; convert with .to_dense()")
    if value.is_quantized:
        raise UnsupportedValue(f"{at}: quantized tensors cannot be stored; store int_repr() and the scales")
    if value.dim() > MAX_NDIM:
        raise UnsupportedValue(f"{at}: a tensor of {value.dim()} dimensions cannot be stored (at most {MAX_NDIM})")
    return dtype_name(value.dtype, at)


def encode_tree(tree: Any, where: str) -> tuple[Any, list[tuple[str, tuple[int, ...], memoryview]], list[torch.Tensor]]:
    """Canonicalise ``tree`` and pull out its tensors.

    Args:
        tree: the state to store.
        where: how to name the tree's root in error messages (``"model"``).

    Returns:
        ``(plain_tree, tensors, keep_alive)``: the tree with :class:`TensorRef` in
        place of tensors, ``(dtype, shape, bytes)`` per distinct tensor in
        first-reference order, and the tensors backing those bytes.

    Raises:
        UnsupportedValue: a value or dtype the container cannot carry, named by path.
    """
    ids: dict[Any, int] = {}
    tensors: list[tuple[str, tuple[int, ...], memoryview]] = []
    keep: list[torch.Tensor] = []

    def leaf(value: Any, at: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return NotImplemented
        check_tensor(value, at)
        key = storage_key(value)
        tid = ids.get(key)
        if tid is None:
            name = dtype_name(value.dtype, at)
            held, buf = tensor_bytes(value)
            tid = ids[key] = len(tensors)
            tensors.append((name, tuple(value.shape), buf))
            keep.append(held)
        return TensorRef(tid)

    plain = check_plain(tree, where, on_leaf=leaf)
    return plain, tensors, keep


def decode_tree(tree: Any, tensors: list[torch.Tensor] | Mapping[int, torch.Tensor]) -> Any:
    """Replace every :class:`TensorRef` in ``tree`` by its tensor (shared refs share).

    Leaves are replaced in the loop over their container, not by a call each: a
    tree of a million references stays a million dictionary lookups.
    """
    if isinstance(tree, TensorRef):
        return tensors[tree.id]

    def one(v: Any) -> Any:
        return tensors[v.id] if type(v) is TensorRef else v if type(v) in _LEAVES else decode_tree(v, tensors)

    if isinstance(tree, tuple):
        return tuple(map(one, tree))
    if isinstance(tree, list):
        return list(map(one, tree))
    if isinstance(tree, dict):
        out = {k: one(v) for k, v in tree.items()}
        return out if type(tree) is dict else collections.OrderedDict(out)
    if isinstance(tree, (set, frozenset)):
        return type(tree)(map(one, tree))
    if isinstance(tree, TypedValue):
        return torch_value(tree)
    return tree


def torch_value(value: TypedValue) -> Any:
    """The torch object of a ``torch.*`` typed value read from a file (spec/container.md §5.4).

    The fields were checked when the index was read (R-031, R-033, R-034), as ``verify`` checks them.

    Raises:
        UnsupportedVersion: a dtype name of the table this (older) torch does not have (R-033).
    """
    (arg,) = value.fields[:1] or (None,)
    if value.name == "torch.Size":
        return torch.Size(value.fields)
    if value.name == "torch.dtype":
        dtype = getattr(torch, arg, None)
        if not isinstance(dtype, torch.dtype):
            raise UnsupportedVersion(
                f"torch.dtype {arg!r} is not a dtype of torch {torch.__version__}",
                field="typed value",
                hint="written with a newer torch? upgrade torch to read it (R-033)",
            )
        return dtype
    with warnings.catch_warnings():  # torch warns that "mkldnn" is deprecated: a file read, not a choice made here
        warnings.simplefilter("ignore", UserWarning)
        return torch.device(arg)


_LEAVES = (type(None), bool, int, float, str, bytes)


def empty_like_record(dtype: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, memoryview]:
    """A fresh CPU tensor for a record, and a writable byte view of it."""
    t = torch.empty(shape, dtype=torch_dtype(dtype))
    return t, _byte_view(t)


def _compressor(level: int) -> Any:
    import zstandard

    return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True).compress


def plan_trees(
    trees: Mapping[str, Any], *, start: int, compression: str | Mapping[str, str] = "raw", level: int = 3
) -> tuple[list[SectionPlan | None], list[Any]]:
    """Encode and lay out sections that follow each other from offset ``start``.

    Args:
        trees: section name -> state tree (None = absent), in on-disk order.
        start: absolute offset of the first section (the header size).
        compression: one codec for every section, or ``{section: codec}``.
        level: zstd level.

    Returns:
        ``(plans, keep_alive)``; keep ``keep_alive`` referenced until written.

    Raises:
        UnsupportedValue: a value the container cannot carry, named by path.
        ValueError: an unknown section name or codec in ``compression``.
    """
    codecs = dict.fromkeys(trees, compression) if isinstance(compression, str) else dict(compression)
    for name, codec in codecs.items():
        if name not in trees:
            raise ValueError(f"compression names an unknown section {name!r} (sections: {', '.join(trees)})")
        if codec not in CODECS:
            raise ValueError(f"compression for {name} must be one of {', '.join(CODECS)} (got {codec!r})")
    plans: list[SectionPlan | None] = []
    keep: list[Any] = []
    for name, value in trees.items():
        if value is None:
            plans.append(None)
            continue
        tree, tensors, held = encode_tree(value, name)
        codec = codecs.get(name, "raw")
        plan = plan_section(
            tree, tensors, start=start, codec=codec, compress=_compressor(level) if codec != "raw" else None
        )
        plans.append(plan)
        keep.append(held)
        start += plan.length
    return plans, keep


def read_section_tensors(src: Source, sec: SectionIndex, max_memory: int | None = None) -> list[torch.Tensor]:
    """Every tensor of a section in new memory, in table order, each digest checked.

    Raises:
        InsufficientMemory: the tensors would not fit (before anything is allocated).
        ChecksumMismatch, BadTensorValue, MalformedIndex: as :func:`~ckptkit.format._read.read_tensors`.
    """
    check_memory(src.path, ((sec, i) for i in range(len(sec.tensors))), max_memory)
    made = [empty_like_record(sec.tensors.dtype(i), sec.tensors.shape(i)) for i in range(len(sec.tensors))]
    read_tensors(src, [(sec, i, view) for i, (_, view) in enumerate(made)])
    return [t for t, _ in made]


def load_section(src: Source, sec: SectionIndex | None, map_location: Any = "cpu") -> Any:
    """Read one section's tree with its tensors, checking each digest as it is read.

    Raises:
        ChecksumMismatch: a tensor's bytes do not match its digest (R-007).
        MalformedIndex: a compressed region that does not decode (R-008).
    """
    return load_sections(src, {"section": sec}, map_location=map_location)["section"]


def load_sections(
    src: Source,
    sections: Mapping[str, SectionIndex | None],
    *,
    map_location: Any = "cpu",
    into: Mapping[str, Any] | None = None,
    strict: bool = True,
    max_memory: int | None = None,
) -> dict[str, Any]:
    """Read sections' trees, each tensor straight into its destination, verified in the same pass.

    Args:
        src: the open file; its skeleton and flags already checked.
        sections: section name -> parsed section (None = absent).
        map_location: device for tensors that have no destination.
        into: section name -> destination tree (see :func:`match_destinations`);
            a matching stored tensor is read into the destination tensor's own
            memory, and the returned tree holds that destination tensor.
        strict: refuse stored tensors that ``into`` has no destination for.
        max_memory: the most bytes of new tensor memory to allocate (see
            :func:`check_memory`; None: what the process has available).

    Returns:
        section name -> tree (None for an absent section).

    Raises:
        StateMismatch: ``into`` does not fit the file (every problem listed);
            raised before any byte is read.
        InsufficientMemory: the new tensors would not fit (before anything is allocated).
        ChecksumMismatch, MalformedIndex, TruncatedFile: as :func:`~ckptkit.format._read.read_tensors`.
            Destinations filled before the failure keep what was read: treat
            them as garbage and restore again from a good checkpoint.
    """
    dests = {} if into is None else _match_into(src, sections, into, strict)
    homeless = any(  # a raw tensor without a destination: it will be a view of the file's mapping
        sec.codec == "raw" and len(dests.get(name, ())) < len(sec.tensors)
        for name, sec in sections.items()
        if sec is not None
    )
    mapping = src.map_private() if homeless else None
    fresh = (  # a generator: a file of a million tensors gets no million-entry list here
        (sec, i)
        for name, sec in sections.items()
        if sec is not None and not (mapping and sec.codec == "raw")  # mapped, or read into the mapping's place
        for i in range(len(sec.tensors))
        if not _writable_in_place(dests.get(name, {}).get(i))
    )
    check_memory(src.path, fresh, max_memory)
    reads = _ReadPlan.of(sections, dests, mapping, move=str(map_location) != "cpu")
    read_tensors(src, reads.jobs, mapping=mapping)
    reads.finish(map_location)
    return {name: None if sec is None else decode_tree(sec.tree, reads.tensors[name]) for name, sec in sections.items()}


def _match_into(
    src: Source, sections: Mapping[str, SectionIndex | None], into: Mapping[str, Any], strict: bool
) -> dict[str, dict[int, torch.Tensor]]:
    """Section name -> {tensor id: destination} for ``load_sections(into=...)``.

    Raises:
        ValueError: ``into`` names a section the file does not have.
        StateMismatch: some destinations do not fit (the first ten problems in the message, all in the error).
    """
    dests: dict[str, dict[int, torch.Tensor]] = {}
    problems: list[str] = []
    for name, tree in into.items():
        if name not in sections:
            raise ValueError(f"into names an unknown section {name!r} (sections: {', '.join(sections)})")
        dests[name] = match_destinations(sections[name], tree, name, problems, strict=strict)
    if problems:
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise StateMismatch(
            f"{src.path or 'checkpoint'}: does not fit the destination tensors: {'; '.join(problems[:10])}{more}; "
            "the checkpoint was written for another model or optimizer layout",
            problems,
        )
    return dests


@dataclasses.dataclass
class _ReadPlan:
    """Where each stored tensor of a load goes, decided before any byte is read.

    A tensor is read straight into its destination when that is writable in place; a raw
    tensor without a destination becomes a view of the private mapping (checked where it
    lies); anything else is read into new memory, then copied to its destination if it has one.
    """

    jobs: list[tuple[SectionIndex, int, memoryview | None]]  # what read_tensors reads, and into which bytes
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # (read into, copy to) for indirect destinations
    tensors: dict[str, list[torch.Tensor]]  # section name -> its tensors in table order, as returned
    moved: list[tuple[str, int]]  # tensors without a destination: they go to map_location
    move: bool  # map_location is not the CPU (else ``moved`` stays empty)

    @classmethod
    def of(
        cls,
        sections: Mapping[str, SectionIndex | None],
        dests: dict[str, dict[int, torch.Tensor]],
        mapping: Any,
        *,
        move: bool,
    ) -> _ReadPlan:
        plan = cls(jobs=[], staged=[], tensors={}, moved=[], move=move)
        for name, sec in sections.items():
            if sec is not None:
                plan.tensors[name] = [
                    plan._place(name, sec, i, dests.get(name, {}).get(i), mapping) for i in range(len(sec.tensors))
                ]
        return plan

    def _place(self, name: str, sec: SectionIndex, i: int, d: torch.Tensor | None, mapping: Any) -> torch.Tensor:
        """Plan the read of tensor ``i`` of ``sec``; return the tensor the loaded tree will hold."""
        table = sec.tensors
        view: memoryview | None
        if _writable_in_place(d):
            view = _byte_view(d)
            out = d
        elif d is None and mapping is not None and sec.codec == "raw":
            view = None  # checked where it lies: the tensor is a view of the private mapping
            out = mapped_tensor(mapping, sec.data_start + table.offsets[i], table.dtype(i), table.shape(i))
            if self.move:
                self.moved.append((name, i))
        else:
            t, view = empty_like_record(table.dtype(i), table.shape(i))
            if d is not None:
                self.staged.append((t, d))
                out = d
            else:
                out = t
                if self.move:
                    self.moved.append((name, i))
        self.jobs.append((sec, i, view))
        return out

    def finish(self, map_location: Any) -> None:
        """After the read: copy staged tensors to their destinations, move the rest to ``map_location``."""
        for t, d in self.staged:
            with torch.no_grad():
                d.copy_(t)
        if self.move:
            for name, i in self.moved:
                self.tensors[name][i] = self.tensors[name][i].to(map_location)


def check_memory(path: str | None, fresh: Iterable[tuple[SectionIndex, int]], limit: int | None) -> None:
    """Refuse, before allocating anything, a load whose new tensors exceed the memory limit.

    Args:
        path: the file, for the message.
        fresh: ``(section, tensor id)`` of every tensor that will get new memory.
        limit: bytes allowed; None: :func:`memory_available` (no check where that is unknown).

    Raises:
        InsufficientMemory: naming the largest such tensor by its key path, the total and the limit.
    """
    total, largest = 0, None
    for sec, i in fresh:  # one pass: ``fresh`` may be a generator
        n = sec.tensors.sizes[i]
        total += n
        if largest is None or n > largest[0].tensors.sizes[largest[1]]:
            largest = (sec, i)
    source = "max_memory"
    if limit is None:
        found = memory_available()
        if found is None:
            return
        limit, source = found
    if total <= limit or largest is None:
        return
    sec, i = largest
    rec = sec.tensors[i]
    raise InsufficientMemory(
        f"{path or 'checkpoint'}: loading needs {total} bytes ({_gib(total)}) of new tensor memory but only {limit} "
        f"({_gib(limit)}) are available ({source}); the largest tensor is {_ref_path(sec, i)} "
        f"({rec.dtype}{list(rec.shape)}, {rec.nbytes} bytes); nothing was allocated. Free memory, load into "
        "existing tensors (into=...), or pass max_memory=N bytes "
        "if the file is trusted"
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def memory_available() -> tuple[int, str] | None:
    """Bytes this process can still allocate, and what bounds it; None where it cannot be known (not Linux).

    The least of: ``MemAvailable`` (/proc/meminfo), the cgroup v2 limit minus its
    usage other than page cache (memory.max - memory.current + memory.stat ``file``),
    and the address-space limit ``RLIMIT_AS`` minus this process's ``VmSize``.
    """
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            found += [(int(line.split()[1]) * 1024, "MemAvailable") for line in f if line.startswith("MemAvailable:")]
    except OSError:
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            cap, used = f.read().strip(), int(g.read())
        if cap != "max":
            with open("/sys/fs/cgroup/memory.stat") as f:  # page cache counts in usage but is reclaimed on demand
                cache = next((int(line.split()[1]) for line in f if line.startswith("file ")), 0)
            found.append((int(cap) - (used - cache), "the cgroup memory limit"))
    except (OSError, ValueError):
        pass
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        with open("/proc/self/status") as f:
            vm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
        found.append((soft - vm, "the address-space limit RLIMIT_AS"))
    if not found:
        return None
    n, source = min(found)
    return max(n, 0), source


def _ref_path(sec: SectionIndex, tid: int) -> str:
    """The first key path at which the tree refers to tensor ``tid`` (``model['net']['w']``)."""
    stack: list[tuple[Any, str]] = [(sec.tree, sec.name)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, TensorRef):
            if node.id == tid:
                return at
        elif isinstance(node, dict):
            stack.extend((v, f"{at}{_key(k)}") for k, v in reversed(list(node.items())))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{at}[{k}]") for k, v in reversed(list(enumerate(node))))
    return f"{sec.name} tensor {tid}"


def mapped_tensor(mapping: Any, at: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over ``mapping[at:]`` (no copy); an empty one owns its (no) memory."""
    n = math.prod(shape) * DTYPE_SIZES[dtype]
    if n == 0:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    return torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=at).view(torch_dtype(dtype)).reshape(shape)


def _writable_in_place(t: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    return (
        t is not None
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
    )


_NO_BYTES = memoryview(bytearray(0))  # the (writable, empty) byte view of every empty tensor


def _byte_view(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return _NO_BYTES
    return flat_bytes(t).numpy().data


def _key(k: Any) -> str:
    return f"[{k!r}]"


def match_destinations(
    sec: SectionIndex | None, dest: Any, where: str, problems: list[str], *, strict: bool = True
) -> dict[int, torch.Tensor]:
    """Pair each tensor of a destination tree with the stored tensor at the same key path.

    The destination is any tree of dicts, lists and tuples whose tensor leaves
    are where the values should go (``module.state_dict()`` shares its tensors
    with the module's parameters and buffers; an optimizer's ``state_dict()``
    with its state). Non-tensor leaves of the destination are ignored.

    Args:
        sec: the stored section (None if absent in the file).
        dest: the destination tree.
        where: how messages name the root (``"model"``).
        problems: every mismatch is appended here, one line each: a key the file
            lacks, a shape or dtype that differs, a different kind of value, and,
            with ``strict``, a stored tensor the destination has no place for.

    Returns:
        stored tensor id -> destination tensor (the first, if several share an id).
    """
    out: dict[int, torch.Tensor] = {}
    if sec is None:
        problems.append(f"{where}: section is absent from the checkpoint")
        return out
    recs = sec.tensors

    def walk(stored: Any, d: Any, at: str) -> None:
        if isinstance(d, torch.Tensor):
            if not isinstance(stored, TensorRef):
                problems.append(f"{at}: a tensor in the destination, {_kind(stored)} in the checkpoint")
                return
            problem = _destination_problem(recs[stored.id], d, at)
            if problem is not None:
                problems.append(problem)
            else:
                out.setdefault(stored.id, d)
        elif isinstance(d, Mapping):
            if not isinstance(stored, dict):
                problems.append(f"{at}: a dict in the destination, {_kind(stored)} in the checkpoint")
                return
            for k, v in d.items():
                if k not in stored:
                    if _has_tensor(v):
                        problems.append(f"{at}{_key(k)}: missing from the checkpoint")
                else:
                    walk(stored[k], v, f"{at}{_key(k)}")
            if strict:
                for k, v in stored.items():
                    if k not in d and _has_ref(v):
                        problems.append(
                            f"{at}{_key(k)}: in the checkpoint but not in the destination "
                            "(strict=False loads it into new memory)"
                        )
        elif isinstance(d, (list, tuple)):
            if not isinstance(stored, (list, tuple)) or len(stored) != len(d):
                n = f"{len(stored)} items" if isinstance(stored, (list, tuple)) else _kind(stored)
                if _has_tensor(d):
                    problems.append(f"{at}: {len(d)} items in the destination, {n} in the checkpoint")
                return
            for k, (s_v, d_v) in enumerate(zip(stored, d, strict=True)):
                walk(s_v, d_v, f"{at}[{k}]")

    walk(sec.tree, dest, where)
    return out


def _destination_problem(rec: TensorRecord, d: torch.Tensor, at: str) -> str | None:
    """Why destination tensor ``d`` cannot take the stored tensor ``rec`` in place, or None."""
    got = _NAMES.get(d.dtype, str(d.dtype))
    if rec.dtype != got:
        return f"{at}: dtype {rec.dtype} in the checkpoint, {got} in the destination"
    if tuple(rec.shape) != tuple(d.shape):
        return f"{at}: shape {list(rec.shape)} in the checkpoint, {list(d.shape)} in the destination"
    if d.numel() > 1 and any(n > 1 and s == 0 for n, s in zip(d.shape, d.stride(), strict=True)):
        return (
            f"{at}: the destination (shape {list(d.shape)}, stride {list(d.stride())}) overlaps "
            "itself, an expand() view: it cannot hold distinct values; pass a tensor of its own"
        )
    return None


def _kind(v: Any) -> str:
    if isinstance(v, TensorRef):
        return "a tensor"
    return "None" if v is None else f"a {type(v).__name__}"


def _has_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, Mapping):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def _has_ref(v: Any) -> bool:
    if isinstance(v, TensorRef):
        return True
    if isinstance(v, dict):
        return any(_has_ref(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_ref(x) for x in v)
    return False
