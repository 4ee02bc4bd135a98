"""The reference trainer under torchrun: 2 gloo ranks, real processes, real SIGKILL (spec/trainer.md R-T14).

Every job is ``python -m torch.distributed.run --standalone --nproc_per_node 2 -m ckptkit
train ...`` in its own session, bounded by a timeout and killed as a whole (the agent
and both ranks) when a test ends, however it ends. One uninterrupted run per
parallelism is shared by the tests (module-scoped), so the file starts few jobs.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptkit.history import compared_rows
from helpers import TINY_FLAGS, history

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 4
FLAGS = [*TINY_FLAGS, "--ckpt-every", str(EVERY), "--keep", "100", "--quiet"]
JOB_TIMEOUT_S = 120


def _name(step: int) -> str:
    return f"step-{step:08d}.dcp"


def _launch(run_dir: Path, *flags: str, nproc: int = 2, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A torchrun job (or one plain process with ``nproc=0``) in a session of its own."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else []
    argv = [sys.executable, *launcher, "-m", "ckptkit", "train", "--run-dir", str(run_dir), *FLAGS, *flags]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the job's whole session (agent and ranks) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=30)


def _stray(run_dir: Path) -> list[str]:
    """Processes still running with ``run_dir`` on their command line (a rank left behind)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def job(run_dir: Path, *flags: str, nproc: int = 2, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a job to its end (bounded); its exit code, stdout and stderr."""
    proc = _launch(run_dir, *flags, nproc=nproc, env=env)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        _kill(proc)
    assert not _stray(run_dir), _stray(run_dir)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ok(run_dir: Path, *flags: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    done = job(run_dir, *flags, nproc=nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def artifacts(run_dir: Path, step: int) -> dict[str, bytes]:
    """Every file of the checkpoint at ``step``: the DCP directory's files, snapshot, sidecars."""
    out = {}
    for top in sorted(p for p in run_dir.iterdir() if p.name.startswith(_name(step))):
        for f in sorted([top] if top.is_file() else top.rglob("*")):
            if f.is_file():
                out[str(f.relative_to(run_dir))] = f.read_bytes()
    return out


def assert_same_run(a: Path, b: Path, step: int) -> None:
    """Checkpoint ``step`` identical byte for byte (every rank's file), and identical compared history rows."""
    fa, fb = artifacts(a, step), artifacts(b, step)
    assert sorted(fa) == sorted(fb)
    assert any(name.endswith("metadata.ckdcp") for name in fa), sorted(fa)
    for name in fa:
        same = fa[name] == fb[name]
        assert same, f"{name} differs between the uninterrupted and the resumed run"
    ra, rb = compared_rows(history(a)), compared_rows(history(b))
    assert len(ra) == len(rb)
    for i, (x, y) in enumerate(zip(ra, rb, strict=True)):
        assert x == y, f"compared history row {i} differs"


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def straight(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """An uninterrupted 2-rank run of STEPS steps, one per parallelism."""
    run_dir = tmp_path_factory.mktemp(f"straight-{request.param}") / "run"
    ok(run_dir, "--steps", str(STEPS), "--parallel", request.param)
    yield request.param, run_dir


def _kill_after_first_checkpoint(run_dir: Path, *flags: str, seed: int) -> None:
    """Start the job; once checkpoint EVERY is committed, SIGKILL the whole job a random moment later."""
    rng = random.Random(seed)
    proc = _launch(run_dir, *flags)
    try:
        committed = run_dir / _name(EVERY) / "metadata.ckdcp"
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not committed.exists():
            assert proc.poll() is None, f"the job ended before its first checkpoint: {proc.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, "no first checkpoint in time"
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))
    finally:
        _kill(proc)
    assert not _stray(run_dir), _stray(run_dir)
    assert not (run_dir / _name(STEPS) / "metadata.ckdcp").exists(), "the job finished before the kill"


def test_a_whole_job_sigkilled_after_its_first_checkpoint_resumes_to_the_same_bytes(
    straight: tuple[str, Path], tmp_path: Path
) -> None:
    parallel, reference = straight
    seed = random.randrange(2**32)
    run_dir = tmp_path / "run"
    _kill_after_first_checkpoint(run_dir, "--steps", str(STEPS), "--parallel", parallel, seed=seed)
    ok(run_dir, "--steps", str(STEPS), "--parallel", parallel, "--resume")
    assert_same_run(reference, run_dir, STEPS)
    resumes = [r for r in history(run_dir) if r["kind"] == "resume"]
    assert len(resumes) == 1, f"seed {seed}"


def test_a_resume_at_world_size_1_is_refused_and_continues_with_reshard(
    straight: tuple[str, Path], tmp_path: Path
) -> None:
    parallel, reference = straight
    if parallel != "ddp":
        pytest.skip("one parallelism is enough for the world-size rule")
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    refused = job(run_dir, "--steps", str(STEPS + 2), "--resume", nproc=0)
    assert refused.returncode == 1
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("ckptkit train: ") and "world size" in line, refused.stderr
    assert "torchrun --nproc_per_node 2" in line and "--reshard" in line
    ok(run_dir, "--steps", str(STEPS + 2), "--resume", "--reshard", nproc=0)
    rows = history(run_dir)
    (resume,) = [r for r in rows if r["kind"] == "resume"]
    assert resume["resharded"] is True and any("bit-comparable" in n for n in resume["notes"])
    assert [r["step"] for r in rows if r["kind"] == "step"][-3:] == [STEPS - 1, STEPS, STEPS + 1]
