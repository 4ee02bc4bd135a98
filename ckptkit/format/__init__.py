"""Bytes on disk: the v2 container (and v1, read-only), its tensor codec, sidecars,
config snapshots, the companion record, atomic writes and the one walk over state trees.

The floor everything else stands on. It knows files and bytes, never a run: nothing
here imports :mod:`ckptkit.run`, :mod:`ckptkit.guard`, :mod:`ckptkit.audit` or a tool
(``tests/meta/test_layers.py``). Only :mod:`~ckptkit.format._codec` imports torch, on use,
so ``ckptkit verify`` starts without it. spec/container.md, sidecar.md, snapshot.md,
companions.md are the contract.
"""

from __future__ import annotations

from ._asyncsave import AsyncSaver
from ._checkpoint import Checkpoint, import_torch_checkpoint, load, save
from ._container import FLAG_FP32_FALLBACK, VERSION
from ._lazy import LazyCheckpoint, open_checkpoint
from ._sidecar import Sidecar, read_sidecar, write_sidecar
from ._snapshot import Snapshot, read_snapshot, write_snapshot
from ._verify import Report, SectionInfo, verify

__all__ = [
    "FLAG_FP32_FALLBACK",
    "VERSION",
    "AsyncSaver",
    "Checkpoint",
    "LazyCheckpoint",
    "Report",
    "SectionInfo",
    "Sidecar",
    "Snapshot",
    "import_torch_checkpoint",
    "load",
    "open_checkpoint",
    "read_sidecar",
    "read_snapshot",
    "save",
    "verify",
    "write_sidecar",
    "write_snapshot",
]
