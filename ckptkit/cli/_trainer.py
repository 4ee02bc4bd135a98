"""``verify`` of a Hugging Face Trainer output directory and its ``checkpoint-N/`` folders (torch-free).

The folder check is :func:`ckptkit.integrations.hf_folder.check_folder`, the one a resume
uses (spec/transformers.md R-HF03); this module only finds the folders and prints.
"""

from __future__ import annotations

import os
from typing import Any

from ..integrations.hf_folder import FolderCheck, check_folder, checkpoint_folders, is_checkpoint_folder, is_output_dir

__all__ = ["check_all", "folder_json", "print_checks", "split"]


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
