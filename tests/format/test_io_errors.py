"""Full disks and I/O errors: a failed save says so, leaves no temp file, loses nothing.

Faults are injected by a wrapper that fails the n-th matching operation
(temp-file create, write, pwrite, fsync, rename, directory fsync, unlink) with a
chosen errno, matched by the file it touches; a real ``ENOSPC`` comes from a
small tmpfs when this process may mount one (root on Linux), and is skipped
otherwise (spec/guarantees.md, "Failed saves").
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

import ckptkit
from ckptkit.errors import CheckpointError, SaveFailed
from ckptkit.format import _atomic as atomic
from ckptkit.format._checkpoint import Checkpoint, save
from ckptkit.format._sidecar import verify_sidecar
from ckptkit.run import RunState, list_checkpoints
from ckptkit.run._lease import LEASE_FILE


class Faults:
    """Fail the ``nth`` call of ``op`` whose target path matches the regex ``match`` with ``err``.

    ops: ``create`` (the temp file's open), ``write`` (os.write and buffered
    writes through the temp file), ``pwrite``, ``fsync`` (a file), ``dirsync``
    (fsync of a directory), ``replace``, ``unlink``.
    """

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, op: str, err: int, match: str = "", nth: int = 1, every: bool = False
    ) -> None:
        self.op, self.err, self.match, self.nth, self.every = op, err, match, nth, every
        self.seen = 0
        self.fired = 0
        real_write, real_pwrite, real_fsync = os.write, os.pwrite, os.fsync
        real_replace, real_unlink, real_open = os.replace, os.unlink, builtins.open
        faults = self

        def hit(op: str, target: str) -> None:
            if op != faults.op or not re.search(faults.match, target):
                return
            faults.seen += 1
            if faults.seen == faults.nth or (faults.every and faults.seen > faults.nth):
                faults.fired += 1
                raise OSError(faults.err, os.strerror(faults.err), target)

        def fd_target(fd: int) -> str:
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return ""

        def write(fd, data):
            hit("write", fd_target(fd))
            return real_write(fd, data)

        def pwrite(fd, data, offset):
            hit("pwrite", fd_target(fd))
            return real_pwrite(fd, data, offset)

        def fsync(fd):
            target = fd_target(fd)
            hit("dirsync" if os.path.isdir(target) else "fsync", target)
            return real_fsync(fd)

        def replace(src, dst, **kw):
            hit("replace", os.fspath(dst))
            return real_replace(src, dst, **kw)

        def unlink(path, **kw):
            hit("unlink", os.fspath(path))
            return real_unlink(path, **kw)

        class File:
            """A temp file whose buffered writes and flushes can fail like os.write."""

            def __init__(self, f):
                self._f = f

            def write(self, data):
                hit("write", self._f.name)
                return self._f.write(data)

            def flush(self):
                if self._f.writable():
                    hit("write", self._f.name)
                return self._f.flush()

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        def open_(file, mode="r", *a, **kw):
            if "x" in mode or "w" in mode:
                hit("create", os.fspath(file))
                return File(real_open(file, mode, *a, **kw))
            return real_open(file, mode, *a, **kw)

        for mod, name, fn in (
            (os, "write", write),
            (os, "pwrite", pwrite),
            (os, "fsync", fsync),
            (os, "replace", replace),
            (os, "unlink", unlink),
        ):
            monkeypatch.setattr(mod, name, fn)
        monkeypatch.setattr(atomic, "open", open_, raising=False)


def _state(step: int) -> Checkpoint:
    g = torch.Generator().manual_seed(step)
    return Checkpoint(
        step=step,
        model={"w": torch.randn(3000, generator=g), "b": torch.randn(7, generator=g)},
        optim={"lr": 0.1 * step},
        monitor={"data": {"train": step}},
    )


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _temps(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".tmp." in n)


# ------------------------------------------------------------------ ckptkit.save

SAVE_FAULTS = [
    ("create", errno.EACCES, 1),
    ("create", errno.EMFILE, 1),
    ("write", errno.ENOSPC, 1),
    ("write", errno.ENOSPC, 3),
    ("write", errno.EIO, 2),
    ("write", errno.EDQUOT, 4),
    ("pwrite", errno.EIO, 1),
    ("pwrite", errno.ENOSPC, 2),
    ("fsync", errno.EIO, 1),
    ("fsync", errno.ENOSPC, 1),
    ("replace", errno.EACCES, 1),
    ("replace", errno.EXDEV, 1),
    ("replace", errno.EROFS, 1),
]


@pytest.mark.parametrize(
    ("op", "err", "nth"), SAVE_FAULTS, ids=[f"{o}-{errno.errorcode[e]}-{n}" for o, e, n in SAVE_FAULTS]
)
def test_a_failed_save_raises_save_failed_keeps_the_old_file_and_no_temp(tmp_path, monkeypatch, op, err, nth):
    path = tmp_path / "x.ckpt"
    save(path, _state(1))
    before = path.read_bytes()
    faults = Faults(monkeypatch, op, err, match=re.escape(str(tmp_path)), nth=nth)
    with pytest.raises(SaveFailed) as e:
        save(path, _state(2))
    monkeypatch.undo()
    assert faults.fired == 1
    assert isinstance(e.value, OSError) and isinstance(e.value, CheckpointError)
    assert e.value.errno == err
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and os.strerror(err) in msg and "\n" not in msg, msg
    assert path.read_bytes() == before
    assert _temps(tmp_path) == []
    assert ckptkit.load(path).step == 1


def test_a_failed_first_save_leaves_nothing_at_all(tmp_path, monkeypatch):
    Faults(monkeypatch, "write", errno.ENOSPC, match=re.escape(str(tmp_path)), nth=2)
    with pytest.raises(SaveFailed):
        save(tmp_path / "x.ckpt", _state(1))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_a_directory_fsync_failure_after_the_rename_leaves_a_whole_file_either_way(tmp_path, monkeypatch, err):
    """After the rename the old file is gone: SaveFailed then means "not known to be
    durable", and what the path holds is the old file or the new one, whole."""
    path = tmp_path / "x.ckpt"
    save(path, _state(1))
    Faults(monkeypatch, "dirsync", err, match=re.escape(str(tmp_path)))
    with pytest.raises(SaveFailed) as e:
        save(path, _state(2))
    monkeypatch.undo()
    assert e.value.errno == err and str(path) in str(e.value)
    assert ckptkit.verify(path).ok and ckptkit.load(path).step in (1, 2)
    assert _temps(tmp_path) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_an_interrupt_mid_write_removes_the_temp_and_propagates(tmp_path, monkeypatch, exc):
    path = tmp_path / "x.ckpt"
    save(path, _state(1))
    before = path.read_bytes()
    real = os.write
    n = {"calls": 0}

    def write(fd, data):
        n["calls"] += 1
        if n["calls"] == 3:
            raise exc()
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(exc):
        save(path, _state(2))
    monkeypatch.undo()
    assert path.read_bytes() == before and _temps(tmp_path) == []


def test_write_bytes_atomic_reports_a_full_disk_at_flush(tmp_path, monkeypatch):
    path = tmp_path / "e.json"
    atomic.write_bytes_atomic(path, b"old\n")
    Faults(monkeypatch, "write", errno.ENOSPC, match=re.escape(str(tmp_path)))
    with pytest.raises(SaveFailed) as e:
        atomic.write_bytes_atomic(path, b"new\n" * 1000)
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC and "ENOSPC" in str(e.value)
    assert path.read_bytes() == b"old\n" and _temps(tmp_path) == []


# ------------------------------------------------------------------ RunState.save


@dataclasses.dataclass(frozen=True)
class Cfg:
    lr: float = 0.1  # learning rate
    steps: int = 100  # total steps


class Tiny:
    def __init__(self, run_dir, keep: int = 2, width: int = 64) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Linear(width, width)
        self.table = torch.zeros(8, dtype=torch.int64)
        self.table_step = 0
        self.rs = RunState(run_dir, config=Cfg(), keep=keep)
        self.rs.add_model("net", self.net)
        self.rs.add_sidecar("ngram", get=lambda: (self.table_step, {"t": self.table.clone()}), set=self._set)

    def _set(self, table_step, tree) -> None:
        self.table_step, self.table = table_step, tree["t"].clone()

    def step(self, s: int) -> None:
        with torch.no_grad():
            self.net.weight.add_(s)
        self.table[s % 8] += 1
        self.table_step = s


def _snapshot_dir(d) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


RUNSTATE_FAULTS = [
    (part, op, err)
    for part in ("snapshot", "sidecar", "container")
    for op, err in (("create", errno.EACCES), ("write", errno.ENOSPC), ("fsync", errno.EIO), ("replace", errno.EIO))
] + [("sidecar", "pwrite", errno.EIO), ("container", "pwrite", errno.ENOSPC)]
_NAME = {
    "snapshot": "step-00000003.ckpt.config.json",
    "sidecar": "step-00000003.ckpt.ngram",
    "container": "step-00000003.ckpt",
}


@pytest.mark.parametrize(
    ("part", "op", "err"), RUNSTATE_FAULTS, ids=[f"{p}-{o}-{errno.errorcode[e]}" for p, o, e in RUNSTATE_FAULTS]
)
def test_a_failed_runstate_save_keeps_every_retained_checkpoint(tmp_path, monkeypatch, part, op, err):
    run = Tiny(tmp_path / "run")
    run.rs.start()
    for s in (1, 2):
        run.step(s)
        run.rs.save(s)
    before = _snapshot_dir(tmp_path / "run")
    run.step(3)
    # the step-3 file of this part: its temp for create/write/pwrite/fsync, its final name for replace
    name = re.escape(_NAME[part])
    match = f"/{name}$" if op == "replace" else rf"/\.{name}\.tmp\."
    faults = Faults(monkeypatch, op, err, match=match)
    with pytest.raises(SaveFailed) as e:
        run.rs.save(3)
    monkeypatch.undo()
    assert faults.fired == 1 and e.value.errno == err
    assert "step-00000003" in str(e.value) and "\n" not in str(e.value)
    after = _snapshot_dir(tmp_path / "run")
    assert _temps(tmp_path / "run") == []
    for name, data in before.items():  # the retention set and its companions, byte for byte
        if name != LEASE_FILE:  # the lease's heartbeat is renewed before a save writes anything (R-LS06)
            assert after.get(name) == data, f"{name} changed by a failed save"
    assert "step-00000003.ckpt" not in after  # the container is what marks a save complete
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [1, 2]
    again = Tiny(tmp_path / "run")
    assert again.rs.resume().step == 2
    # and once the disk recovers, the run carries on from there
    again.step(3)
    again.rs.save(3)
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2, 3]
    verify_sidecar(tmp_path / "run" / "step-00000003.ckpt.ngram", expect_step=3)


@pytest.mark.parametrize("err", [errno.EACCES, errno.EIO, errno.EBUSY])
def test_a_retention_failure_does_not_turn_a_committed_save_into_a_crash(tmp_path, monkeypatch, err):
    """The new checkpoint is committed before retention runs; failing to delete an
    old one must not escape as a raw OSError (and must not lose the new one)."""
    run = Tiny(tmp_path / "run")
    run.rs.start()
    for s in (1, 2):
        run.step(s)
        run.rs.save(s)
    run.step(3)
    Faults(monkeypatch, "unlink", err, match="/step-00000001\\.ckpt", every=True)
    # A typed error is acceptable; a raw OSError is not (suppress does not catch it).
    with contextlib.suppress(CheckpointError):
        run.rs.save(3)
    monkeypatch.undo()
    assert ckptkit.verify(tmp_path / "run" / "step-00000003.ckpt").ok
    again = Tiny(tmp_path / "run")
    assert again.rs.resume().step == 3
    again.step(4)
    again.rs.save(4)  # retention retries what it could not delete
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [3, 4]


# ------------------------------------------------------------------ a real full disk


@contextlib.contextmanager
def _tmpfs(size: str):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a real full disk needs root to mount a small tmpfs")
    d = tempfile.mkdtemp(prefix="ckptkit-fulldisk-")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True)
    if proc.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=False)
        os.rmdir(d)


def test_a_really_full_disk_fails_the_save_and_keeps_the_retention_set():
    with _tmpfs("1m") as d:
        run_dir = os.path.join(d, "run")
        run = Tiny(run_dir, keep=3, width=300)  # ~360 KB a container: the third does not fit
        run.rs.start()
        saved = []

        def save_until_full() -> None:
            for s in range(1, 10):
                run.step(s)
                run.rs.save(s)
                saved.append(s)

        with pytest.raises(SaveFailed) as e:
            save_until_full()
        assert e.value.errno == errno.ENOSPC and "ENOSPC" in str(e.value), str(e.value)
        assert saved and [s for s, _ in list_checkpoints(run_dir)] == saved
        assert _temps(run_dir) == []
        for s in saved:
            assert ckptkit.verify(os.path.join(run_dir, f"step-{s:08d}.ckpt")).ok
        again = Tiny(run_dir, keep=3, width=300)
        assert again.rs.resume().step == saved[-1]
        # plain save to the full disk: same story, the old file stays whole
        path = os.path.join(run_dir, f"step-{saved[0]:08d}.ckpt")
        before = _read(path)
        with pytest.raises(SaveFailed) as e2:
            save(path, Checkpoint(step=99, model={"w": torch.zeros(200_000)}))
        assert e2.value.errno == errno.ENOSPC
        assert _read(path) == before and _temps(run_dir) == []
