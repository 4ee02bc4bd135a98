"""Paths that hold no readable file: a ckptkit error naming the path, never a bare OSError
(spec/guarantees.md G-01). ``verify`` reports them (``ok=False``), ``ckptkit verify``
prints one FAIL line and exits 1, ``load`` and ``ckptkit inspect`` raise / exit 2 with one
line; nothing at all at the path is ``CheckpointNotFound``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from _run_dir import as_reader

import ckptkit
from ckptkit import CheckpointNotFound, UnreadableFile
from ckptkit.cli import main


def _loop(tmp_path: Path) -> Path:
    loop = tmp_path / "step-00000001.ckpt"
    os.symlink(loop, loop)
    return loop


def _fifo(tmp_path: Path) -> Path:
    fifo = tmp_path / "step-00000002.ckpt"
    os.mkfifo(fifo)
    return fifo


CASES = {
    "symlink loop": (_loop, "cannot open the checkpoint file (ELOOP: Too many levels of symbolic links)"),
    "FIFO": (_fifo, "is a FIFO (named pipe), not a checkpoint file (a checkpoint is a regular file)"),
    "directory": (lambda tmp: tmp, "is a directory, not a checkpoint file (a checkpoint is a regular file)"),
    "/dev/zero": (
        lambda tmp: Path("/dev/zero"),
        "is a character device, not a checkpoint file (a checkpoint is a regular file)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_reports_a_path_that_is_no_readable_file_as_not_ok(tmp_path: Path, case: str) -> None:
    make, problem = CASES[case]
    path = make(tmp_path)
    report = ckptkit.verify(path)
    assert not report.ok and isinstance(report.error, UnreadableFile)
    assert str(report.error) == f"{path}: {problem}"
    assert (report.version, report.step, report.size, report.sections) == (None, None, 0, ())


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_and_the_lazy_reader_raise_unreadable_file_naming_the_path(tmp_path: Path, case: str) -> None:
    make, problem = CASES[case]
    path = make(tmp_path)
    for reader in (ckptkit.load, ckptkit.open_checkpoint):
        with pytest.raises(UnreadableFile) as info:
            reader(path)
        assert str(info.value) == f"{path}: {problem}"
        assert isinstance(info.value, OSError) and isinstance(info.value, ckptkit.CheckpointError)


@pytest.mark.parametrize("case", ["symlink loop", "FIFO", "/dev/zero"])
def test_cli_verify_prints_one_fail_line_and_exits_1(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make, problem = CASES[case]
    path = make(tmp_path)
    assert main(["verify", str(path)]) == 1
    assert capsys.readouterr() == (f"FAIL  {path}: {problem}\n", "")


def test_cli_inspect_of_a_symlink_loop_says_so_in_one_line_and_exits_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _loop(tmp_path)
    assert main(["inspect", str(path)]) == 2
    assert capsys.readouterr() == ("", f"ckptkit inspect: {path}: {CASES['symlink loop'][1]}\n")


def test_nothing_at_the_path_is_checkpoint_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match=r"missing\.ckpt: no such checkpoint file$"):
        ckptkit.verify(tmp_path / "missing.ckpt")
    dangling = tmp_path / "dangling.ckpt"
    os.symlink(tmp_path / "gone.ckpt", dangling)
    with pytest.raises(CheckpointNotFound, match=r"dangling\.ckpt: no such checkpoint file$"):
        ckptkit.load(dangling)


def test_verify_of_a_file_in_a_directory_that_cannot_be_searched_says_eacces_not_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file exists: ``verify`` reports what ``inspect`` says, never "no such file or directory"."""
    top = Path(tempfile.mkdtemp(prefix="ckptkit-locked-"))  # tmp_path's parents are closed to nobody
    try:
        top.chmod(0o755)
        (top / "locked").mkdir(mode=0o700)
        path = top / "locked" / "a.ckpt"
        ckptkit.save(path, ckptkit.Checkpoint(step=1, model={"w": torch.ones(2)}))
        (top / "locked").chmod(0o600)  # readable, not searchable: the file cannot be looked up
        with as_reader(nobody=True):
            if os.access(path.parent, os.X_OK, effective_ids=True):
                pytest.skip("this user may search any directory")
            assert main(["verify", str(path)]) == 1
            assert main(["inspect", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == f"FAIL  {path}: cannot open the checkpoint file (EACCES: Permission denied)\n"
        assert err == f"ckptkit inspect: {path}: cannot open the checkpoint file (EACCES: Permission denied)\n"
    finally:
        (top / "locked").chmod(0o700)
        shutil.rmtree(top)
