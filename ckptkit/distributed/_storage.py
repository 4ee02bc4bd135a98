"""ckptkit as a storage backend of PyTorch Distributed Checkpoint (DCP).

:class:`Writer` and :class:`Reader` implement DCP's ``StorageWriter`` /
``StorageReader`` (``torch/distributed/checkpoint/storage.py`` is the contract), so
``dcp.save(state, storage_writer=Writer(path))`` and ``dcp.load(state,
storage_reader=Reader(path))`` work for plain, DDP and FSDP2 (DTensor) state dicts,
with DCP's resharding on load. What changes against DCP's default filesystem
backend (``spec/distributed.md``):

* nothing in the files is pickle: tensor chunks are raw bytes in the container's
  section encoding (or those bytes through DCP stream extensions such as zstd, R-DC11),
  non-tensor leaves (step, lr, param_groups) plain msgpack in the metadata, looked up
  through the planner instead of ``torch.save``;
* all ranks commit or none: each rank's file is fsync'd and renamed before the
  coordinator writes ``metadata.ckdcp`` atomically, last; a committed checkpoint is
  never written into: ``overwrite=True`` commits the new one beside it and swaps the
  two directories atomically (R-DC09);
* every byte read is verified: the chunk is the unit of verification, so a read
  of part of a chunk (resharding) reads and hashes the whole chunk first;
* a dtype differing between checkpoint and destination is refused, never cast.

The constructors take ``FileSystemWriter``'s and ``FileSystemReader``'s arguments
(``spec/distributed.md`` §9): each means what it means there or is refused by name.

Known limit: DCP's own collectives still pickle plans and results *in memory*
between ranks (``gather_object``); the promise is about files.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

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

from ..errors import (
    CheckpointError,
    CheckpointNotFound,
    InsufficientMemory,
    MalformedIndex,
    SaveFailed,
    StateMismatch,
    UnsupportedOption,
    UnsupportedValue,
    UnsupportedVersion,
)
from ..format._atomic import exchange, fsync_dir
from ..format._checks import check_int
from ..format._codec import check_tensor, decode_tree, dtype_name, memory_available, tensor_bytes, torch_dtype
from ..format._container import Source
from ..format._place import place_for, serves
from ..format._section import DTYPE_SIZES, check_plain
from ._format import (
    METADATA_NAME,
    Chunk,
    DataFile,
    DirMetadata,
    RankFile,
    TensorEntry,
    chunk_mismatch,
    data_name,
    metadata_writer,
    read_metadata,
    write_data,
    write_data_file,
    write_metadata,
)
from ._objects import RemoteCheckpoint, check_listed, discard, refuse_local_companions, scratch

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

    A drop-in for DCP's ``FileSystemWriter``: it takes the same arguments
    (``spec/distributed.md`` §9 says what each means here). ``overwrite=True`` (DCP's
    default) replaces a committed checkpoint atomically: the new one is written and
    committed beside it, then the two directories are swapped in one step, so ``path``
    always holds the old checkpoint or the new one, whole. ``overwrite=False`` refuses a
    directory that holds one. A directory left incomplete by a failed save is saved into
    again either way.

    Args:
        path: the checkpoint's directory, or an ``s3://bucket/prefix/name`` URL: its objects,
            committed by one commit record (spec/objectstore.md R-O30..R-O34).
        single_file_per_rank: must be True (one data file per rank is the format).
        sync_files: accepted; ckptkit always fsyncs before it commits (False is ignored).
        thread_count: >= 1; accepted, each rank writes its one file with one thread.
        per_thread_copy_ahead: >= 0; accepted, tensors are copied to the CPU one at a time.
        cache_staged_state_dict: must be False: this writer is no stager, ``dcp.async_save``
            stages for it with DCP's faster ``DefaultStager``; for a cached staging copy pass
            ``async_stager=BlockingAsyncStager(cache_staged_state_dict=True)`` to it.
        overwrite: replace a committed checkpoint in ``path`` (atomically) or refuse it. On object
            storage a committed checkpoint is never replaced, whatever it says (R-O11).
        _extensions: DCP stream extensions (``StreamTransformExtension``: zstd's ``ZStandard``,
            or your own) applied to every chunk; the digest is over the stored bytes, which
            a reader checks before any extension decodes them. Anything else is refused by name.
        serialization_format: DCP's default (``TORCH_SAVE``) or None; ckptkit's format
            replaces it (no ``torch.save`` bytes); ``SAFETENSORS`` is refused.
        companions: object storage only, the coordinator's: ``{suffix: bytes}`` committed with the
            checkpoint as the objects ``<name>.<suffix>``, listed by its one record (R-O30).

    Raises:
        UnsupportedOption: another URL scheme than ``s3://``, companions for a local path, or an
            argument ckptkit refuses (named, with why).
        ValueError: ``thread_count`` < 1 or ``per_thread_copy_ahead`` < 0.

    Example:
        >>> dcp.save(state, storage_writer=ckptkit.distributed.Writer("ckpt/step-100"))  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        *,
        companions: Mapping[str, bytes] | None = None,
    ) -> None:
        super().__init__()
        self.path, self.remote = place(path)
        if self.remote is None:
            refuse_local_companions(companions, self.path)
        self.companions = dict(companions or {})
        _check_writer_options(single_file_per_rank, thread_count, per_thread_copy_ahead, serialization_format)
        if cache_staged_state_dict:
            raise UnsupportedOption(
                "cache_staged_state_dict=True: ckptkit.distributed.Writer is no stager (dcp.async_save stages for "
                "it with DCP's DefaultStager); for a cached staging copy pass "
                "async_stager=BlockingAsyncStager(cache_staged_state_dict=True) to dcp.async_save"
            )
        self.extensions = check_extensions(_extensions)
        self.single_file_per_rank, self.sync_files, self.overwrite = True, True, bool(overwrite)
        self.thread_count, self.per_thread_copy_ahead = thread_count, per_thread_copy_ahead
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path, self.remote = place(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.failure = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False and _world_size() > 1:
            raise self._record(
                UnsupportedOption(
                    f"use_collectives=False at world size {_world_size()}: every rank would commit its own "
                    "metadata, which breaks the all-ranks-commit rule (R-DC03); ckptkit.distributed.Writer takes "
                    "use_collectives=False only in a single process"
                )
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.remote is not None:
            return canonical_plan(plan)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise self._record(
                SaveFailed(
                    f"{self.path}: cannot create the checkpoint directory ({e.strerror})", cause=e, path=self.path
                )
            ) from e
        if not self.overwrite and _committed(self.path):
            raise self._record(
                SaveFailed(
                    f"{self.path}: Checkpoint already exists and overwrite=False (R-DC09); save into a new "
                    "directory, or pass overwrite=True to replace it atomically",
                    path=self.path,
                )
            )
        return canonical_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator decides where every rank writes: ``path``, or beside it when it holds a commit;
        on object storage, it refuses a committed checkpoint and cleans an interrupted one first (R-O32)."""
        into = self.path
        if self.remote is not None:
            try:
                self.remote.begin()
            except CheckpointError as e:
                raise self._record(e) from None
        elif _committed(self.path):
            into = staging_path(self.path)
            try:
                shutil.rmtree(into, ignore_errors=True)  # what an interrupted replacement left
                os.makedirs(into)
            except OSError as e:
                raise self._record(
                    SaveFailed(f"{into}: cannot create the replacement's directory ({e.strerror})", cause=e, path=into)
                ) from e
        plans = [canonical_plan(p) for p in plans]  # a planner's global step may reorder what it kept
        return [dataclasses.replace(p, storage_data=(rank, len(plans), into)) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write(plan, planner)
        except CheckpointError as e:
            raise self._record(e) from None
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        rank, world, into = plan.storage_data
        results: list[WriteResult] = []
        chunks, keep, indexes = [], [], []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                results.append(WriteResult(item.index, 0, ("value", check_plain(_lookup(planner, item), fqn))))
                continue
            tensor = planner.resolve_data(item)
            assert isinstance(tensor, torch.Tensor) and item.tensor_data is not None
            dtype, shape = check_tensor(tensor, fqn), tuple(tensor.shape)
            held, buf = tensor_bytes(tensor)
            keep.append(held)
            if self.extensions:
                buf = memoryview(_transform(buf, self.extensions))
                dtype, shape = "uint8", (len(buf),)
            chunks.append((fqn, tuple(item.tensor_data.chunk.offsets), dtype, shape, buf))
            indexes.append(item.index)
        rank_file, placed, written = self._data_file(into, rank, world, chunks)
        # reading order: the first wraps the stored bytes (DCP records them reversed, which undoes a
        # chain of two or more in the wrong order)
        descriptors = tuple(str(e.get_descriptor()) for e in self.extensions)
        for index, (offset, nbytes, digest) in zip(indexes, placed, strict=True):
            results.append(WriteResult(index, nbytes, ("chunk", rank, offset, nbytes, digest, descriptors)))
        results.append(WriteResult(MetadataIndex(_FILE_KEY), rank_file.size, ("file", rank, rank_file, into, written)))
        return results

    def _data_file(self, into: str, rank: int, world: int, chunks: list[Any]) -> tuple[RankFile, Any, Any]:
        """This rank's data file in ``into``; on object storage written to a private temporary file,
        uploaded as the rank's object while it is written (R-O52), whose ``(entry, ETag)`` goes to the
        coordinator (R-O30)."""
        if self.remote is None:
            return (*write_data_file(into, rank, world, chunks), None)
        out: list[DataFile] = []
        written = self.remote.put_rank(rank, lambda f: out.append(write_data(f, rank, world, chunks)))
        return (*out[0], written)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: every rank's file is durable (its write_data returned); write the metadata last,
        then, for a replacement, swap the committed new directory with the old one."""
        try:
            into = _written_into(results, self.path)
            if self.remote is not None:
                self._commit_remote(_encode(metadata, results), results)
                return
            write_metadata(into, _encode(metadata, results))
            if into != self.path:
                replace_directory(self.path, into)
        except CheckpointError as e:
            raise self._record(e) from None

    def _commit_remote(self, md: DirMetadata, results: list[list[WriteResult]]) -> None:
        """The metadata (uploaded as it is written), then the one record over every rank's object."""
        assert self.remote is not None
        ranks = [wr.storage_data[4] for rr in results for wr in rr if wr.storage_data[0] == "file"]
        self.remote.commit(metadata_writer(md), self.companions, ranks)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a local path and an ``s3://`` URL; False for another scheme, which this backend does not serve."""
        return serves(checkpoint_id)


def _item_key(item: Any) -> tuple[str, tuple[int, ...], int]:
    index = item.index
    return index.fqn, tuple(index.offset or ()), index.index or 0


def canonical_plan(plan: SavePlan) -> SavePlan:
    """``plan`` with its items in canonical order: by key, then chunk offsets (R-DC13).

    DCP's planner lists a rank's items in the state dict's iteration order, which depends
    on history (an optimizer creates a parameter's state when its first gradient comes,
    and holds it in checkpoint order after a reload). The order decides which rank keeps a
    replicated tensor (DCP's dedup balances sizes in item order) and where each chunk lies
    in a rank file, so without this the bytes of a checkpoint would depend on the run's
    past, not only on its state.
    """
    return dataclasses.replace(plan, items=sorted(plan.items, key=_item_key))


def _commit_id(path: str) -> tuple[int, int] | None:
    """Which ``metadata.ckdcp`` is at ``path`` now: a replacement swaps in another file."""
    try:
        st = os.stat(os.path.join(path, METADATA_NAME))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    """This process's rank in the default group (0 in one process): the one that lists for all (R-O33)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _committed(path: str) -> bool:
    return os.path.exists(os.path.join(path, METADATA_NAME))


def _written_into(results: list[list[WriteResult]], path: str) -> str:
    """The directory every rank wrote into (each rank's file record says), which must be one."""
    dirs = {wr.storage_data[3] for rank_results in results for wr in rank_results if wr.storage_data[0] == "file"}
    if len(dirs) != 1:
        raise SaveFailed(f"{path}: the ranks wrote into {sorted(dirs)}, not one directory; nothing committed")
    return str(dirs.pop())


def staging_path(path: str) -> str:
    """Where a replacement of the committed checkpoint ``path`` is written: a hidden sibling."""
    head, name = os.path.split(os.path.normpath(path))
    return os.path.join(head, f".{name}.new")


def replace_directory(path: str, staged: str) -> None:
    """Swap the committed ``staged`` directory into ``path`` in one step, then remove the old one.

    A crash before the swap leaves the old checkpoint at ``path`` (and a stray ``staged``,
    removed by the next replacement); after it, the new one (and the old one in ``staged``).

    Raises:
        SaveFailed: the swap failed or the platform cannot swap; ``path`` holds the old checkpoint.
    """
    exchange(staged, path)
    try:
        fsync_dir(os.path.dirname(os.path.normpath(path)))
    except OSError as e:
        raise SaveFailed(
            f"{path}: the new checkpoint is in place but its directory could not be synced ({e.strerror}); "
            "it may not survive a power loss",
            cause=e,
            path=path,
        ) from e
    shutil.rmtree(staged, ignore_errors=True)


def place(checkpoint_id: str | os.PathLike[str]) -> tuple[str, RemoteCheckpoint | None]:
    """``(path, None)`` for a local directory, ``(url, its objects)`` for an ``s3://`` URL (never a
    local folder ``s3:``).

    Raises:
        UnsupportedOption: another scheme, a bucket without a name, or no S3 client (R-O01, R-O02).
    """
    if place_for(checkpoint_id).fetches:
        remote = RemoteCheckpoint.at(checkpoint_id)
        return remote.url, remote
    return os.fspath(checkpoint_id), None


def _check_writer_options(single_file_per_rank: bool, thread_count: int, copy_ahead: int, fmt: Any) -> None:
    """Refuse ``FileSystemWriter`` arguments that ckptkit cannot honour, naming them."""
    if single_file_per_rank is not True:
        raise UnsupportedOption(
            f"single_file_per_rank={single_file_per_rank!r}: ckptkit's format is one data file per rank "
            "(spec/distributed.md §1), never one file per tensor; leave it at True"
        )
    check_int("thread_count", thread_count, least=1)
    check_int("per_thread_copy_ahead", copy_ahead)
    if fmt is not None and getattr(fmt, "name", fmt) != "TORCH_SAVE":
        raise UnsupportedOption(
            f"serialization_format={fmt!r}: ckptkit writes its own format (raw chunk bytes, plain msgpack), "
            "neither torch.save nor safetensors files; leave it at the default"
        )


def check_extensions(extensions: Sequence[Any] | None) -> tuple[Any, ...]:
    """DCP's ``_extensions``: stream transforms, applied to every chunk in order.

    Raises:
        UnsupportedOption: an extension that is no ``StreamTransformExtension`` (named).
    """
    extensions = tuple(extensions or ())
    if not extensions:
        return ()
    from torch.distributed.checkpoint._extension import StreamTransformExtension  # torch >= 2.6

    foreign = [e for e in extensions if not isinstance(e, StreamTransformExtension)]
    if foreign:
        names = ", ".join(_extension_name(e) for e in foreign)
        raise UnsupportedOption(
            f"_extensions: {names}: not a DCP StreamTransformExtension; ckptkit.distributed applies stream "
            "transforms (such as torch.distributed.checkpoint._extension.ZStandard) to each chunk, nothing else"
        )
    return extensions


class _Sink(io.RawIOBase):
    """The innermost stream of a transform chain: collects the stored bytes, survives close()."""

    def __init__(self) -> None:
        self.out = io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.out.write(b)


def _transform(buf: memoryview, extensions: Sequence[Any]) -> bytes:
    """A chunk's bytes as stored: passed through each extension's ``transform_to``, as DCP does."""
    sink = _Sink()
    stream: Any = sink
    for ext in extensions:
        stream = ext.transform_to(stream)
    stream.write(buf)
    stream.close()
    return sink.out.getvalue()


def _extension_name(ext: Any) -> str:
    try:
        return str(ext.get_descriptor())
    except Exception:  # noqa: BLE001 - a foreign object: name it by its type
        return type(ext).__name__


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
    stored: dict[tuple[str, tuple[int, ...]], tuple[int, int, int, int, tuple[str, ...]]] = {}
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

    A drop-in for DCP's ``FileSystemReader``: ``_extension_registry`` decodes chunks a
    writer stored through stream extensions (default: DCP's registry, which knows zstd),
    after their stored bytes are verified.

    On object storage (``s3://``) each rank fetches the commit record and the metadata object,
    checked against the record's size and digest before a byte of it is parsed, then only the byte
    ranges of the rank files that hold the chunks its plan reads, each chunk checked against its
    digest in that metadata (R-O33): a rank fetches about its share of the checkpoint, not every
    rank's file.

    Raises:
        UnsupportedOption: ``path`` is a URL of another scheme than ``s3://``.

    Example:
        >>> dcp.load(state, storage_reader=ckptkit.distributed.Reader("ckpt/step-100"))  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None) -> None:
        super().__init__()
        self.path, self.remote = place(path)
        self.entries: dict[str, Any] = {}  # object storage: the record's entries by key
        self.extension_registry = _extension_registry
        self.load_id = uuid.uuid4().hex
        self.metadata: DirMetadata | None = None
        self.commit: tuple[int, int] | None = None  # the metadata file read (device, inode)
        self.storage_data: dict[MetadataIndex, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path, self.remote = place(checkpoint_id)
        self.entries = {}
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
            if self.remote is not None:
                md = self.metadata = self._remote_metadata()
            else:
                self.commit = _commit_id(self.path)  # before the read: a replacement after it is then seen
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

    def _remote_metadata(self) -> DirMetadata:
        """The record, then the metadata object it lists (checked), read from a private copy removed
        after; every rank file the metadata names must be listed with the size it says (R-O33)."""
        assert self.remote is not None
        local = scratch()
        try:
            self.entries = self.remote.entries(name_leftovers=_rank() == 0)  # one LIST for all ranks, if any
            self.remote.fetch(self.entries, self.remote.name, local)
            md = read_metadata(os.path.join(local, self.remote.name), check_files=False)
        finally:
            discard(local)
        check_listed(self.remote, self.entries, md)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: DCPLoadPlanner) -> Future[None]:
        """Read and verify every chunk of ``plan`` into the planner's destinations.

        Raises:
            ChecksumMismatch, TruncatedFile, StateMismatch, R-DC11's errors: see :func:`read_chunk`.
            CheckpointNotFound: the checkpoint was replaced (``overwrite=True``) after its metadata was read.
        """
        try:
            self._read(plan, planner)
        except CheckpointError as e:
            if self.remote is not None or _commit_id(self.path) == self.commit:
                raise self._record(e) from None
            raise self._record(
                CheckpointNotFound(
                    f"{self.path}: the checkpoint was replaced while this load read it (a save with overwrite=True "
                    f"swapped in a new one after its metadata was read: {e}); do not use state from this failed "
                    "load, load again"
                )
            ) from None
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
        # in file order, one rank file open at a time: on object storage a rank file's reads are then
        # ranged GETs front to back, holding one window of it (R-O33, R-O51)
        order = sorted(groups.items(), key=lambda kv: (kv[1][0].rank, kv[1][0].offset))
        for rank, group in itertools.groupby(order, key=lambda kv: kv[1][0].rank):
            items = list(group)
            src = self._rank_file(rank, [c for _, (c, _) in items])
            try:
                for (fqn, _), (c, reqs) in items:
                    self._read_chunk(src, fqn, c, reqs, planner)
            finally:
                src.close()

    def _rank_file(self, rank: int, chunks: list[Chunk]) -> _Chunks:
        """``rank``'s data file, to read ``chunks`` from: in the directory, or their byte ranges of its object."""
        if self.remote is None:
            return Source(os.path.join(self.path, data_name(rank)))
        return self.remote.ranges(self.entries, rank, ((c.offset, c.offset + c.nbytes) for c in chunks))

    def _read_chunk(
        self, src: _Chunks, fqn: str, c: Chunk, reqs: list[tuple[Any, torch.Tensor]], planner: DCPLoadPlanner
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
        read_chunk(src, fqn, c, whole, self.extension_registry)
        for req, dest in reqs:
            if not direct:
                dest.copy_(_box(whole, req.storage_offsets, req.lengths))
            planner.commit_tensor(req, dest)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a local path and an ``s3://`` URL; False for another scheme, which this backend does not serve."""
        return serves(checkpoint_id)


class _Chunks(Protocol):
    """Where a rank file's chunks are read from: the local file (:class:`Source`), or the byte
    ranges of its object (:class:`~ckptkit.distributed._objects.RankRanges`); ``path`` names it."""

    @property
    def path(self) -> str | None: ...
    def readinto(self, offset: int, buf: memoryview) -> None: ...
    def close(self) -> None: ...


def read_chunk(src: _Chunks, fqn: str, c: Chunk, out: torch.Tensor, registry: Any = None) -> None:
    """Read chunk ``c`` of the rank file ``src`` into the contiguous CPU tensor ``out``, hashing each
    piece while in cache.

    A transformed chunk's stored bytes are read and verified first, then decoded through
    ``registry`` (DCP's ``ExtensionRegistry``; default: DCP's, which knows zstd).

    Raises:
        ChecksumMismatch: the bytes do not match the chunk's digest (file, tensor, offset named).
        TruncatedFile: the file shrank while being read.
        UnsupportedVersion: a transform the registry does not know (R-DC11).
        MalformedIndex: a transformed chunk that does not decode to its size (R-DC11).
    """
    buf = out.reshape(-1).view(torch.uint8).numpy().data if out.numel() else memoryview(bytearray())
    stored = memoryview(bytearray(c.nbytes)) if c.transforms else buf
    h = xxhash.xxh3_64()
    for a in range(0, c.nbytes, _READ_PIECE):
        piece = stored[a : a + _READ_PIECE]
        src.readinto(c.offset + a, piece)
        h.update(piece)
    if h.intdigest() != c.digest:
        raise chunk_mismatch(str(src.path), fqn, c, h.intdigest())
    if c.transforms:
        _untransform(stored, buf, str(src.path), fqn, c, registry)


def _untransform(stored: memoryview, out: memoryview, path: str, fqn: str, c: Chunk, registry: Any) -> None:
    """Decode verified stored bytes through the chunk's transforms into ``out``, which they must fill exactly."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    field = f"tensor {fqn!r}"
    try:
        extensions = (registry or ExtensionRegistry()).from_descriptor_list(list(c.transforms))
        if not all(isinstance(e, StreamTransformExtension) for e in extensions):
            raise ValueError("not a stream transform")
    except ValueError as e:
        raise UnsupportedVersion(
            f"chunk at {list(c.offsets)} is stored through {', '.join(c.transforms)}, which this reader cannot "
            f"decode ({e})",
            path=path,
            offset=c.offset,
            field=field,
            hint="pass Reader(path, _extension_registry=...) with the extension registered (R-DC11)",
        ) from None
    stream: Any = io.BytesIO(stored)
    got, extra = 0, bytearray(1)
    try:
        for ext in extensions:
            stream = cast(StreamTransformExtension, ext).transform_from(stream)
        while got < len(out) and (n := stream.readinto(out[got:])):
            got += n
        over = stream.readinto(extra) if got == len(out) else 0
    except Exception as e:  # noqa: BLE001 - whatever the extension raises, named as a format error
        raise MalformedIndex(
            f"chunk does not decode ({type(e).__name__}: {e})", path=path, offset=c.offset, field=field, hint="R-DC11"
        ) from None
    if got != len(out) or over:
        raise MalformedIndex(
            f"chunk at {list(c.offsets)} decodes to {'more than ' if over else ''}{got} bytes",
            path=path,
            offset=c.offset,
            field=field,
            expected=len(out),
            actual=got,
            hint="the writer that stored it is faulty (R-DC11)",
        )


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
            _check_room(directory, fqn, t)
            full = torch.zeros(t.size, dtype=torch_dtype(t.dtype))
            for c in t.chunks:
                src = files.get(c.rank)
                if src is None:
                    src = files[c.rank] = Source(os.path.join(directory, data_name(c.rank)))
                part = torch.empty(c.sizes, dtype=full.dtype)
                read_chunk(src, fqn, c, part)
                _box(full, c.offsets, c.sizes).copy_(part)
            yield fqn, full
    finally:
        for src in files.values():
            src.close()


def _check_room(directory: str, fqn: str, t: TensorEntry) -> None:
    """Refuse, before allocating, a tensor (and its largest chunk) that would not fit in memory.

    Untransformed chunks are bytes present in the data files (R-DC20, R-DC21); a transformed
    chunk's size is what it declares it decodes to, known only once decoded.

    Raises:
        InsufficientMemory: naming the tensor, what it needs and what is available.
    """
    item = DTYPE_SIZES[t.dtype]
    need = math.prod(t.size) * item + max((math.prod(c.sizes) * item for c in t.chunks), default=0)
    found = memory_available()
    if found is None or need <= found[0]:
        return
    raise InsufficientMemory(
        f"{directory}: tensor {fqn!r} ({t.dtype}{list(t.size)}) needs {need} bytes to assemble but only "
        f"{found[0]} are available ({found[1]}); nothing was allocated. Free memory, or compare on a larger machine"
    )


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
                if not self.allow_partial_load:
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
