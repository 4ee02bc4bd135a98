"""The public surface is pinned: changing it is a visible diff (docs/api.md)."""

from __future__ import annotations
import __future__

import importlib
import inspect
import pkgutil
import sys

import ckptkit

# The public surface, by hand: adding or removing a name is a visible diff here.
PUBLIC = [
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
    "RollbackEvent",
    "RollbackRecord",
    "RolledBack",
    "RunDirInUse",
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
    "UnsupportedOption",
    "UnsupportedValue",
    "UnsupportedVersion",
    "VERSION",
    "Verdict",
    "WorldSizeChanged",
    "__version__",
    "assert_field_coverage",
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


def test_the_public_surface_is_exactly_the_pinned_list():
    assert ckptkit.__all__ == PUBLIC
    assert sorted(PUBLIC) == PUBLIC


def test_every_public_attribute_of_the_package_is_exported():
    """Derived from the package itself (httpx's test_exported_members): a name made
    public by an import in ``__init__.py`` and left out of ``__all__`` fails here."""
    public = sorted(
        name
        for name, value in vars(ckptkit).items()
        if not name.startswith("_") and not inspect.ismodule(value) and not isinstance(value, __future__._Feature)
    )
    assert public == [name for name in ckptkit.__all__ if not name.startswith("_")]


def test_every_exception_class_is_in_the_tree_drawn_in_errors_py():
    """Every exception ckptkit defines lives in errors.py and is drawn in its docstring; the
    object store's request faults, which never reach a caller, live and are drawn in its module."""
    import ckptkit.cli
    import ckptkit.trainer

    for mod in (ckptkit, ckptkit.trainer, ckptkit.cli):
        for info in pkgutil.walk_packages(mod.__path__, mod.__name__ + "."):
            if not info.name.endswith("__main__"):
                try:
                    importlib.import_module(info.name)
                except ModuleNotFoundError as e:  # an optional extra (lightning) not installed
                    assert not (e.name or "").startswith("ckptkit"), e  # noqa: PT017 - inside a walk, not one call
    defined = {
        (obj.__module__, name)
        for m in list(sys.modules.values())
        if m is not None and m.__name__.startswith("ckptkit")
        for name, obj in vars(m).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__.startswith("ckptkit")
        and not name.startswith("_")
    }
    assert {module for module, _ in defined} == {"ckptkit.errors", "ckptkit.format.objectstore"}, sorted(defined)
    for module, name in sorted(defined):
        drawn = sys.modules[module].__doc__ or ""
        assert f" {name} (" in drawn or f"── {name}" in drawn, name


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
