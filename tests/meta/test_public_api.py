"""The public surface is pinned: changing it is a visible diff (docs/api.md)."""

from __future__ import annotations
import __future__

import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

import pytest

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
    assert {module for module, _ in defined} == {"ckptkit.errors", "ckptkit.format._objectstore"}, sorted(defined)
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


# Each floor's face, by hand: the public path to what the floor offers (docs/api.md).
FACES = {
    "ckptkit.format": [
        "AsyncSaver",
        "Checkpoint",
        "FLAG_FP32_FALLBACK",
        "LazyCheckpoint",
        "Report",
        "SectionInfo",
        "Sidecar",
        "Snapshot",
        "VERSION",
        "import_torch_checkpoint",
        "load",
        "open_checkpoint",
        "read_sidecar",
        "read_snapshot",
        "save",
        "verify",
        "write_sidecar",
        "write_snapshot",
    ],
    "ckptkit.distributed": ["AsyncSaver", "LoadPlanner", "Reader", "Writer", "load", "save", "verify_directory"],
    "ckptkit.run": [
        "CKPT_SUFFIX",
        "DCP_SUFFIX",
        "DEFAULT_EXEMPT",
        "ENVIRONMENT_FILE",
        "FINGERPRINT_FIELDS",
        "History",
        "HistoryCheck",
        "KeyDiff",
        "Lease",
        "ResumeInfo",
        "RunState",
        "Stream",
        "assert_field_coverage",
        "check_history",
        "check_resume",
        "checkpoint_digests",
        "checkpoint_name",
        "combine",
        "compared_rows",
        "diff_keys",
        "differing_names",
        "draw",
        "float_bits",
        "kept_rows",
        "leaf_digest",
        "leaf_digests",
        "lease_for",
        "list_checkpoints",
        "mask_stream",
        "numpy_generator",
        "randint",
        "read_environment",
        "read_rows",
        "sample_depth",
        "state_digest",
        "step_rng",
        "step_rows",
        "tensor_digest",
        "torch_generator",
        "uniform",
        "uniforms",
    ],
    "ckptkit.guard": [
        "Continue",
        "Executed",
        "GradSpike",
        "Outcome",
        "RollbackConfig",
        "RollbackEvent",
        "RollbackRecord",
        "RolledBack",
        "SpikeConfig",
        "SpikeGuard",
        "SpikeMonitor",
        "Verdict",
        "skipped_batches",
    ],
    "ckptkit.audit": [
        "AuditPlan",
        "AuditReport",
        "Difference",
        "PlotSummary",
        "ReplayPlan",
        "RunRecording",
        "RunSeries",
        "TensorDiff",
        "audit_command",
        "audit_crashes",
        "compare_checkpoints",
        "compare_states",
        "first_difference",
        "first_divergence_in_files",
        "first_row_difference",
        "plot_run",
        "read_series",
        "render",
        "replay_command",
        "spike_config_of",
    ],
    "ckptkit.trainer": [
        "DataConfig",
        "ModelConfig",
        "StepResult",
        "TestingAids",
        "TrainConfig",
        "TrainResult",
        "TrainerConfig",
        "train",
        "train_step",
    ],
    "ckptkit.testing": [
        "GradSpike",
        "Run",
        "assert_command_resumes",
        "assert_resume_equivalent",
        "assert_step_leaves_global_rng_alone",
        "interruptions",
    ],
}
# The integrations: each module is a face of its own (its extra is optional; docs/api.md).
INTEGRATION_FACES = {"hf_folder", "hf_import", "lightning", "lightning_file", "torchtitan", "transformers"}
PACKAGE = Path(ckptkit.__file__).parent


def test_the_top_level_keeps_what_a_user_of_the_format_and_of_runstate_reaches_for():
    assert len(PUBLIC) <= 60


@pytest.mark.parametrize("face", sorted(FACES))
def test_each_face_exports_exactly_its_pinned_names(face: str) -> None:
    module = importlib.import_module(face)
    assert sorted(module.__all__) == sorted(FACES[face])
    if hasattr(module, "__path__"):  # a folder's face holds nothing but its exports
        public = {n for n, v in vars(module).items() if not n.startswith("_") and not inspect.ismodule(v)}
        public -= {"annotations", "Any"}  # the lazy face's own helpers (ckptkit.distributed), not exports
        assert public <= set(module.__all__), sorted(public - set(module.__all__))
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{face}.{name}"


def test_the_cli_is_no_import_surface_but_its_entry_point():
    import ckptkit.cli

    assert ckptkit.cli.__all__ == ["main"]


def test_every_module_inside_a_floor_is_private_and_the_faces_are_the_public_paths():
    """The httpx rule: implementation modules are ``_private``; a user reaches a floor through
    its ``__init__`` (and an integration through its own module)."""
    public = sorted(
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.glob("*/*.py")
        if not p.stem.startswith("_") and not (p.parent.name == "integrations" and p.stem in INTEGRATION_FACES)
    )
    assert public == []
    assert {p.stem for p in (PACKAGE / "integrations").glob("[!_]*.py")} == INTEGRATION_FACES


def test_the_docs_and_examples_reach_ckptkit_through_its_faces_only():
    """What a user copies never names a private room (``ckptkit.run._state``, ``from ckptkit.format._io``)."""
    root = PACKAGE.parent
    private = re.compile(r"ckptkit(?:\.\w+)*\._[a-z]\w*")
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in [
            root / "README.md",
            *sorted((root / "docs").glob("*.md")),
            *sorted((root / "examples").glob("*.py")),
        ]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == [], "\n".join(found)
