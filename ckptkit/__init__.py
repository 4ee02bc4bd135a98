"""ckptkit: trustworthy PyTorch checkpoints. A resume is the same run, or a hard error.

The supported surface is what ``__all__`` lists (a test pins it); everything else,
including module internals, may change without notice. See ``docs/api.md``.

    import ckptkit
    ckptkit.save("run/step-00000100.ckpt", ckptkit.Checkpoint(step=100, model={"net": net.state_dict()}))
    report = ckptkit.verify("run/step-00000100.ckpt")
    ckpt = ckptkit.load("run/step-00000100.ckpt")

Importing ckptkit does not import torch; the functions that build tensors do.
"""

from __future__ import annotations

from .asyncsave import AsyncSaver
from .checkpoint import Checkpoint, import_torch_checkpoint, load, save
from .container import FLAG_FP32_FALLBACK, VERSION, Report, SectionInfo, verify
from .drift import DEFAULT_EXEMPT, KeyDiff, check_resume, diff_keys
from .errors import (
    AuditError,
    BadMagic,
    BadTensorValue,
    CheckpointError,
    CheckpointNotFound,
    ChecksumMismatch,
    ConfigDrift,
    DistributedFailure,
    EnvironmentDrift,
    FormatError,
    IncompleteCheckpoint,
    InsufficientMemory,
    LegacyCheckpoint,
    MalformedIndex,
    ReplayDivergence,
    ReplayError,
    ReplicaDivergence,
    ReservedBitSet,
    ResumeRefused,
    RunStopped,
    SaveFailed,
    SidecarMismatch,
    StateMismatch,
    StreamOffsetMismatch,
    TrainingUnstable,
    TruncatedFile,
    UnreadableFile,
    UnsupportedValue,
    UnsupportedVersion,
    WorldSizeChanged,
)
from .field_coverage import assert_field_coverage, check_field_coverage
from .history import History
from .lazy import LazyCheckpoint, open_checkpoint
from .monitor import SpikeConfig, SpikeMonitor, Verdict
from .rng import mask_stream, numpy_generator, step_rng, torch_generator
from .rollback_record import RollbackEvent, RollbackRecord
from .runstate import ResumeInfo, RunState
from .sidecar import Sidecar, read_sidecar, write_sidecar
from .snapshot import Snapshot, read_snapshot, write_snapshot
from .spikeguard import Continue, Executed, RolledBack, SpikeGuard

__version__ = "0.1.0"

__all__ = [
    "AsyncSaver",
    "AuditError",
    "BadMagic",
    "BadTensorValue",
    "Checkpoint",
    "CheckpointError",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "ConfigDrift",
    "Continue",
    "DEFAULT_EXEMPT",
    "DistributedFailure",
    "EnvironmentDrift",
    "Executed",
    "FLAG_FP32_FALLBACK",
    "FormatError",
    "History",
    "IncompleteCheckpoint",
    "InsufficientMemory",
    "KeyDiff",
    "LazyCheckpoint",
    "LegacyCheckpoint",
    "MalformedIndex",
    "ReplayDivergence",
    "ReplayError",
    "ReplicaDivergence",
    "Report",
    "ReservedBitSet",
    "ResumeInfo",
    "ResumeRefused",
    "RollbackEvent",
    "RollbackRecord",
    "RolledBack",
    "RunState",
    "RunStopped",
    "SaveFailed",
    "SectionInfo",
    "Sidecar",
    "SidecarMismatch",
    "Snapshot",
    "SpikeConfig",
    "SpikeGuard",
    "SpikeMonitor",
    "StateMismatch",
    "StreamOffsetMismatch",
    "TrainingUnstable",
    "TruncatedFile",
    "UnreadableFile",
    "UnsupportedValue",
    "UnsupportedVersion",
    "VERSION",
    "Verdict",
    "WorldSizeChanged",
    "__version__",
    "assert_field_coverage",
    "check_field_coverage",
    "check_resume",
    "diff_keys",
    "import_torch_checkpoint",
    "load",
    "mask_stream",
    "numpy_generator",
    "open_checkpoint",
    "read_sidecar",
    "read_snapshot",
    "save",
    "step_rng",
    "torch_generator",
    "verify",
    "write_sidecar",
    "write_snapshot",
]
