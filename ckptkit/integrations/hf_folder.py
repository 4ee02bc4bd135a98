"""A Hugging Face ``Trainer`` checkpoint folder committed by ckptkit (spec/transformers.md), torch-free.

``checkpoint-N/`` holds what ``Trainer`` writes (the weights as safetensors, the model
config, ``trainer_state.json``) plus ckptkit's config snapshot, and is committed by one
file written last and atomically: ``ckptkit-state.ckpt``, a v2 container holding the
optimizer, scheduler, scaler and RNG states, the environment and the **file record**,
the size and xxh3-64 of every other file in the folder (R-HF02). A folder is intact
when that container verifies and every file matches the record, no more and no less
(R-HF03); a folder without the container is torn (a save that did not finish) and is
never resumed. ``ckptkit verify`` and a resume use the same check, :func:`check_folder`.

This module imports no torch, so ``ckptkit verify`` checks a Trainer run in milliseconds
without transformers installed; the Trainer itself is :mod:`ckptkit.integrations.transformers`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import xxhash

from ..errors import CheckpointError, CheckpointNotFound, ChecksumMismatch, FormatError, IncompleteCheckpoint
from ..format._container import Source, read_layout
from ..format._place import list_run_dir
from ..format._verify import Report, verify
from ..run._drift import DEFAULT_EXEMPT
from ..run._files import TRAINER_COMMIT

__all__ = [
    "CONFIG_FILE",
    "CONFIG_TYPE",
    "EXEMPT",
    "LAYOUT",
    "STATE_FILE",
    "FolderCheck",
    "checkpoint_folders",
    "file_record",
    "check_folder",
    "folder_step",
    "is_checkpoint_folder",
    "is_output_dir",
    "newest_intact",
]

#: The container's monitor ``layout``; another value is refused (R-HF02).
LAYOUT = "ckptkit.integrations.transformers/2"
#: The commit: the container written last, atomically (R-HF02); the run floor lists folders by it.
STATE_FILE = TRAINER_COMMIT
#: The run's config snapshot (spec/snapshot.md), one per checkpoint (R-HF04).
CONFIG_FILE = "ckptkit.config.json"
#: What the config snapshot says it holds (``config_type``, informational).
CONFIG_TYPE = "ckptkit.integrations.transformers:{args: TrainingArguments, model: model.config}"
#: Keys that may change on a resume: they decide when we look or where files go, never what a step
#: computes (the design record's rule, spec/snapshot.md R-S08). ``transformers_version`` is the
#: environment's business (it is compared there); ``_name_or_path`` is where ``from_pretrained`` read
#: the model config from (R-HF04).
EXEMPT: frozenset[str] = DEFAULT_EXEMPT | {
    "max_steps",
    "num_train_epochs",
    "save_steps",
    "save_strategy",
    "save_total_limit",
    "logging_steps",
    "logging_strategy",
    "logging_first_step",
    "eval_steps",
    "output_dir",
    "logging_dir",
    "run_name",
    "report_to",
    "resume_from_checkpoint",
    "transformers_version",
    "_name_or_path",
}
_FOLDER_RE = re.compile(r"^checkpoint-(\d+)$")  # Trainer's PREFIX_CHECKPOINT_DIR-<global step>
_SCRATCH = 1 << 20


def folder_step(path: str) -> int | None:
    """The step in a ``checkpoint-N`` folder's name, or None for another name."""
    m = _FOLDER_RE.match(os.path.basename(os.path.normpath(path)))
    return None if m is None else int(m.group(1))


def is_checkpoint_folder(path: str) -> bool:
    """True for a directory named ``checkpoint-N``: a Trainer checkpoint, committed or torn."""
    return folder_step(path) is not None and os.path.isdir(path)


def checkpoint_folders(output_dir: str) -> list[str]:
    """The ``checkpoint-N/`` folders of a Trainer output directory, oldest step first."""
    found = [os.path.join(output_dir, n) for n in list_run_dir(output_dir)]
    return sorted((p for p in found if is_checkpoint_folder(p)), key=lambda p: folder_step(p) or 0)


def is_output_dir(path: str) -> bool:
    """True for a directory holding at least one ``checkpoint-N/`` folder (a Trainer ``output_dir``)."""
    return os.path.isdir(path) and bool(checkpoint_folders(path))


def _files(folder: str) -> Iterator[str]:
    """Every file under ``folder`` but the commit, as a ``/``-separated relative path, sorted."""
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel != STATE_FILE and not name.startswith(f".{STATE_FILE}.tmp."):
                yield rel


def _digest(path: str) -> tuple[int, int]:
    """(size, xxh3-64) of a file of any size, read in bounded memory."""
    h = xxhash.xxh3_64()
    with Source(path, kind="checkpoint file") as src:
        src.feed(0, src.size, h.update, bytearray(_SCRATCH))
        return src.size, h.intdigest()


def file_record(folder: str, *, durable: bool = False) -> dict[str, dict[str, int]]:
    """The file record of ``folder``: ``{relative path: {"size": bytes, "xxh3": digest}}`` (R-HF02).

    Args:
        folder: a ``checkpoint-N/`` folder.
        durable: fsync each file first (the writer does, so the commit never outlives its files).

    Raises:
        CheckpointNotFound, UnreadableFile: a file vanished or is not a regular file.
    """
    out = {}
    for rel in _files(folder):
        path = os.path.join(folder, rel)
        if durable:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        size, digest = _digest(path)
        out[rel] = {"size": size, "xxh3": digest}
    return out


@dataclasses.dataclass(frozen=True)
class FolderCheck:
    """The verdict on one ``checkpoint-N/`` folder.

    Attributes:
        path: the folder.
        report: :func:`~ckptkit.format.verify`'s report on the commit, or None when absent.
        files: the record's files (relative path -> size and digest); empty when it cannot be read.
        problems: every problem found, as ckptkit errors; empty when the folder is intact.
    """

    path: str
    report: Report | None
    files: Mapping[str, Any]
    problems: tuple[CheckpointError, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def _record(path: str, step: int | None) -> dict[str, Any]:
    """The file record of a container that verified, once its layout and step are this module's."""
    with Source(path) as src:
        layout = read_layout(src)
    monitor = layout.sections.get("monitor")
    tree = monitor.tree if monitor is not None and isinstance(monitor.tree, dict) else {}
    got = tree.get("layout")
    if got != LAYOUT:
        raise FormatError(
            "not a Trainer checkpoint committed by ckptkit.integrations.transformers",
            path=path,
            field="monitor.layout",
            expected=LAYOUT,
            actual=got or "none",
            hint="R-HF02",
        )
    files = tree.get("files")
    if not isinstance(files, dict) or not all(_is_entry(k, v) for k, v in files.items()):
        raise FormatError(
            "the file record is not a map of paths to sizes and digests", path=path, field="monitor.files"
        )
    if step is not None and layout.step != step:
        raise FormatError(
            "the folder's name and its commit disagree on the step",
            path=path,
            field="step",
            expected=step,
            actual=layout.step,
            hint="the folder was renamed or its commit swapped for another checkpoint's; resume from another (R-HF03)",
        )
    return files


def _is_entry(key: Any, value: Any) -> bool:
    return isinstance(key, str) and isinstance(value, dict) and set(value) == {"size", "xxh3"}


def _file_problem(folder: str, rel: str, want: Mapping[str, int] | None) -> CheckpointError | None:
    path = os.path.join(folder, rel)
    if want is None:
        return FormatError(
            f"not in the file record of {STATE_FILE}",
            path=path,
            hint="the file was added after the commit; a resume does not trust it: remove it (R-HF03)",
        )
    if not os.path.lexists(path):
        return CheckpointNotFound(f"{path}: missing (recorded in {STATE_FILE}); resume from another checkpoint")
    try:
        size, digest = _digest(path)
    except CheckpointError as e:
        return e
    if (size, digest) != (want["size"], want["xxh3"]):
        return ChecksumMismatch(
            f"damaged: its size and xxh3-64 do not match the record in {STATE_FILE}",
            path=path,
            expected=f"{want['size']} bytes, 0x{want['xxh3']:016x}",
            actual=f"{size} bytes, 0x{digest:016x}",
            hint="the file was edited or damaged after the commit; resume from an earlier checkpoint (R-HF03)",
        )
    return None


def check_folder(folder: str) -> FolderCheck:
    """Check a ``checkpoint-N/`` folder: the commit, then every file against its record (R-HF03).

    Args:
        folder: the folder.

    Returns:
        A :class:`FolderCheck` listing every problem (a torn folder, a container that
        fails to verify, a damaged, missing or unrecorded file, a step that disagrees).

    Raises:
        CheckpointNotFound: ``folder`` is not a directory.
    """
    if not os.path.isdir(folder):
        raise CheckpointNotFound(f"{folder}: no such checkpoint folder")
    state = os.path.join(folder, STATE_FILE)
    if not os.path.exists(state):
        torn = IncompleteCheckpoint(
            f"{folder}: torn: no {STATE_FILE} (the save did not commit, or the folder was not written by "
            "ckptkit.integrations.transformers); a resume skips it (R-HF03)"
        )
        return FolderCheck(folder, None, {}, (torn,))
    report = verify(state)
    if report.error is not None:
        return FolderCheck(folder, report, {}, (report.error,))
    try:
        files = _record(state, folder_step(folder))
    except CheckpointError as e:
        return FolderCheck(folder, report, {}, (e,))
    names = sorted(set(files) | set(_files(folder)))
    problems = tuple(p for rel in names if (p := _file_problem(folder, rel, files.get(rel))) is not None)
    return FolderCheck(folder, report, files, problems)


def newest_intact(output_dir: str) -> tuple[str | None, list[FolderCheck]]:
    """The newest intact ``checkpoint-N/`` of ``output_dir``, and the newer ones skipped (R-HF05).

    Returns:
        ``(folder, skipped)``: the newest folder with no problem (None when there is
        none) and the :class:`FolderCheck` of each newer folder that failed, newest first.
    """
    skipped: list[FolderCheck] = []
    for folder in reversed(checkpoint_folders(output_dir)):
        check = check_folder(folder)
        if check.ok:
            return folder, skipped
        skipped.append(check)
    return None, skipped
