"""Every file of a run directory may be a FIFO, a directory, a device, unreadable or enormous
(spec/runstate.md R-025..R-027, spec/guarantees.md G-40..G-42).

A resume and ``verify`` open each path without blocking and read only a regular file of
bounded size; the resume skips a checkpoint any piece of which cannot be read exactly as
it skips a damaged one, and ``verify`` fails the same checkpoint. The state machine over
saves, special files, real crashes mid-save and resumes is
tests/run/test_run_dir_state_machine.py.

Unreadable files: these tests run as root on CI machines, and root reads a ``chmod 000``
file. Where the process is root, "unreadable" is made real by reading with the effective
uid of ``nobody`` (``os.seteuid``; the saved uid stays 0, so the test takes root back), in
a directory ``nobody`` may enter; elsewhere ``chmod 000`` is enough.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _run_dir import as_reader, failed, make_run, make_special, no_hang, resume_run, verify_run

from ckptkit import CheckpointError
from ckptkit.cli import main
from ckptkit.run._history import check_history, read_rows


def _saved(run_dir: Path, steps: int = 2) -> Path:
    rs, net = make_run(run_dir)
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

    make_run(run)[0].resume()
    with contextlib.redirect_stdout(io.StringIO()):
        main(["verify", str(run), "--json"])
    return run


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
    make_special(victim, kind)
    rs, info, _ = resume_run(shared_run, nobody=True)
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
    code, doc = verify_run(shared_run, nobody=True)
    assert code == 1 and failed(doc) == {str(shared_run / "step-00000002.ckpt")}, doc


@pytest.mark.parametrize("kind", ["fifo", "devzero", "directory"])
def test_a_special_environment_record_fails_every_checkpoint_and_the_resume_exits_1(tmp_path, base, kind, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    make_special(run / "environment.json", kind)
    rs, err, _ = resume_run(run)
    assert rs is None and str(err).startswith(f"{run}: no consistent checkpoint to resume from (step-00000002.ckpt: ")
    assert f"{run}/environment.json: is a" in str(err)
    code, doc = verify_run(run)
    assert code == 1 and failed(doc) == {str(run / "step-00000001.ckpt"), str(run / "step-00000002.ckpt")}
    with no_hang():
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
        with as_reader(nobody=True):
            assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (
            f"ckptkit {argv[0]}: {shared_run}: cannot list the run directory (EACCES: Permission denied); "
            "check its permissions, or run as its owner\n"
        )
    rs, _ = make_run(shared_run)
    with as_reader(nobody=True), pytest.raises(CheckpointError) as e:
        rs.resume()  # its first act, reading the lease, is refused (a resume takes the lease before it reads)
    assert str(e.value).startswith(
        f"{shared_run}/lease.json: the run directory's lease cannot be read (cannot open the lease file "
        "(EACCES: Permission denied))"
    )


# --------------------------------------------------------------------- history.jsonl


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_a_special_history_is_refused_unread_by_verify_and_the_resume(tmp_path, base, kind, capsys):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    make_special(run / "history.jsonl", kind)
    what = "a FIFO (named pipe)" if kind == "fifo" else "a character device"
    with no_hang():
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
    _, info, _ = resume_run(run)
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
    assert err.endswith(
        "ckptkit train: falling back to step-00000001.ckpt (step 1)\n"
        # the fallback re-ran step 1, which the first process had recorded: the resume proves itself (R-D23)
        "ckptkit train: resume verified: steps 1..1 reproduce the interrupted run bit for bit "
        "(1 step, 14 tensors each)\n"
    )
    assert f"  resume       skipped step-00000002.ckpt: {run}/step-00000002.ckpt: offset 0" in out
    assert "  resume       falling back to step-00000001.ckpt (step 1)\n" in out


# --------------------------------------------------------------------- a damaged step saved again

FLAGS = ["--n-layer", "1", "--n-head", "1", "--d-model", "8", "--block-size", "8", "--seq-len", "8", "--quiet"]


def test_a_damaged_step_is_set_aside_when_the_run_saves_that_step_again(tmp_path, capsys):
    """spec/runstate.md R-028: the resume falls back past step 4 (R-026); reaching step 4 again, the
    save renames what stands in its way and says so, even with --quiet; nothing is deleted."""
    run, piece = tmp_path / "run", "step-00000004.ckpt.ngram"
    assert main(["train", "--run-dir", str(run), "--steps", "4", "--ckpt-every", "2", *FLAGS]) == 0
    (run / piece).unlink()
    (run / piece).mkdir()
    (run / piece / "inside").write_text("kept")
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), "--steps", "6", "--ckpt-every", "2", "--resume", *FLAGS]) == 0
    err = capsys.readouterr().err
    assert f"ckptkit train: skipped step-00000004.ckpt: {run / piece}: is a directory" in err, err
    assert (
        f"ckptkit train: set aside {piece} as damaged-1.{piece}: it is a directory where step 4's save writes a "
        "file (a damaged step); nothing was deleted (R-028)\n"
    ) in err
    assert (run / f"damaged-1.{piece}" / "inside").read_text() == "kept"
    assert main(["verify", str(run)]) == 0
