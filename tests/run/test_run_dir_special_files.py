"""Every file of a run directory may be a FIFO, a directory, a device, unreadable or enormous
(spec/runstate.md R-025..R-027, spec/guarantees.md G-40..G-42).

A resume and ``verify`` open each path without blocking and read only a regular file of
bounded size; the resume skips a checkpoint any piece of which cannot be read exactly as
it skips a damaged one, and ``verify`` fails the same checkpoint. A hypothesis state
machine keeps it true over saves, special files, real crashes mid-save and resumes.

Unreadable files: these tests run as root on CI machines, and root reads a ``chmod 000``
file. Where the process is root, "unreadable" is made real by reading with the effective
uid of ``nobody`` (``os.seteuid``; the saved uid stays 0, so the test takes root back), in
a directory ``nobody`` may enter; elsewhere ``chmod 000`` is enough.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import examples, linear_run
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ckptkit import CheckpointError, CheckpointNotFound, NoConsistentCheckpoint
from ckptkit.cli import main
from ckptkit.run import RunState
from ckptkit.run._history import check_history, read_rows
from ckptkit.run._lease import LEASE_FILE

NOBODY = 65534
ROOT_USER = os.geteuid() == 0


def _make(run_dir: Path) -> tuple[RunState, torch.nn.Linear]:
    return linear_run(run_dir)


def _saved(run_dir: Path, steps: int = 2) -> Path:
    rs, net = _make(run_dir)
    rs.start()
    for s in range(1, steps + 1):
        with torch.no_grad():
            net.weight.add_(1.0)
        rs.save(s)
    return run_dir


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = _saved(tmp_path_factory.mktemp("base") / "run")
    # Import what a resume and verify import lazily while root may still read the interpreter's
    # own files: as nobody, only the run directory is to be unreadable.
    import resource  # noqa: F401  (ckptkit.format._codec.memory_available)

    _make(run)[0].resume()
    with contextlib.redirect_stdout(io.StringIO()):
        main(["verify", str(run), "--json"])
    return run


@contextlib.contextmanager
def _no_hang(seconds: float = 20.0) -> Iterator[None]:
    """Fail (never wait) if the block blocks: a FIFO opened for reading waits for a writer."""

    def fire(*_: Any) -> None:
        raise AssertionError(f"blocked for {seconds} s (a FIFO or device opened and waited on)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def _as_reader(nobody: bool) -> Iterator[None]:
    """With ``nobody``, read as a user a ``chmod 000`` stops: root's effective uid becomes nobody's
    for the block (the run directory must then be one nobody may enter: :func:`shared_run`)."""
    if not (nobody and ROOT_USER):
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def _special(path: Path, kind: str) -> None:
    """Put ``kind`` where ``path`` was: a FIFO, a directory, a symlink to /dev/zero, an unreadable file."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        if kind == "unreadable":
            path.chmod(0)
            return
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(b"x")
        path.chmod(0)


def _verify(run_dir: Path, nobody: bool = False) -> tuple[int, dict[str, Any]]:
    """``verify RUN --json``: its exit code and document (empty for a directory with no checkpoint: exit 2)."""
    out, err = io.StringIO(), io.StringIO()
    with _no_hang(), _as_reader(nobody), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", str(run_dir), "--json"])
    if code == 2:
        assert err.getvalue() == f"ckptkit verify: {run_dir}: no *.ckpt files in this directory\n", err.getvalue()
        return code, {"files": [], "companions": []}
    return code, json.loads(out.getvalue())


def _failed(doc: dict[str, Any]) -> set[str]:
    """The checkpoints ``verify --json`` fails: the container, a sidecar beside it, or a companion it binds."""
    bad = {f["path"] for f in doc["files"] if not f["ok"]}
    ckpts = {f["path"] for f in doc["files"] if f["path"].endswith(".ckpt")}
    ckpts |= {c for e in doc["companions"] for c in e["checkpoints"]}
    out = {c for c in ckpts if c in bad or any(p.startswith(c + ".") for p in bad)}
    return out | {c for e in doc["companions"] if not e["ok"] for c in e["checkpoints"]}


def _resume(run_dir: Path, nobody: bool = False) -> tuple[RunState | None, Any, torch.nn.Linear]:
    """(the resumed run, its ResumeInfo, its model) or (None, the NoConsistentCheckpoint, ...);
    anything else fails the test."""
    rs, net = _make(run_dir)
    with _no_hang(), _as_reader(nobody):
        try:
            return rs, rs.resume(), net
        except CheckpointNotFound as e:  # none at all, or NoConsistentCheckpoint: every one damaged
            return None, e, net


# --------------------------------------------------------------------- each piece, each special file


PIECES = {
    "container": "step-00000002.ckpt",
    "sidecar": "step-00000002.ckpt.ngram",
    "snapshot": "step-00000002.ckpt.config.json",
}


@pytest.fixture
def shared_run(base: Path) -> Iterator[Path]:
    """A copy of ``base`` in a directory ``nobody`` may enter (see the module docstring)."""
    top = Path(tempfile.mkdtemp(prefix="ckptkit-special-"))
    top.chmod(0o755)
    shutil.copytree(base, top / "run")
    (top / "run").chmod(0o777)  # nobody may write it (a resume takes the lease), not read root's 000 files
    yield top / "run"
    shutil.rmtree(top)


@pytest.mark.parametrize("kind", ["fifo", "directory", "devzero", "unreadable"])
@pytest.mark.parametrize("piece", sorted(PIECES))
def test_resume_skips_a_special_file_in_place_of_any_piece_and_verify_fails_that_checkpoint(shared_run, piece, kind):
    victim = shared_run / PIECES[piece]
    _special(victim, kind)
    rs, info, _ = _resume(shared_run, nobody=True)
    assert rs is not None, info
    assert info.step == 1 and [p for p, _ in info.skipped] == [str(shared_run / "step-00000002.ckpt")]
    why = info.skipped[0][1]
    assert why.startswith(f"{victim}: "), why
    expected = {
        "fifo": "is a FIFO (named pipe), not a",
        "directory": "is a directory, not a",
        "devzero": "is a character device, not a",
        "unreadable": "cannot open the",
    }[kind]
    assert expected in why, why
    code, doc = _verify(shared_run, nobody=True)
    assert code == 1 and _failed(doc) == {str(shared_run / "step-00000002.ckpt")}, doc


@pytest.mark.parametrize("kind", ["fifo", "devzero", "directory"])
def test_a_special_environment_record_fails_every_checkpoint_and_the_resume_exits_1(tmp_path, base, kind, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    _special(run / "environment.json", kind)
    rs, err, _ = _resume(run)
    assert rs is None and str(err).startswith(f"{run}: no consistent checkpoint to resume from (step-00000002.ckpt: ")
    assert f"{run}/environment.json: is a" in str(err)
    code, doc = _verify(run)
    assert code == 1 and _failed(doc) == {str(run / "step-00000001.ckpt"), str(run / "step-00000002.ckpt")}
    with _no_hang():
        assert main(["verify", str(run)]) == 1
    assert f"FAIL  {run}/environment.json: is a" in capsys.readouterr().out


def test_no_consistent_checkpoint_exits_1_as_spec_cli_and_train_help_say(tmp_path, capsys):
    run = tmp_path / "run"
    for s in (2, 4):
        (run / f"step-{s:08d}.ckpt").parent.mkdir(exist_ok=True)
        (run / f"step-{s:08d}.ckpt").write_bytes(b"not a checkpoint")
    flags = ["--n-layer", "1", "--n-head", "1", "--d-model", "8", "--block-size", "8", "--seq-len", "8"]
    assert main(["train", "--run-dir", str(run), "--steps", "6", *flags, "--resume", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ckptkit train: {run}: no consistent checkpoint to resume from (step-00000004.ckpt: ")


# --------------------------------------------------------------------- the run directory itself


def test_an_unreadable_run_directory_is_a_clear_error_for_every_command(shared_run, capsys):
    main(["verify", str(shared_run)])  # the commands' modules imported while root can read them
    shared_run.chmod(0o700)  # root's: nobody may not list it
    capsys.readouterr()
    for argv in (["verify", str(shared_run)], ["inspect", str(shared_run)], ["diff", str(shared_run), str(shared_run)]):
        with _as_reader(nobody=True):
            assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (
            f"ckptkit {argv[0]}: {shared_run}: cannot list the run directory (EACCES: Permission denied); "
            "check its permissions, or run as its owner\n"
        )
    rs, _ = _make(shared_run)
    with _as_reader(nobody=True), pytest.raises(CheckpointError) as e:
        rs.resume()  # its first write, the lease, is refused (a resume takes the lease before it reads)
    assert str(e.value).startswith(f"{shared_run}/lease.json: cannot create temporary file: Permission denied")


# --------------------------------------------------------------------- history.jsonl


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_a_special_history_is_refused_unread_by_verify_and_the_resume(tmp_path, base, kind, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    _special(run / "history.jsonl", kind)
    what = "a FIFO (named pipe)" if kind == "fifo" else "a character device"
    with _no_hang():
        assert main(["verify", str(run)]) == 1
        with pytest.raises(CheckpointError) as e:
            read_rows(run / "history.jsonl")  # what a trainer's resume reads
    assert str(e.value) == f"{run}/history.jsonl: is {what}, not a history file (a history is a regular file)"
    assert f"FAIL  {run}/history.jsonl: is {what}, not a history file" in capsys.readouterr().out


def test_a_history_line_larger_than_the_memory_left_is_refused_in_bounded_memory(tmp_path):
    history = tmp_path / "history.jsonl"
    with open(history, "wb") as f:  # sparse: 256 MiB of NULs and no newline, then a row
        f.truncate(256 << 20)
        f.seek(256 << 20)
        f.write(b'\n{"kind":"step","step":0}\n')
    child = (  # 128 MiB of address space left: reading the line whole (as before) is a MemoryError
        "import resource, sys\n"
        "from ckptkit.run._history import check_history, read_rows\n"
        "vm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:'))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (128 << 20), resource.RLIM_INFINITY))\n"
        "print(check_history(sys.argv[1]).problems)\n"
        "try:\n    read_rows(sys.argv[1])\n"
        "except ValueError as e:\n    print(type(e).__name__, e)\n"
    )
    p = subprocess.run([sys.executable, "-c", child, str(history)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stderr[-1000:]
    assert p.stdout.splitlines() == [
        "('line 1 (offset 0): longer than 1048576 bytes (R-027)',)",
        (
            f"FormatError {history}: offset 0 (0x0): history: line 1 is longer than 1048576 bytes (a history row "
            "is a few hundred); history.jsonl is written by ckptkit train; do not edit it (R-027)"
        ),
    ]
    assert check_history(history).rows == 1


# --------------------------------------------------------------------- R-C04: a record that omits a sidecar


def test_verify_fails_a_checkpoint_whose_record_omits_a_sidecar_its_resume_reads(tmp_path, base, capsys):
    from ckptkit.format._checkpoint import load, save

    run = tmp_path / "run"
    shutil.copytree(base, run)
    ckpt = load(run / "step-00000002.ckpt")
    monitor = {**ckpt.monitor, "companions": {**ckpt.monitor["companions"], "sidecars": {}}}
    save(run / "step-00000002.ckpt", dataclasses.replace(ckpt, monitor=monitor))
    _, info, _ = _resume(run)
    assert info.step == 1 and "not among the companions step-00000002.ckpt records" in info.skipped[0][1]
    assert main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert (
        f"FAIL  {run}/step-00000002.ckpt.ngram: this sidecar is not among the companions step-00000002.ckpt "
        "records; it was not saved with this checkpoint; resume from another (R-C04)"
    ) in out


# --------------------------------------------------------------------- --quiet still says what it skipped


def test_quiet_still_says_which_damaged_checkpoint_the_resume_skipped(tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["--n-layer", "1", "--n-head", "1", "--d-model", "8", "--block-size", "8", "--seq-len", "8"]
    flags += ["--batch", "2", "--warmup-iters", "1", "--ckpt-every", "1", "--quiet"]
    assert main(["train", "--run-dir", str(run), "--steps", "2", *flags]) == 0
    (run / "step-00000002.ckpt").write_bytes(b"x")
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--steps", "3", *flags, "--resume"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith(f"ckptkit train: skipped step-00000002.ckpt: {run}/step-00000002.ckpt: offset 0 (0x0): ")
    assert err.endswith("ckptkit train: falling back to step-00000001.ckpt (step 1)\n")
    assert f"  resume       skipped step-00000002.ckpt: {run}/step-00000002.ckpt: offset 0" in out
    assert "  resume       falling back to step-00000001.ckpt (step 1)\n" in out


# --------------------------------------------------------------------- the state machine


SPECIALS = ["fifo", "directory", "devzero", "garbage", *(["unreadable"] if not ROOT_USER else [])]


def _crash_in_save(rs: RunState, step: int, at: int) -> None:
    """Save ``step`` in a child process that SIGKILLs itself before its ``at``-th rename: a real death mid-save."""
    pid = os.fork()
    if pid == 0:  # the child: count renames, die at the chosen one
        real, calls = os.replace, [0]

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            calls[0] += 1
            if calls[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst, **kw)

        os.replace = replace
        try:
            rs.save(step)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


class RunDirectory(RuleBasedStateMachine):
    """Saves, special files in place of any file, crashes mid-save, resumes, verifies: never a
    hang, never a raw exception, and the resume takes exactly the newest checkpoint verify passes."""

    def __init__(self) -> None:
        super().__init__()
        self.top = Path(tempfile.mkdtemp(prefix="ckptkit-machine-"))
        self.run = self.top / "run"
        self.rs: RunState | None
        self.rs, self.net = _make(self.run)
        self.rs.start()
        self.step = 0

    def teardown(self) -> None:
        for p in self.top.rglob("*"):
            with contextlib.suppress(OSError):
                if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) == 0:
                    p.chmod(0o600)
        shutil.rmtree(self.top, ignore_errors=True)

    @precondition(lambda self: self.rs is not None)
    @rule()
    def save(self) -> None:
        assert self.rs is not None
        self.step += 1
        with torch.no_grad():
            self.net.weight.add_(1.0)
        try:
            with _no_hang():
                self.rs.save(self.step)
        except CheckpointError:  # a special file where the save writes (a directory): said, never raw
            self.step -= 1

    @precondition(lambda self: self.rs is not None)
    @rule(at=st.integers(1, 4))
    def crash_mid_save(self, at: int) -> None:
        assert self.rs is not None
        _crash_in_save(self.rs, self.step + 1, at)

    @rule(data=st.data(), kind=st.sampled_from(SPECIALS))
    def damage(self, data: st.DataObject, kind: str) -> None:
        # lease.json is the lease's (tests/run/test_lease.py: a damaged one is refused, naming what to do)
        names = sorted(n for n in os.listdir(self.run) if not n.startswith(".") and n != LEASE_FILE)
        if not names:
            return
        victim = self.run / data.draw(st.sampled_from(names), label="victim")
        if kind == "garbage":
            if victim.is_dir() and not victim.is_symlink():
                shutil.rmtree(victim)
            elif victim.is_symlink() or victim.exists():
                victim.unlink()
            victim.write_bytes(b"\x00garbage")
        else:
            _special(victim, kind)

    @rule()
    def resume(self) -> None:
        self.rs, info, net = _resume(self.run)
        _, doc = _verify(self.run)
        passed = sorted(p for p in self._checkpoints() if p not in _failed(doc))
        if self.rs is None:
            assert passed == [], (passed, info)
            assert isinstance(info, NoConsistentCheckpoint) == bool(self._checkpoints()), info
            return
        assert info.path == (passed[-1] if passed else None), (info, doc)
        self.net = net
        self.step = info.step

    def _checkpoints(self) -> list[str]:
        return sorted(str(self.run / n) for n in os.listdir(self.run) if n.startswith("step-") and n.endswith(".ckpt"))

    @invariant()
    def verify_never_raises(self) -> None:
        code, _ = _verify(self.run)
        assert code in (0, 1) or not self._checkpoints()


RunDirectory.TestCase.settings = settings(
    max_examples=examples(1.5),
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_run_directory_state_machine = RunDirectory.TestCase
