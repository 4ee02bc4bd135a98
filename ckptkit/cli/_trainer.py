"""``verify``, ``inspect`` and ``diff`` of a Hugging Face Trainer output directory and its ``checkpoint-N/``
folders (torch-free).

The folder check is :func:`ckptkit.integrations.hf_folder.check_folder`, the one a resume
uses (spec/transformers.md R-HF03); this module only finds the folders and prints.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import CheckpointNotFound
from ..format._container import Source, read_layout
from ..integrations.hf_folder import (
    CONFIG_FILE,
    STATE_FILE,
    FolderCheck,
    check_folder,
    checkpoint_folders,
    is_checkpoint_folder,
    is_output_dir,
)

__all__ = ["check_all", "folder_json", "inspect", "is_trainer_path", "print_checks", "snapshot_of", "split"]


def split(paths: list[str]) -> tuple[list[str], list[str]]:
    """(the ``checkpoint-N/`` folders the paths name or hold, the other paths), folders in the order given."""
    folders, rest = [], []
    for p in paths:
        if is_checkpoint_folder(p):
            folders.append(p)
        elif is_output_dir(p):
            folders.extend(checkpoint_folders(p))
        else:
            rest.append(p)
    return folders, rest


def check_all(folders: list[str]) -> list[FolderCheck]:
    return [check_folder(f) for f in folders]


def _size(check: FolderCheck) -> int:
    return sum(int(f["size"]) for f in check.files.values()) + (check.report.size if check.report else 0)


def folder_json(check: FolderCheck) -> dict[str, Any]:
    return {
        "path": check.path,
        "kind": "transformers-checkpoint",
        "ok": check.ok,
        "step": None if check.report is None else check.report.step,
        "size": _size(check),
        "files": {name: dict(entry) for name, entry in sorted(check.files.items())},
        "problems": [{"type": type(p).__name__, "message": str(p)} for p in check.problems],
    }


def print_checks(checks: list[FolderCheck], size: Any) -> None:
    for c in checks:
        if c.ok:
            step = c.report.step if c.report else None
            print(f"OK    {c.path}  transformers checkpoint, step {step}, {len(c.files) + 1} files  {size(_size(c))}")
        for p in c.problems:
            text = str(p)
            print(f"FAIL  {text}" if text.startswith((c.path + os.sep, c.path + ":")) else f"FAIL  {c.path}: {text}")


def is_trainer_path(path: str) -> bool:
    """True for a ``checkpoint-N/`` folder or a directory holding one."""
    return is_checkpoint_folder(path) or is_output_dir(path)


def snapshot_of(path: str) -> tuple[str, str | None] | None:
    """``diff``'s (snapshot, commit) for a Trainer folder or output directory (its newest folder); None otherwise.

    Raises:
        CheckpointNotFound: the folder has no config snapshot.
    """
    if not is_trainer_path(path):
        return None
    folder = path if is_checkpoint_folder(path) else checkpoint_folders(path)[-1]
    snap = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(snap):
        raise CheckpointNotFound(f"{folder}: no {CONFIG_FILE} (not written by ckptkit.integrations.transformers)")
    state = os.path.join(folder, STATE_FILE)
    return snap, state if os.path.isfile(state) else None


def _describe(folder: str) -> dict[str, Any]:
    """What a folder's commit says, read without checking digests (``verify`` does)."""
    state = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(state):
        return {"path": folder, "committed": False, "step": None, "files": {}, "environment": {}}
    with Source(state) as src:
        layout = read_layout(src)
    monitor = layout.sections.get("monitor")
    tree = monitor.tree if monitor is not None and isinstance(monitor.tree, dict) else {}
    files, env = tree.get("files"), tree.get("environment")
    return {
        "path": folder,
        "committed": True,
        "step": layout.step,
        "commit_size": layout.size,
        "files": {k: dict(v) for k, v in sorted(files.items())} if isinstance(files, dict) else {},
        "environment": dict(env) if isinstance(env, dict) else {},
    }


def inspect(path: str, as_json: bool, size: Any) -> int:
    """``ckptkit inspect`` of a ``checkpoint-N/`` folder (its files and commit) or an output directory (each folder).

    Raises:
        FormatError: a commit whose header or indexes cannot be read.
    """
    folders = [path] if is_checkpoint_folder(path) else checkpoint_folders(path)
    entries = [_describe(f) for f in folders]
    if as_json:
        print(json.dumps({"schema_version": 1, "kind": "transformers", "checkpoints": entries}, sort_keys=True))
        return 0
    for e in entries:
        if not e["committed"]:
            print(f"{e['path']}: transformers checkpoint, torn (no {STATE_FILE})")
            continue
        print(f"{e['path']}: transformers checkpoint, step {e['step']}, commit {STATE_FILE} {size(e['commit_size'])}")
        for name, f in e["files"].items():
            print(f"  {name:<28} {f['size']:>12}  xxh3 0x{f['xxh3']:016x}")
        env = e["environment"]
        print(
            f"  environment: torch {env.get('torch')}, transformers {env.get('transformers')}, "
            f"{env.get('intra_op_threads')} threads"
        )
    print("digests: not checked here (ckptkit verify checks every byte)")
    return 0
