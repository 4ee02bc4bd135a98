"""No file of the project names a path of one particular machine.

A path like a developer's home or a build machine's work folder works on that machine
only; docs, spec and code that cite it break for everyone else. This greps every file
git tracks (text files; binary fixtures are bytes, not prose).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Built from parts so that this file does not match itself.
_ROOTS = ["work", "root", "home", "Users", "opt", "mnt", "srv", "scratch"]
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:" + "|".join(_ROOTS) + r")/[\w.-]+" + r"|\b[A-Z]:" + r"\\[\w]")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_names_a_machine_path() -> None:
    found = []
    for path in _tracked():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert found == [], "machine paths:\n" + "\n".join(found)


def test_the_pattern_finds_a_machine_path() -> None:
    """The rule can fail: the paths it is for match, a project-relative one does not."""
    for line in ["see /" + "work/shared/seeds/x.txt", "(/" + "home/ana/ckpt)", "C:" + "\\Users\\x"]:
        assert MACHINE_PATH.search(line), line
    for line in ["runs/a/step-00000100.ckpt", "../shared/seeds/x.txt", "s3://bucket/opt/x", "~/runs/x"]:
        assert not MACHINE_PATH.search(line), line
