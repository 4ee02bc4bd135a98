"""One writer per run directory: the run-directory lease (spec/lease.md R-LS01..R-LS09).

Real processes: a ``ckptkit train`` job holding its run directory while a second one is
refused, SIGKILLed and taken over. The orphaned-ranks case (torchrun's launcher killed,
its ranks left running) is in ``test_trainer_distributed.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_FLAGS, Flat

from ckptkit import LeaseLost, RunDirInUse, RunState
from ckptkit.cli import main
from ckptkit.run._lease import LEASE_FILE, FileLease, Holder, this_job

FLAGS = [*TINY_FLAGS, "--threads", "1", "--quiet"]


def _holder(**changes: object) -> Holder:
    base = {"host": "elsewhere", "pid": 4242, "started": time.time(), "ranks": 2, "launcher": 4241}
    return Holder(**{**base, "heartbeat": time.time(), "token": "t" * 32, **changes})  # type: ignore[arg-type]


def _write(run_dir: Path, h: Holder) -> None:
    (run_dir / LEASE_FILE).write_text(json.dumps(h.__dict__))


@pytest.mark.slow
def test_a_second_job_on_a_run_directory_in_use_is_refused_and_a_killed_ones_lease_taken_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "ckptkit", "train", "--run-dir", str(run_dir), *FLAGS, "--steps", "1000000"]
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / LEASE_FILE).exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first job never took its lease"
            time.sleep(0.05)
        for again in ([], ["--resume"]):
            assert main(["train", "--run-dir", str(run_dir), *FLAGS, "--steps", "3", *again]) == 1
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith(
                f"ckptkit train: {run_dir}: in use by another job, pid {first.pid} on {socket.gethostname()} "
                "(1 rank(s); started "
            ), err
            assert err.endswith(
                f": one writer per run directory; wait for it to end or stop it (kill {first.pid} on "
                f"{socket.gethostname()}), or use another run directory\n"
            ), err
    finally:
        first.kill()
        first.wait()
    assert main(["train", "--run-dir", str(run_dir), *FLAGS[:-1], "--steps", "3", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"took over the run directory's lease from pid {first.pid} on {socket.gethostname()} (1 rank(s);" in err
    assert f": no process {first.pid} runs on this host" in err
    assert not (run_dir / LEASE_FILE).exists()  # released when the job ended


def test_a_holder_on_another_host_is_live_until_its_heartbeat_expires(tmp_path: Path) -> None:
    _write(tmp_path, _holder(heartbeat=time.time() - 50))
    lease = FileLease(tmp_path, ttl_s=100)
    with pytest.raises(
        RunDirInUse, match=r"in use by another job, pid 4242 on elsewhere \(2 rank\(s\), launcher pid 4241;"
    ) as e:
        lease.acquire(this_job(1))
    assert e.value.holder.pid == 4242
    _write(tmp_path, _holder(heartbeat=time.time() - 150))
    said = lease.acquire(this_job(1))
    assert said is not None and said.startswith("took over the run directory's lease from pid 4242 on elsewhere")
    assert said.endswith("(the lease lives 100 s)") and "no heartbeat for 15" in said
    assert lease.holder() == lease.mine


def test_a_run_state_whose_lease_was_taken_over_saves_nothing(tmp_path: Path) -> None:
    state = RunState(tmp_path, config=Flat())
    state.start()
    state.save(1)
    other = _holder(host=socket.gethostname(), pid=os.getppid())  # a live process of this host took it over
    _write(tmp_path, other)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(LeaseLost, match=r"this job no longer holds the run directory's lease \(it is held by pid "):
        state.save(2)
    assert sorted(os.listdir(tmp_path)) == before
    state.close()
    assert FileLease(tmp_path).holder() == other  # a job that lost the lease never removes another's


def test_a_lease_file_that_is_no_lease_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / LEASE_FILE).write_text("not json")
    with pytest.raises(RunDirInUse) as e:
        RunState(tmp_path, config=Flat()).start()
    assert str(e.value) == (
        f"{tmp_path / LEASE_FILE}: the run directory's lease is not a lease ckptkit wrote; "
        f"if no job uses {tmp_path}, delete it and start again"
    )
    (tmp_path / LEASE_FILE).unlink()
    os.mkfifo(tmp_path / LEASE_FILE)  # a FIFO is refused unread: opening it never waits for a writer
    with pytest.raises(RunDirInUse) as e:
        RunState(tmp_path, config=Flat()).start()
    assert str(e.value) == (
        f"{tmp_path / LEASE_FILE}: the run directory's lease cannot be read (is a FIFO (named pipe), not a lease "
        f"file (a lease is a regular file)); if no job uses {tmp_path}, delete it and start again"
    )
    with pytest.raises(ValueError, match=r"^ttl_s must be > 0 seconds \(got 0\)$"):
        FileLease(tmp_path, ttl_s=0)


def test_the_same_process_takes_its_own_lease_again_and_close_releases_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    said: list[str] = []
    first = RunState(tmp_path, config=Flat(), log=said.append)
    first.start()
    first.save(1)
    again = RunState(tmp_path, config=Flat(), log=said.append)  # a loop that rebuilt its state (no close)
    assert again.resume().step == 1
    assert said == [] and FileLease(tmp_path).holder() is not None
    assert main(["verify", str(tmp_path)]) == 0  # the lease is no checkpoint nor companion (R-LS09)
    assert LEASE_FILE not in capsys.readouterr().out
    again.close()
    assert not (tmp_path / LEASE_FILE).exists()
