"""One writer per run directory: the run-directory lease (spec/lease.md R-LS01..R-LS09).

Real processes: a ``ckptkit train`` job holding its run directory while a second one is
refused, SIGKILLed and taken over. The orphaned-ranks case (torchrun's launcher killed,
its ranks left running) is in ``test_trainer_distributed.py``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_FLAGS, Flat

from ckptkit import LeaseLost, RunDirInUse, RunState
from ckptkit.cli import main
from ckptkit.run._lease import LEASE_FILE, Holder, lease_for, this_job

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
    lease = lease_for(tmp_path, ttl_s=100)
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
    assert lease_for(tmp_path).holder() == other  # a job that lost the lease never removes another's


def test_a_lease_file_that_is_no_lease_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / LEASE_FILE).write_text("not json")
    with pytest.raises(RunDirInUse) as e:
        RunState(tmp_path, config=Flat()).start()
    assert str(e.value) == (
        f"{tmp_path / LEASE_FILE}: the run directory's lease is not a lease ckptkit wrote "
        "(not a flat JSON object, R-LS15); "
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
        lease_for(tmp_path, ttl_s=0)


def test_the_same_process_takes_its_own_lease_again_and_close_releases_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    said: list[str] = []
    first = RunState(tmp_path, config=Flat(), log=said.append)
    first.start()
    first.save(1)
    again = RunState(tmp_path, config=Flat(), log=said.append)  # a loop that rebuilt its state (no close)
    assert again.resume().step == 1
    assert said == [] and lease_for(tmp_path).holder() is not None
    assert main(["verify", str(tmp_path)]) == 0  # the lease is no checkpoint nor companion (R-LS09)
    assert LEASE_FILE not in capsys.readouterr().out
    again.close()
    assert not (tmp_path / LEASE_FILE).exists()


SECONDS = "Unix seconds in [0, 253402300800), before the year 10000"


def _dead_pid() -> int:
    """The pid of a process that ran here and ended."""
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    return gone.pid


@pytest.mark.parametrize(
    ("field", "raw", "shown", "expected"),
    [
        ("pid", str(2**40), str(2**40), "an integer in [1, 2^31)"),
        ("pid", "0", "0", "an integer in [1, 2^31)"),
        ("pid", "true", "true", "an integer in [1, 2^31)"),
        ("heartbeat", "1e999", "Infinity", SECONDS),
        ("heartbeat", "253402300800", "253402300800", SECONDS),
        ("started", "-1", "-1", SECONDS),
        ("ranks", "2.5", "2.5", "an integer in [1, 2^31)"),
        ("launcher", "-3", "-3", "null or an integer in [1, 2^31)"),
        ("host", '""', '""', "a non-empty string of at most 255 characters"),
        ("token", "12", "12", "a non-empty string of at most 256 characters"),
    ],
)
def test_a_lease_field_out_of_its_range_is_refused_naming_the_field_and_rule(
    tmp_path: Path, field: str, raw: str, shown: str, expected: str
) -> None:
    """R-LS15: a lease this reader cannot judge is refused, never taken over (no OverflowError, no ValueError)."""
    doc = json.dumps(_holder(host=socket.gethostname(), pid=_dead_pid()).__dict__)
    doc = re.sub(rf'"{field}": [^,}}]+', f'"{field}": {raw}', doc)
    (tmp_path / LEASE_FILE).write_text(doc)
    with pytest.raises(RunDirInUse) as e:
        RunState(tmp_path, config=Flat()).start()
    assert str(e.value) == (
        f"{tmp_path / LEASE_FILE}: the run directory's lease is not a lease ckptkit wrote ({field} is {shown}, "
        f"expected {expected}; R-LS15); if no job uses {tmp_path}, delete it and start again"
    )


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ('{"pid": NaN}', "NaN is not a JSON number; R-LS15"),
        ("[" * 50_000 + "]" * 50_000, "nesting deeper than 1; R-LS15"),
        (f'{{"pid": {2**70}}}', "an integer of 22 digits; R-LS15"),
        ('{"pid": 1}', "fields pid, expected heartbeat, host, launcher, pid, ranks, started, token; R-LS15"),
    ],
)
def test_a_lease_that_is_not_a_flat_object_of_its_fields_is_refused_and_the_cli_says_it_in_one_line(
    tmp_path: Path, raw: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / LEASE_FILE).write_text(raw)
    assert main(["train", "--run-dir", str(tmp_path), *FLAGS, "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"ckptkit train: {tmp_path / LEASE_FILE}: the run directory's lease is not a lease ckptkit wrote ({why}); "
        f"if no job uses {tmp_path}, delete it and start again\n"
    )


def test_a_takeover_is_said_under_quiet_and_recorded_in_the_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """R-LS04: the line on stderr whatever --quiet says, and the first note of the history's resume row."""
    assert main(["train", "--run-dir", str(tmp_path), *FLAGS, "--steps", "2"]) == 0
    dead = _dead_pid()
    _write(tmp_path, _holder(host=socket.gethostname(), pid=dead, launcher=None))
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path), *FLAGS, "--steps", "3", "--resume"]) == 0
    err = capsys.readouterr().err
    host = socket.gethostname()
    line = f"ckptkit train: took over the run directory's lease from pid {dead} on {host} (2 rank(s); started "
    assert err.startswith(line) and err.rstrip("\n").endswith(f": no process {dead} runs on this host"), err
    assert err.count("took over") == 1, err
    rows = [json.loads(r) for r in (tmp_path / "history.jsonl").read_text().splitlines()]
    resume = [r for r in rows if r["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 2
    assert "ckptkit train: " + resume[0]["notes"][0] == err.splitlines()[0]
