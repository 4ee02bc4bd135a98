"""Two nodes that share no filesystem, their run on object storage (spec/objectstore.md R-O35..R-O37,
G-75..G-77).

Every job is two torchrun agents on this host, ``--nnodes 2 --nproc_per_node 1``, joined by a
c10d rendezvous on 127.0.0.1, each node in a private working directory of its own (no local path
is shared: each rank keeps its copies in a private temporary directory), the run directory on
the tests' S3 server (moto, HTTP on 127.0.0.1). Each agent runs in a session of its own, bounded
by a timeout and killed as a whole when its test ends. Kept cheap: the tiny model, 6 steps, one
uninterrupted run shared by the file, one hypothesis property and one fixed node-kill scenario.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
from helpers import TINY_FLAGS, examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit.audit._commands import stop_job
from ckptkit.cli import main
from ckptkit.distributed._format import verify_directory
from ckptkit.distributed._objects import local_name
from ckptkit.format._place import place_for
from ckptkit.run._history import compared_rows, read_rows

STEPS, EVERY = 6, 2
TRAIN = ["-m", "ckptkit", "train", *TINY_FLAGS, "--ckpt-every", str(EVERY), "--keep", "100", "--quiet"]
JOB_TIMEOUT_S = 150
TESTS = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(s3_server: str) -> dict[str, str]:
    """The standard AWS variables pointing at the tests' server (what each node's environment holds)."""
    aws = {
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }
    drop = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **aws, "OMP_NUM_THREADS": "1"}


def _client(env: dict[str, str]) -> object:
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def _bucket(env: dict[str, str]) -> str:
    name = f"multinode-{uuid.uuid4().hex[:12]}"
    _client(env).create_bucket(Bucket=name)  # type: ignore[attr-defined]
    return f"s3://{name}"


def _objects(env: dict[str, str], url: str) -> dict[str, bytes]:
    """Every object under the prefix ``url``, by key relative to it."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = _client(env)
    page = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")  # type: ignore[attr-defined]
    keys = [o["Key"] for o in page.get("Contents", [])]
    return {k[len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}  # type: ignore[attr-defined]


def _count(env: dict[str, str], url: str) -> int:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    page = _client(env).list_objects_v2(Bucket=bucket, Prefix=prefix + "/")  # type: ignore[attr-defined]
    return int(page.get("KeyCount", 0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(nodes: Path, env: dict[str, str], *argv: str) -> list[subprocess.Popen[bytes]]:
    """Two torchrun agents, one per node, each in its own working directory and session."""
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", uuid.uuid4().hex]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", *rdzv]
    procs = []
    for node in (0, 1):
        here = nodes / f"node{node}"
        here.mkdir(parents=True, exist_ok=True)
        with open(here / "job.log", "ab") as log:
            procs.append(
                subprocess.Popen(
                    [*launcher, *argv], cwd=here, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    return procs


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        stop_job(proc)


def _job(nodes: Path, env: dict[str, str], *argv: str) -> list[int]:
    """Run a 2-node job to its end (bounded); each agent's exit code."""
    procs = _launch(nodes, env, *argv)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _end(procs)
    return [p.returncode for p in procs]


def _logs(nodes: Path) -> str:
    return "\n".join((nodes / f"node{n}" / "job.log").read_text(errors="replace")[-3000:] for n in (0, 1))


def _train(nodes: Path, env: dict[str, str], run: str, *flags: str) -> list[int]:
    return _job(nodes, env, *TRAIN, "--run-dir", run, "--steps", str(STEPS), *flags)


def _history(env: dict[str, str], run: str, tmp: Path) -> list[dict[str, object]]:
    (tmp / "history.jsonl").write_bytes(_objects(env, run)["history.jsonl"])
    return read_rows(str(tmp / "history.jsonl"))[0]


def _assert_same_run(env: dict[str, str], reference: str, run: str, tmp: Path) -> None:
    """Every checkpoint object identical byte for byte, and the same compared history rows."""
    want = {k: v for k, v in _objects(env, reference).items() if k.startswith("step-")}
    got = {k: v for k, v in _objects(env, run).items() if k.startswith("step-")}
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k] != want[k]]
    assert not differ, f"{differ} differ between the uninterrupted and the resumed run"
    (tmp / "a").mkdir(exist_ok=True)
    (tmp / "b").mkdir(exist_ok=True)
    assert compared_rows(_history(env, run, tmp / "a")) == compared_rows(_history(env, reference, tmp / "b"))


@pytest.fixture(scope="module")
def straight(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """One 2-node job, shared by the file: an uninterrupted run of the reference trainer, then, on each
    rank, ckptkit.distributed.save/load/AsyncSaver and a RunState loop (tests/_multinode_worker.py);
    ``(the trainer's run, the worker's prefix)``."""
    nodes = tmp_path_factory.mktemp("straight")
    bucket = _bucket(env)
    run, work = f"{bucket}/run", f"{bucket}/w"
    train = [*TRAIN[3:], "--run-dir", run, "--steps", str(STEPS)]
    assert _job(nodes, env, str(TESTS / "_multinode_worker.py"), work, *train) == [0, 0], _logs(nodes)
    logs = _logs(nodes)
    assert "MULTINODE OK rank 0" in logs and "MULTINODE OK rank 1" in logs, logs
    assert not [p for n in (0, 1) for p in (nodes / f"node{n}").iterdir() if p.name != "job.log"]  # nothing local
    return run, work


@pytest.fixture(scope="module")
def reference(straight: tuple[str, str]) -> str:
    return straight[0]


@settings(max_examples=examples(0.01), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draw=st.integers(0, 10**6))
def test_a_two_node_job_killed_whole_at_any_moment_resumes_to_the_objects_of_an_uninterrupted_one(
    draw: int, reference: str, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """G-75, R-O36, R-O37: the moment is the n-th object the job has created (hypothesis's draw, printed with a
    failure): between any two puts, a save's included."""
    total = len(_objects(env, reference))
    seen = 1 + (draw * 7 + 11) % (total - 1)  # spread: the profile's first draw (0) is a moment inside a save
    nodes = tmp_path_factory.mktemp("killed")
    run = f"{_bucket(env)}/run"
    procs = _launch(nodes, env, *TRAIN, "--run-dir", run, "--steps", str(STEPS))
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while _count(env, run) < seen and all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, f"{seen} objects not reached in time"
            time.sleep(0.005)
    finally:
        _end(procs)  # SIGKILL: both agents and both ranks
    assert _train(nodes, env, run, "--resume") == [0, 0], _logs(nodes)
    _assert_same_run(env, reference, run, nodes)


def test_a_node_killed_mid_save_ends_the_job_and_the_last_committed_step_resumes_to_the_same_objects(
    reference: str,
    env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """G-76, R-O34: rank 1's node dies (SIGKILL) as it puts its object of step 4; both agents end within
    --dist-timeout (the job's bound), step 2 stays committed and whole, step 4 has no record, and
    the resume from step 2 ends with the uninterrupted run's objects; `ckptkit verify` of the
    prefix then passes, and fails naming the one object whose byte is changed."""
    run = f"{_bucket(env)}/run"
    hook = os.pathsep.join([str(TESTS / "die_in_upload"), env.get("PYTHONPATH", "")])
    dying = {**env, "PYTHONPATH": hook, "CKPTKIT_TEST_DIE_AT_PUT": "step-00000004.dcp.rank-00001.ckdcp"}
    codes = _train(tmp_path, dying, run, "--dist-timeout", "5")
    assert all(code != 0 for code in codes), _logs(tmp_path)
    left = _objects(env, run)
    assert "step-00000002.dcp.commit.json" in left and "step-00000004.dcp.commit.json" not in left
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(var, env[var])  # this process reads the objects as the nodes do
    place = place_for(run)
    try:
        assert verify_directory(place.fetch("step-00000002.dcp", local_name)).ok  # each object checked on the way
    finally:
        place.close()
    assert _train(tmp_path, env, run, "--resume") == [0, 0], _logs(tmp_path)
    _assert_same_run(env, reference, run, tmp_path)
    (resume,) = [r for r in _history(env, run, tmp_path) if r["kind"] == "resume"]
    assert resume["step"] == 2
    assert main(["verify", run, "--quiet"]) == 0  # every step: its objects against the record, then as a directory
    assert main(["diff", run, reference, "--tensors"]) == 0  # both prefixes' newest step.dcp, each a verified copy
    capsys.readouterr()
    bucket, _, prefix = run.removeprefix("s3://").partition("/")
    key = f"{prefix}/step-00000006.dcp.rank-00001.ckdcp"
    data = bytearray(_objects(env, run)["step-00000006.dcp.rank-00001.ckdcp"])
    data[len(data) // 2] ^= 1
    _client(env).put_object(Bucket=bucket, Key=key, Body=bytes(data))  # type: ignore[attr-defined]
    assert main(["verify", run, "--quiet"]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert bad, "no FAIL line"
    for line in bad:  # the object, and its checkpoint (whose directory check reads it): each names the object
        assert line.startswith(f"FAIL  {run}/step-00000006.dcp.rank-00001.ckdcp: xxh3: object bytes differ"), bad


def test_distributed_save_load_and_a_runstate_loop_on_two_nodes(
    straight: tuple[str, str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """G-77, R-O35: each node put its own rank object and the one record lists both (each rank checked its
    load, tests/_multinode_worker.py); the RunState loop interrupted after step 4 and resumed
    committed the objects of the loop that ran straight, byte for byte."""
    work = straight[1]
    plain = _objects(env, f"{work}/plain")
    for name in ("step-1", "step-2"):
        record = json.loads(plain[f"{name}.commit.json"])
        assert [o["key"] for o in record["objects"]] == [name, f"{name}.rank-00000.ckdcp", f"{name}.rank-00001.ckdcp"]
        assert plain[f"{name}.rank-00000.ckdcp"] != plain[f"{name}.rank-00001.ckdcp"]
    resumed = {k: v for k, v in _objects(env, f"{work}/resumed").items() if k.startswith("step-00000006")}
    ran = {k: v for k, v in _objects(env, f"{work}/straight").items() if k.startswith("step-00000006")}
    assert sorted(resumed) == sorted(ran) and "step-00000006.dcp.rank-00001.ckdcp" in ran
    assert [k for k in ran if ran[k] != resumed[k]] == []
    # One process on the 2-node prefix takes the DCP store and refuses the resume without --reshard
    # (R-O35, RS-D7), changing nothing.
    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(var, env[var])
    assert main(["inspect", f"{straight[0]}/step-00000006.dcp"]) == 0  # its metadata object, checked, shown
    shown = capsys.readouterr().out.splitlines()[0]
    assert shown.startswith(f"{straight[0]}/step-00000006.dcp: distributed checkpoint, world size 2 at save"), shown
    before = _objects(env, straight[0])
    one = ["train", *TRAIN[3:], "--run-dir", straight[0], "--steps", str(STEPS + 2), "--threads", "1", "--resume"]
    assert main(one) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("ckptkit train: ") and "world size" in line and "--reshard" in line, line
    assert _objects(env, straight[0]) == before
