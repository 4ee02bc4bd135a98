"""Lazy checkpoints: map the file, read only what is asked for, check each tensor on first access.

:func:`open_checkpoint` parses the header, each index's map and the extent of every
tensor, and checks the skeleton digest (a few kilobytes: everything but the tensor
bytes), then maps the file. A section's records and tree are checked on the first use
of that section, and a tensor's bytes are hashed straight from the mapping and compared
with its digest before it is handed out, so one tensor of a multi-gigabyte file costs
milliseconds, index work grows with that tensor's section, and the tensor is as
trustworthy as a full :func:`ckptkit.load` (``spec/guarantees.md`` G-71). Implements
the lazy reading that ``spec/container.md`` §8 designs the per-tensor digests for; the
cost model is in ``spec/performance.md``.

Invariants:
    * A tensor is never returned before its digest, its section's index and the
      skeleton digest passed every check ``load`` makes (legacy v1 files carry no
      digests; ``legacy`` says so).
    * Returned tensors share the mapping, not the file: the mapping is private
      (copy-on-write), so writing into a tensor never changes the file, and a
      checkpoint replaced on disk (ckptkit saves by rename) does not change
      tensors already taken. The mapping lives until the last such tensor dies.
    * Malformed bytes raise only :mod:`ckptkit.errors`; a key that is not in the
      tree raises ``KeyError`` naming the path and the keys that do exist.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import TYPE_CHECKING, Any

from ..errors import ChecksumMismatch
from ._container import (
    SECTIONS,
    Layout,
    Source,
    check_flags,
    check_skeleton,
    read_layout,
)
from ._read import check_mapped
from ._section import SectionIndex, TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["LazyCheckpoint", "open_checkpoint"]


def open_checkpoint(path: str | os.PathLike[str]) -> LazyCheckpoint:
    """Open a checkpoint lazily: skeleton now, each section's index on first use, each tensor on first access.

    Args:
        path: a v2 (or legacy v1) checkpoint file, or an ``s3://`` URL (the committed
            object is fetched whole, its size and digest checked, into an unlinked temporary file).

    Returns:
        A :class:`LazyCheckpoint`; use it as a context manager (or call ``close()``).

    Raises:
        CheckpointNotFound: no such file.
        BadMagic, UnsupportedVersion, TruncatedFile, MalformedIndex,
        ChecksumMismatch (skeleton, R-005), ReservedBitSet: the header, an index's map
            or lengths, a tensor's extent, or the skeleton digest breaks a rule of
            ``spec/container.md`` (a damaged record or tree is named by its own rule).
            The rest of a section's records and tree is checked by the first use of that
            section, each tensor's digest by its first access (G-71).

    Example:
        >>> with open_checkpoint("run/step-00000100.ckpt") as ck:  # doctest: +SKIP
        ...     emb = ck.tensor("model", "net", "wte.weight")  # reads and checks only these bytes
    """
    return LazyCheckpoint(path)


def _open_source(path: str) -> Source:
    """The file at ``path``; at an ``s3://`` URL, the committed object (size and digest checked
    against its record, R-O14) in an unlinked temporary file, so that tensors map it as a file's."""
    from ._place import read_file

    return read_file(path)


class LazyCheckpoint:
    """An open checkpoint whose tensors are mapped, and checked, only when asked for.

    Attributes:
        path: the file.
        step, flags, version, legacy, missing: as in :class:`ckptkit.Checkpoint`.

    Tensors it returns are CPU tensors backed by a private mapping of the file
    (zero-copy; writable without touching the file); tensors of a zstd section are
    decoded together (each into its own memory, every digest checked) on the first
    access to one of them. Asking
    twice for a tensor returns the same object. Safe to use from several threads.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._src = _open_source(self.path)
        try:
            layout = read_layout(self._src, deferred=True)
            if not layout.legacy:
                _check_skeleton(self._src, layout)
                check_flags(layout)
            # Private and lazy: no byte is read until touched; writes stay in this process.
            self._map: mmap.mmap | None = mmap.mmap(self._src.fd, 0, access=mmap.ACCESS_COPY)
        except BaseException:
            self._src.close()
            raise
        self._layout: Layout = layout
        self.step: int = layout.step
        self.flags: int = layout.flags
        self.version: int = layout.version
        self.legacy: bool = layout.legacy
        self.missing: tuple[str, ...] = layout.missing
        self._tensors: dict[tuple[str, int], torch.Tensor] = {}
        self._decoded: dict[str, list[torch.Tensor]] = {}  # zstd sections, decoded whole on first access
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ context

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the file. Tensors already returned stay valid (they keep the mapping)."""
        self._src.close()
        self._map = None  # unmapped when the last tensor taken from it is freed

    # ------------------------------------------------------------------ access

    @property
    def sections(self) -> tuple[str, ...]:
        """Names of the sections present in the file, in file order."""
        return tuple(n for n in SECTIONS if self._layout.sections.get(n) is not None)

    def keys(self, section: str, *keys: str | int) -> list[str | int]:
        """The keys of the map (or the indices of the list) at ``section[keys...]``; reads no tensor.

        Raises:
            KeyError: no such section or key.
            MalformedIndex, UnsupportedVersion: the section's records or tree break a rule
                (checked on the section's first use, G-71).
            TypeError: the value there is a leaf, not a map or list.
        """
        _, node, where = self._walk(section, keys)
        if isinstance(node, dict):
            return list(node)
        if isinstance(node, (list, tuple)):
            return list(range(len(node)))
        raise TypeError(f"{where}: is {_kind(node)}, not a map or list")

    def get(self, section: str, *keys: str | int) -> Any:
        """The value at ``section[keys...]``: a plain value, a tensor, or a subtree.

        Every tensor in the returned value is read and checked (only those).

        Raises:
            KeyError: no such section or key.
            MalformedIndex, UnsupportedVersion: the section's records or tree break a rule (G-71).
            ChecksumMismatch: a tensor's bytes do not match its digest (R-007).
            MalformedIndex: the zstd region holding it does not decode (R-008).
        """
        sec, node, _ = self._walk(section, keys)
        return self._materialize(sec, node)

    def tensor(self, section: str, *keys: str | int) -> torch.Tensor:
        """The tensor at ``section[keys...]``, checked against its digest on first access.

        Raises:
            KeyError: no such section or key.
            TypeError: the value there is not a tensor.
            MalformedIndex, UnsupportedVersion: the section's records or tree break a rule (G-71).
            ChecksumMismatch: the tensor's bytes do not match its digest (R-007).
            MalformedIndex: the zstd region holding it does not decode (R-008).

        Example:
            >>> ck.tensor("optim", "optimizers", "adamw", "state", 0, "exp_avg")  # doctest: +SKIP
        """
        sec, node, where = self._walk(section, keys)
        if not isinstance(node, TensorRef):
            raise TypeError(f"{where}: is {_kind(node)}, not a tensor")
        return self._tensor(sec, node.id)

    # ------------------------------------------------------------------ internals

    def _walk(self, section: str, keys: tuple[str | int, ...]) -> tuple[SectionIndex, Any, str]:
        sec = self._layout.sections.get(section)
        if sec is None:
            have = ", ".join(self.sections) or "none"
            raise KeyError(f"{self.path}: no section {section!r} in this checkpoint (present: {have})")
        node, where = sec.tree, section
        for k in keys:
            in_dict = isinstance(node, dict) and k in node
            in_list = isinstance(node, (list, tuple)) and isinstance(k, int) and -len(node) <= k < len(node)
            if not (in_dict or in_list):
                raise KeyError(f"{self.path}: {where}: no key {k!r} (keys here: {_preview(node)})")
            node = node[k]
            where = f"{where}[{k!r}]"
        return sec, node, where

    def _materialize(self, sec: SectionIndex, node: Any) -> Any:
        if isinstance(node, TensorRef):
            return self._tensor(sec, node.id)
        from ._codec import decode_tree

        table = {i: self._tensor(sec, i) for i in sorted({r.id for r in _refs(node)})}
        return decode_tree(node, table)

    def _tensor(self, sec: SectionIndex, i: int) -> torch.Tensor:
        key = (sec.name, i)
        with self._lock:
            hit = self._tensors.get(key)
            if hit is not None:
                return hit
            t = self._read(sec, i)
            self._tensors[key] = t
            return t

    def _read(self, sec: SectionIndex, i: int) -> torch.Tensor:
        from ._codec import mapped_tensor, read_section_tensors  # torch-side work; importing ckptkit stays torch-free

        if sec.codec != "raw":
            decoded = self._decoded.get(sec.name)
            if decoded is None:
                decoded = self._decoded[sec.name] = read_section_tensors(self._src, sec)
            return decoded[i]
        if self._map is None:
            raise ValueError(f"{self.path}: the checkpoint is closed")
        check_mapped(self.path, sec, i, self._map)
        rec = sec.tensors[i]
        return mapped_tensor(self._map, sec.data_start + rec.offset, rec.dtype, rec.shape)


def _check_skeleton(src: Source, layout: Layout) -> None:
    """The skeleton digest (R-005) over a layout whose records and trees are not decoded yet.

    A mismatch means a damaged header, index or padding; a damaged index is named by its
    own rule first (R-010..R-018), as :func:`ckptkit.load` names it, by decoding every
    section before the mismatch is raised.
    """
    try:
        check_skeleton(src, layout)
        return
    except ChecksumMismatch as e:
        mismatch = e
    for sec in layout.sections.values():
        if sec is not None:
            sec.tree  # noqa: B018 - decoding checks the records and the tree; raises what is wrong
    raise mismatch


def _refs(node: Any) -> list[TensorRef]:
    if isinstance(node, TensorRef):
        return [node]
    if isinstance(node, dict):
        return [r for v in node.values() for r in _refs(v)]
    if isinstance(node, (list, tuple)):
        return [r for v in node for r in _refs(v)]
    return []


def _kind(node: Any) -> str:
    if isinstance(node, TensorRef):
        return "a tensor"
    return "None" if node is None else f"a {type(node).__name__}"


def _preview(node: Any) -> str:
    if isinstance(node, dict):
        ks = list(node)
        return ", ".join(repr(k) for k in ks[:8]) + (f", ... ({len(ks)} keys)" if len(ks) > 8 else "") or "none"
    if isinstance(node, (list, tuple)):
        return f"indices 0..{len(node) - 1}" if node else "none"
    return f"none: it is {_kind(node)}"
