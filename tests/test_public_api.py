"""The public surface is pinned: changing it is a visible diff (docs/api.md)."""

from __future__ import annotations

import inspect

import ckptkit

PUBLIC = [
    "AsyncSaver", "AuditError", "BadMagic", "BadTensorValue", "Checkpoint", "CheckpointError", "CheckpointNotFound", "ChecksumMismatch",
    "ConfigDrift", "Continue", "DEFAULT_EXEMPT", "DistributedFailure", "EnvironmentDrift", "Executed", "FLAG_FP32_FALLBACK", "FormatError", "History",
    "IncompleteCheckpoint", "InsufficientMemory", "KeyDiff", "LazyCheckpoint", "LegacyCheckpoint", "MalformedIndex", "ReplayDivergence", "ReplayError", "Report",
    "ReservedBitSet", "ResumeInfo", "ResumeRefused", "RollbackEvent", "RollbackRecord", "RolledBack", "RunState",
    "SaveFailed", "SectionInfo", "Sidecar", "SidecarMismatch", "Snapshot", "SpikeConfig", "SpikeGuard", "SpikeMonitor",
    "StateMismatch", "StreamOffsetMismatch", "TrainingUnstable", "TruncatedFile", "UnreadableFile", "UnsupportedValue", "UnsupportedVersion",
    "VERSION", "Verdict", "__version__", "assert_field_coverage", "check_field_coverage", "check_resume",
    "diff_keys", "import_torch_checkpoint", "load", "mask_stream", "numpy_generator", "open_checkpoint", "read_sidecar", "read_snapshot", "save", "step_rng",
    "torch_generator", "verify", "write_sidecar", "write_snapshot",
]


def test_the_public_surface_is_exactly_the_pinned_list():
    assert ckptkit.__all__ == sorted(PUBLIC)
    for name in PUBLIC:
        assert hasattr(ckptkit, name), name


def test_every_public_name_has_a_docstring():
    for name in PUBLIC:
        obj = getattr(ckptkit, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), name


def test_every_error_is_a_checkpoint_error_and_the_builtin_a_caller_would_catch():
    assert issubclass(ckptkit.FormatError, ValueError)
    assert issubclass(ckptkit.CheckpointNotFound, FileNotFoundError)
    assert issubclass(ckptkit.SaveFailed, OSError)
    assert issubclass(ckptkit.UnsupportedValue, TypeError)
    for name in PUBLIC:
        obj = getattr(ckptkit, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, ckptkit.CheckpointError), name
