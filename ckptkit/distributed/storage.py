"""ckptkit as a storage backend of PyTorch Distributed Checkpoint (DCP).

:class:`Writer` and :class:`Reader` implement DCP's ``StorageWriter`` /
``StorageReader`` (``torch/distributed/checkpoint/storage.py`` is the contract), so
``dcp.save(state, storage_writer=Writer(path))`` and ``dcp.load(state,
storage_reader=Reader(path))`` work for plain, DDP and FSDP2 (DTensor) state dicts,
with DCP's resharding on load. What changes against DCP's default filesystem
backend (``spec/distributed.md``):

* nothing in the files is pickle: tensor chunks are raw bytes in the container's
  section encoding, non-tensor leaves (step, lr, param_groups) plain msgpack in the
  metadata, looked up through the planner instead of ``torch.save``;
* all ranks commit or none: each rank's file is fsync'd and renamed before the
  coordinator writes ``metadata.ckdcp`` atomically, last;
* every byte read is verified: the chunk is the unit of verification, so a read
  of part of a chunk (resharding) reads and hashes the whole chunk first;
* a dtype differing between checkpoint and destination is refused, never cast.

Known limit: DCP's own collectives still pickle plans and results *in memory*
between ranks (``gather_object``); the promise is about files.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import DefaultLoadPlanner, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.planner import (
    LoadPlanner as DCPLoadPlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import CheckpointError, SaveFailed, StateMismatch, UnsupportedValue
from ..format.codec import check_tensor, decode_tree, dtype_name, tensor_bytes, torch_dtype
from ..format.container import Source
from ..format.section import check_plain
from .format import (
    METADATA_NAME,
    Chunk,
    DirMetadata,
    RankFile,
    TensorEntry,
    chunk_mismatch,
    data_name,
    read_metadata,
    write_data_file,
    write_metadata,
)

__all__ = ["LoadPlanner", "Reader", "Writer", "logical_state", "read_chunk"]

#: DCP's metadata version this backend writes (what FileSystemWriter records).
DCP_VERSION = "1.0.0"
_READ_PIECE = 256 << 10  # a piece is hashed while still in cache
_FILE_KEY = "\0ckptkit-rank-file"  # WriteResult key of a rank's file record (never a state-dict key)


class _Recorder:
    """Keeps the ckptkit error this rank raised inside DCP, which DCP wraps in a
    ``CheckpointException`` and, on other ranks, only as a pickled copy."""

    failure: CheckpointError | None = None

    def _record(self, e: CheckpointError) -> CheckpointError:
        self.failure = e
        return e


class Writer(StorageWriter, _Recorder):
    """A DCP ``StorageWriter`` that writes a ckptkit distributed checkpoint into ``path``.

    ``path`` is a directory, one per checkpoint: a directory that already holds a
    committed checkpoint is refused (the previous checkpoint is never touched); one
    left incomplete by a failed save may be saved into again.

    Example:
        >>> dcp.save(state, storage_writer=ckptkit.distributed.Writer("ckpt/step-100"))  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.failure = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise self._record(
                UnsupportedValue(
                    "ckptkit.distributed.Writer needs DCP's collectives (use_collectives=False writes rank-local "
                    "metadata, which breaks the all-ranks-commit rule)"
                )
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise self._record(
                SaveFailed(
                    f"{self.path}: cannot create the checkpoint directory ({e.strerror})", cause=e, path=self.path
                )
            ) from e
        if os.path.exists(os.path.join(self.path, METADATA_NAME)):
            raise self._record(
                SaveFailed(
                    f"{self.path}: already holds a committed checkpoint; save into a new directory "
                    "(one checkpoint, one directory) or remove this one first",
                    path=self.path,
                )
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=(rank, len(plans))) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write(plan, planner)
        except CheckpointError as e:
            raise self._record(e) from None
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        rank, world = plan.storage_data
        results: list[WriteResult] = []
        chunks, keep, indexes = [], [], []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                results.append(WriteResult(item.index, 0, ("value", check_plain(_lookup(planner, item), fqn))))
                continue
            tensor = planner.resolve_data(item)
            assert isinstance(tensor, torch.Tensor) and item.tensor_data is not None
            dtype = check_tensor(tensor, fqn)
            held, buf = tensor_bytes(tensor)
            keep.append(held)
            chunks.append((fqn, tuple(item.tensor_data.chunk.offsets), dtype, tuple(tensor.shape), buf))
            indexes.append(item.index)
        rank_file, placed = write_data_file(self.path, rank, world, chunks)
        for index, (offset, nbytes, digest) in zip(indexes, placed, strict=True):
            results.append(WriteResult(index, nbytes, ("chunk", rank, offset, nbytes, digest)))
        results.append(WriteResult(MetadataIndex(_FILE_KEY), rank_file.size, ("file", rank, rank_file)))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: every rank's file is durable (its write_data returned); write the metadata last."""
        try:
            write_metadata(self.path, _encode(metadata, results))
        except CheckpointError as e:
            raise self._record(e) from None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _lookup(planner: SavePlanner, item: Any) -> Any:
    """A non-tensor leaf as the state dict holds it (DefaultSavePlanner would torch.save it)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise UnsupportedValue(
            f"{item.index.fqn}: a non-tensor value, and the planner {type(planner).__name__} has no lookup_object; "
            "ckptkit stores non-tensor leaves as plain data, not torch.save bytes: use a DefaultSavePlanner (the "
            "default) or a subclass"
        )
    return lookup(item.index)


def _encode(metadata: Metadata, results: list[list[WriteResult]]) -> DirMetadata:
    files: dict[int, RankFile] = {}
    values: dict[str, Any] = {}
    stored: dict[tuple[str, tuple[int, ...]], tuple[int, int, int, int]] = {}
    for wr in (r for rank_results in results for r in rank_results):
        kind, *rest = wr.storage_data
        if kind == "file":
            files[rest[0]] = rest[1]
        elif kind == "value":
            values[wr.index.fqn] = rest[0]
        else:
            assert wr.index.offset is not None  # a tensor's write result always carries its chunk's offset
            stored[(wr.index.fqn, tuple(wr.index.offset))] = tuple(rest)
    world = len(results)
    if sorted(files) != list(range(world)):
        raise SaveFailed(f"rank file records {sorted(files)} do not cover world size {world}; nothing committed")
    tensors = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        chunks = tuple(Chunk(tuple(c.offsets), tuple(c.sizes), *stored[(fqn, tuple(c.offsets))]) for c in md.chunks)
        tensors[fqn] = TensorEntry(dtype_name(md.properties.dtype, fqn), tuple(md.size), chunks)
    return DirMetadata(
        world,
        metadata.version or DCP_VERSION,
        tuple(files[r] for r in range(world)),
        tensors,
        values,
        metadata.planner_data,
    )


class Reader(StorageReader, _Recorder):
    """A DCP ``StorageReader`` for a ckptkit distributed checkpoint directory.

    Every chunk is hashed as it is read and compared with the digest in the
    (itself digested) metadata before any of it is used; a chunk that a reshard
    needs only part of is read and verified whole. A destination whose dtype
    differs from the checkpoint's is refused, never cast. On a digest mismatch the
    load fails; destinations it already filled keep the new values (as with DCP's
    default backend), so do not use state from a failed load.

    Example:
        >>> dcp.load(state, storage_reader=ckptkit.distributed.Reader("ckpt/step-100"))  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.load_id = uuid.uuid4().hex
        self.metadata: DirMetadata | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.storage_data = {}
        self.failure = None

    def read_metadata(self) -> Metadata:  # no **kwargs: never fall back to rank-local metadata
        """The checkpoint's DCP ``Metadata``, decoded from ``metadata.ckdcp`` after checking its digest.

        Raises:
            IncompleteCheckpoint: no metadata (the save did not commit), or a rank file is missing.
            BadMagic: a DCP default-backend directory (pickled; never read).
            FormatError: a damaged metadata file.
        """
        try:
            md = self.metadata = read_metadata(self.path)
        except CheckpointError as e:
            raise self._record(e) from None
        sdm: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for fqn, t in md.tensors.items():
            sdm[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=torch_dtype(t.dtype)),
                torch.Size(t.size),
                [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks],
            )
            for i, c in enumerate(t.chunks):
                storage[MetadataIndex(fqn, c.offsets, i)] = (fqn, c)
        for fqn in md.values:
            sdm[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = (fqn, None)
        return Metadata(
            sdm,
            planner_data=md.planner_data,
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id),
            version=md.dcp_version,
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: DCPLoadPlanner) -> Future[None]:
        try:
            self._read(plan, planner)
        except CheckpointError as e:
            raise self._record(e) from None
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, plan: LoadPlan, planner: DCPLoadPlanner) -> None:
        md = self.metadata
        assert md is not None, "read_metadata() first"
        groups: dict[tuple[str, tuple[int, ...]], tuple[Chunk, list[tuple[Any, torch.Tensor]]]] = {}
        problems: list[str] = []
        for req in plan.items:
            fqn, c = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                _set_value(planner, req, md.values[fqn])
                continue
            dest = planner.resolve_tensor(req).detach()
            want = torch_dtype(md.tensors[fqn].dtype)
            if dest.dtype != want:
                problems.append(
                    f"{req.dest_index.fqn}: the checkpoint holds {md.tensors[fqn].dtype}, "
                    f"the destination is {str(dest.dtype).removeprefix('torch.')} (never cast)"
                )
                continue
            groups.setdefault((fqn, c.offsets), (c, []))[1].append((req, dest))
        if problems:
            problems = sorted(set(problems))
            raise StateMismatch(
                f"{self.path}: {len(problems)} tensor(s) do not fit their destination: " + "; ".join(problems[:10]),
                problems,
            )
        files: dict[int, Source] = {}
        try:
            for (fqn, _), (c, reqs) in groups.items():
                src = files.get(c.rank)
                if src is None:
                    src = files[c.rank] = Source(os.path.join(self.path, data_name(c.rank)))
                self._read_chunk(src, fqn, c, reqs, planner)
        finally:
            for src in files.values():
                src.close()

    def _read_chunk(
        self, src: Source, fqn: str, c: Chunk, reqs: list[tuple[Any, torch.Tensor]], planner: DCPLoadPlanner
    ) -> None:
        req, dest = reqs[0]
        direct = (
            len(reqs) == 1
            and dest.is_contiguous()
            and dest.device.type == "cpu"
            and tuple(dest.shape) == c.sizes
            and not any(req.storage_offsets)
        )
        whole = dest if direct else torch.empty(c.sizes, dtype=dest.dtype)
        read_chunk(src, self.path, fqn, c, whole)
        for req, dest in reqs:
            if not direct:
                dest.copy_(_box(whole, req.storage_offsets, req.lengths))
            planner.commit_tensor(req, dest)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def read_chunk(src: Source, directory: str, fqn: str, c: Chunk, out: torch.Tensor) -> None:
    """Read chunk ``c`` into the contiguous CPU tensor ``out``, hashing each piece while in cache.

    Raises:
        ChecksumMismatch: the bytes do not match the chunk's digest (file, tensor, offset named).
        TruncatedFile: the file shrank while being read.
    """
    h = xxhash.xxh3_64()
    if out.numel():
        buf = out.reshape(-1).view(torch.uint8).numpy().data
        for a in range(0, c.nbytes, _READ_PIECE):
            piece = buf[a : a + _READ_PIECE]
            src.readinto(c.offset + a, piece)
            h.update(piece)
    if h.intdigest() != c.digest:
        raise chunk_mismatch(directory, fqn, c, h.intdigest())


def _box(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        t = t.narrow(dim, o, n)
    return t


def logical_state(directory: str | os.PathLike[str]) -> Iterator[tuple[str, Any]]:
    """Every key of a checkpoint with its logical value, whatever the world size at save:
    each tensor assembled whole from its chunks (each verified), one at a time, in key order.

    Raises:
        CheckpointError: as :meth:`Reader.read_metadata` and :func:`read_chunk`.
    """
    directory = os.fspath(directory)
    md = read_metadata(directory)
    files: dict[int, Source] = {}
    try:
        for fqn in sorted(set(md.tensors) | set(md.values)):
            if fqn in md.values:
                yield fqn, decode_tree(md.values[fqn], [])
                continue
            t = md.tensors[fqn]
            full = torch.zeros(t.size, dtype=torch_dtype(t.dtype))
            for c in t.chunks:
                src = files.get(c.rank)
                if src is None:
                    src = files[c.rank] = Source(os.path.join(directory, data_name(c.rank)))
                part = torch.empty(c.sizes, dtype=full.dtype)
                read_chunk(src, directory, fqn, c, part)
                _box(full, c.offsets, c.sizes).copy_(part)
            yield fqn, full
    finally:
        for src in files.values():
            src.close()


def _set_value(planner: DCPLoadPlanner, req: Any, value: Any) -> None:
    """Put a non-tensor leaf where DefaultLoadPlanner.load_bytes would (it would torch.load bytes).

    DCP's flattening names every dict key by ``str(key)``, so the key path of ``{0: "a"}``
    is ``("0",)`` and ``set_element`` would add a key ``"0"`` beside the destination's
    ``0``. A load is driven by the destination, whose keys are the real ones: each path
    element is resolved against the destination's own keys (:func:`_put`).
    """
    if not isinstance(planner, DefaultLoadPlanner):
        raise UnsupportedValue(
            f"{req.dest_index.fqn}: a non-tensor value, and the planner {type(planner).__name__} is not a "
            "DefaultLoadPlanner; ckptkit hands non-tensor leaves over as plain data, never as torch.load bytes"
        )
    fqn = req.dest_index.fqn
    value = decode_tree(value, [])  # torch dtypes, devices and sizes back as torch objects
    if planner.flatten_state_dict:
        _put(planner.original_state_dict, planner.mappings[fqn], value, fqn)
    else:
        planner.state_dict[fqn] = value


def _put(root: Any, path: tuple[Any, ...], value: Any, fqn: str) -> None:
    """Set ``value`` at DCP key ``path`` of the destination, each str element matched to the key it flattened.

    Raises:
        StateMismatch: a destination dict holds both ``k`` and ``str(k)``, which DCP flattens to one key.
    """
    node = root
    for i, key in enumerate(path):
        if isinstance(node, Mapping):
            found = [k for k in node if str(k) == key]
            if len(found) > 1:
                raise StateMismatch(
                    f"{fqn}: the destination dict holds the keys {found!r}, which DCP names alike ({key!r}); "
                    "rename one of them",
                    [f"{fqn}: keys {found!r} flatten to one DCP key"],
                )
            key = found[0] if found else key
        if i == len(path) - 1:
            node[key] = value
        else:
            node = node[key]


class LoadPlanner(DefaultLoadPlanner, _Recorder):
    """DCP's default load planner, checking everything first: every key the
    destination wants that the checkpoint lacks, every shape and dtype that differs
    and every tensor/value confusion, all listed in one :class:`StateMismatch`
    before anything is read (DCP's own planner stops at the first and casts dtypes)."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        problems = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                problems.append(f"{fqn}: missing from the checkpoint")
            elif isinstance(md, BytesStorageMetadata):
                if isinstance(obj, torch.Tensor):
                    problems.append(f"{fqn}: the checkpoint holds a non-tensor value, the destination a tensor")
            elif not isinstance(obj, torch.Tensor):
                problems.append(f"{fqn}: the checkpoint holds a tensor, the destination a {type(obj).__name__}")
            else:
                if tuple(md.size) != tuple(obj.size()):
                    problems.append(
                        f"{fqn}: the checkpoint's shape is {list(md.size)}, the destination's {list(obj.size())}"
                    )
                if md.properties.dtype != obj.dtype:
                    problems.append(
                        f"{fqn}: the checkpoint holds {dtype_name(md.properties.dtype)}, the destination "
                        f"is {str(obj.dtype).removeprefix('torch.')} (never cast)"
                    )
        if problems:
            raise self._record(
                StateMismatch(
                    f"{len(problems)} problem(s) between the checkpoint and the state to load: "
                    + "; ".join(problems[:10]),
                    problems,
                )
            )
        return super().create_local_plan()
