"""ckptkit: trustworthy PyTorch checkpoints. A resume is the same run, or a hard error.

The supported surface is what ``__all__`` lists here and on each face: the floors'
``__init__`` (``ckptkit.format``, ``distributed``, ``run``, ``guard``, ``audit``,
``trainer``), ``ckptkit.testing`` and each ``ckptkit.integrations.<name>``. Every other
module is ``_private`` and may change without notice (a test pins the faces; ``docs/api.md``).

    import ckptkit
    ckptkit.save("run/step-00000100.ckpt", ckptkit.Checkpoint(step=100, model={"net": net.state_dict()}))
    report = ckptkit.verify("run/step-00000100.ckpt")
    ckpt = ckptkit.load("run/step-00000100.ckpt")

Importing ckptkit does not import torch; the functions that build tensors do.
"""

from __future__ import annotations

from .errors import (
    AuditError,
    BadMagic,
    BadTensorValue,
    CheckpointError,
    CheckpointNotFound,
    ChecksumMismatch,
    CommitConflict,
    ConfigDrift,
    DistributedFailure,
    EnvironmentDrift,
    FormatError,
    IncompleteCheckpoint,
    InsufficientMemory,
    LeaseLost,
    LegacyCheckpoint,
    MalformedIndex,
    NoConsistentCheckpoint,
    ReplayDivergence,
    ReplayError,
    ReplicaDivergence,
    ReservedBitSet,
    ResumeRefused,
    RunDirInUse,
    RunStopped,
    SaveFailed,
    SidecarMismatch,
    StateMismatch,
    StreamOffsetMismatch,
    TrainingUnstable,
    TruncatedFile,
    UnreadableFile,
    UnsupportedOption,
    UnsupportedValue,
    UnsupportedVersion,
    WorldSizeChanged,
)
from .format import (
    VERSION,
    AsyncSaver,
    Checkpoint,
    LazyCheckpoint,
    Report,
    import_torch_checkpoint,
    load,
    open_checkpoint,
    save,
    verify,
)
from .guard import RollbackConfig, SpikeConfig, SpikeGuard
from .run import (
    ResumeInfo,
    RunState,
    assert_field_coverage,
    numpy_generator,
    step_rng,
    torch_generator,
)

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
    "CommitConflict",
    "ConfigDrift",
    "DistributedFailure",
    "EnvironmentDrift",
    "FormatError",
    "IncompleteCheckpoint",
    "InsufficientMemory",
    "LazyCheckpoint",
    "LeaseLost",
    "LegacyCheckpoint",
    "MalformedIndex",
    "NoConsistentCheckpoint",
    "ReplayDivergence",
    "ReplayError",
    "ReplicaDivergence",
    "Report",
    "ReservedBitSet",
    "ResumeInfo",
    "ResumeRefused",
    "RollbackConfig",
    "RunDirInUse",
    "RunState",
    "RunStopped",
    "SaveFailed",
    "SidecarMismatch",
    "SpikeConfig",
    "SpikeGuard",
    "StateMismatch",
    "StreamOffsetMismatch",
    "TrainingUnstable",
    "TruncatedFile",
    "UnreadableFile",
    "UnsupportedOption",
    "UnsupportedValue",
    "UnsupportedVersion",
    "VERSION",
    "WorldSizeChanged",
    "__version__",
    "assert_field_coverage",
    "import_torch_checkpoint",
    "load",
    "numpy_generator",
    "open_checkpoint",
    "save",
    "step_rng",
    "torch_generator",
    "verify",
]
