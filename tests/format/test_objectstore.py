"""Checkpoints on object storage (spec/objectstore.md), against a real S3 HTTP server.

The server is moto's ``ThreadedMotoServer`` on 127.0.0.1 (tests/conftest.py ``s3``); the
client is the one users run, configured by the standard AWS variables the fixture sets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import boto3
import pytest
import torch
from helpers import same

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import CommitConflict, IncompleteCheckpoint, UnsupportedOption
from ckptkit.format import _commit as commit_module
from ckptkit.format._commit import RECORD_SUFFIX, read_record
from ckptkit.format._objectstore import ObjectStore, S3Backend, store_for
from ckptkit.format._urls import S3_EXTRA, parse

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # botocore's pooled sockets at exit


def _state(seed: int = 0) -> ckptkit.Checkpoint:
    g = torch.Generator().manual_seed(seed)
    return ckptkit.Checkpoint(step=10 + seed, model={"net": {"w": torch.randn(16, 8, generator=g)}})


def _client():
    return boto3.client("s3")


def _bucket(s3: str) -> str:
    return parse(s3).bucket


# ---------------------------------------------------------------------------- R-O01/R-O02: URLs


def test_a_url_is_parsed_into_bucket_and_key_and_other_schemes_are_refused_by_name() -> None:
    """R-O02."""
    url = parse("s3://bkt/run//demo/")
    assert (url.scheme, url.bucket, url.key, str(url.child("x.ckpt"))) == (
        "s3",
        "bkt",
        "run//demo",
        "s3://bkt/run//demo/x.ckpt",
    )
    with pytest.raises(UnsupportedOption, match=r"^gs://b/k: the gs:// scheme is not supported; ckptkit serves s3://"):
        parse("gs://b/k")
    with pytest.raises(UnsupportedOption, match=r"^s3:///k: no bucket \(expected s3://bucket/prefix\)$"):
        parse("s3:///k")


LOCAL_ONLY = "does not serve s3:// URLs yet (it writes and reads local files only)"
LOCAL_RE = re.escape(LOCAL_ONLY)


def test_every_place_that_takes_a_path_refuses_a_url_it_cannot_serve_and_creates_nothing(tmp_path, monkeypatch) -> None:
    """R-O01, G-50."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedOption, match=rf"^s3://b/run: ckptkit.run.History {LOCAL_RE}"):
        ckptkit.run.History("s3://b/run")  # a RunState on s3:// keeps its history in work_dir (R-O23)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--run-dir", "runs/a", "--data", "s3://b/corpus.txt", "--steps", "2"],
        ["replay", "runs/a", "--from", "1", "--out", "s3://b/replayed"],  # RUN is served; --out is written
        ["plot", "runs/a", "-o", "s3://b/a.png"],
        ["audit", "--keep-dir", "s3://b/keep", "--", "true"],  # a directory audit creates itself
    ],
    ids=lambda a: a[0],
)
def test_cli_commands_that_do_not_serve_urls_refuse_them_in_one_line(argv, tmp_path, monkeypatch, capsys) -> None:
    """R-O01, R-O45, G-50, G-84: one line, exit 2, no local folder."""
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and f"ckptkit {argv[0]} {LOCAL_ONLY}" in err, err
    assert os.listdir(tmp_path) == []


def test_without_the_client_a_url_is_refused_with_the_line_that_installs_it(monkeypatch, capsys) -> None:
    """R-O02."""
    monkeypatch.setitem(sys.modules, "boto3", None)  # what `import boto3` meets when it is not installed
    with pytest.raises(UnsupportedOption) as e:
        ckptkit.load("s3://b/x.ckpt")
    assert str(e.value) == f"s3:// needs the S3 client (boto3), which is not installed: {S3_EXTRA}"
    assert main(["verify", "s3://b/run"]) == 2
    assert capsys.readouterr().err == f"ckptkit verify: {e.value}\n"


# ---------------------------------------------------------------------------- save / load / verify / open


def test_save_load_verify_and_open_on_s3_give_the_local_bytes_and_values(s3, tmp_path) -> None:
    """R-O10 (the objects), R-O14 (read through the record), R-O18 / G-55 (the local bytes)."""
    ckpt = _state()
    ckptkit.save(tmp_path / "local.ckpt", ckpt)
    url = f"{s3}/run/model.ckpt"
    ckptkit.save(url, ckpt)
    body = _client().get_object(Bucket=_bucket(s3), Key="run/model.ckpt")["Body"].read()
    assert body == (tmp_path / "local.ckpt").read_bytes()  # R-O18
    assert same(ckptkit.load(url).model, ckpt.model)
    report = ckptkit.verify(url)
    assert report.ok and report.step == 10 and report.path == url
    with ckptkit.open_checkpoint(url) as lazy:
        assert lazy.path == url and same(lazy.tensor("model", "net", "w"), ckpt.model["net"]["w"])
    entries = read_record(store_for(parse(url)), parse(s3).child("run"), "model.ckpt")
    assert [(e.key, e.size) for e in entries] == [("model.ckpt", len(body))]


def test_a_committed_checkpoint_is_written_once_and_a_second_save_is_a_commit_conflict(s3) -> None:
    """R-O11."""
    url = f"{s3}/model.ckpt"
    ckptkit.save(url, _state(0))
    with pytest.raises(
        CommitConflict, match=r"model.ckpt.commit.json: step already committed; .* written once \(R-O11\)"
    ):
        ckptkit.save(url, _state(1))
    assert same(ckptkit.load(url).model, _state(0).model)


def test_two_writers_racing_for_one_checkpoint_exactly_one_commits_and_the_other_gets_a_typed_error(s3) -> None:
    """R-O11, G-52."""
    url = f"{s3}/race/step-00000010.ckpt"
    results: dict[int, object] = {}
    go = threading.Barrier(4)

    def writer(i: int) -> None:
        go.wait()
        try:
            ckptkit.save(url, _state(i))
            results[i] = "won"
        except CommitConflict as e:
            results[i] = e

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in results.items() if r == "won"]
    assert len(winners) == 1 and len(results) == 4
    assert all(isinstance(r, CommitConflict) for i, r in results.items() if i != winners[0])
    assert same(ckptkit.load(url).model, _state(winners[0]).model)  # the winner's bytes, never a mix


def test_objects_without_their_record_are_refused_by_load_reported_by_verify_and_cleaned_by_the_next_save(
    s3, capsys, monkeypatch
) -> None:
    """R-O15, R-O16."""
    url = f"{s3}/run/step-00000010.ckpt"
    ckptkit.save(url, _state())
    _client().delete_object(Bucket=_bucket(s3), Key="run/step-00000010.ckpt" + RECORD_SUFFIX)
    with pytest.raises(IncompleteCheckpoint) as e:
        ckptkit.load(url)
    assert str(e.value) == (
        f"{url}: not committed (no commit record step-00000010.ckpt.commit.json; objects without a record: "
        "step-00000010.ckpt); an interrupted save, which the next save removes (R-O15)"
    )
    assert e.value.missing == ("step-00000010.ckpt.commit.json",)
    report = ckptkit.verify(url)
    assert not report.ok and isinstance(report.error, IncompleteCheckpoint)
    assert main(["verify", f"{s3}/run"]) == 1
    assert capsys.readouterr().out == f"FAIL  {e.value}\n"
    with pytest.raises(CommitConflict) as busy:  # as young as a live writer's: not removed yet
        ckptkit.save(url, _state(1))
    assert re.sub(r"newest \d+ s old", "newest N s old", str(busy.value)) == (
        f"{url}: another writer is saving it (1 object(s) without a record, the newest N s old); a save removes "
        "an interrupted save's objects once they are 60 s old, a resume at once (R-O16)"
    )
    monkeypatch.setattr(commit_module, "STALE_AFTER", 0.0)  # ... that much later
    ckptkit.save(url, _state(1))  # the leftover blocks nothing (R-O16)
    assert same(ckptkit.load(url).model, _state(1).model)
    with pytest.raises(ckptkit.CheckpointNotFound, match=r"^s3://.*/run/nothing.ckpt: no such checkpoint$"):
        ckptkit.load(f"{s3}/run/nothing.ckpt")


def test_one_changed_byte_of_an_object_fails_load_and_verify_naming_the_object(s3, capsys) -> None:
    """R-O14, G-51."""
    url = f"{s3}/run/step-00000010.ckpt"
    ckptkit.save(url, _state())
    key = "run/step-00000010.ckpt"
    body = bytearray(_client().get_object(Bucket=_bucket(s3), Key=key)["Body"].read())
    body[-20] ^= 0x01
    _client().put_object(Bucket=_bucket(s3), Key=key, Body=bytes(body))
    with pytest.raises(ckptkit.ChecksumMismatch) as e:
        ckptkit.load(url)
    assert str(e.value).startswith(f"{url}: xxh3: object bytes differ from its commit record (expected ")
    assert main(["verify", f"{s3}/run"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL  {url}: xxh3: object bytes differ from its commit record")


def test_cli_verify_and_inspect_read_a_run_prefix_and_a_checkpoint_object(s3, capsys) -> None:
    for step in (10, 20):
        ckptkit.save(f"{s3}/run/step-{step:08d}.ckpt", _state(step - 10))
    assert main(["verify", f"{s3}/run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[:2] for ln in lines] == [
        ["OK", f"{s3}/run/step-00000010.ckpt"],
        ["OK", f"{s3}/run/step-00000020.ckpt"],
    ]
    assert main(["inspect", f"{s3}/run/step-00000020.ckpt"]) == 0
    assert capsys.readouterr().out.startswith(f"{s3}/run/step-00000020.ckpt: container v2, step 20,")
    assert main(["verify", f"{s3}/empty"]) == 2
    assert "no checkpoint there" in capsys.readouterr().err


def test_cli_inspect_of_a_checkpoint_object_says_the_verdicts_of_its_run_s_resumes(s3, tmp_path, capsys) -> None:
    # The run's history.jsonl is the prefix's object, read through the place as a local run's file is.
    from ckptkit.run._history import History

    ckptkit.save(f"{s3}/run/step-00000010.ckpt", _state())
    h = History(tmp_path)
    h.start_fresh()
    h.append({"kind": "resume_check", "step": 5, "resumed_at": 2, "verdict": "verified", "from": 2, "to": 4})
    h.close()
    _client().put_object(Bucket=_bucket(s3), Key="run/history.jsonl", Body=(tmp_path / "history.jsonl").read_bytes())
    assert main(["inspect", f"{s3}/run/step-00000010.ckpt"]) == 0
    out = capsys.readouterr().out
    assert "run: resume verified: steps 2..4 reproduce the interrupted run bit for bit" in out, out
    assert main(["inspect", f"{s3}/run/step-00000010.ckpt", "--json"]) == 0
    (resume,) = json.loads(capsys.readouterr().out)["resumes"]
    assert resume["verdict"] == "verified" and resume["from"] == 2


# ---------------------------------------------------------------------------- R-O20/R-O21: retries, multipart


def _inject(backend: S3Backend, faults: list[object]):
    """Answer the next requests with ``faults`` (an HTTP status + S3 code, or an exception) before
    they reach the server: botocore's own hook, so the real client parses the real error."""
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ConnectionClosedError

    class _Raw:
        def __init__(self, body: bytes) -> None:
            self.body = body

        def stream(self, **_kw):
            yield self.body

    def before_send(request, **_kw):
        if not faults:
            return None
        fault = faults.pop(0)
        if fault == "reset":
            raise ConnectionClosedError(endpoint_url=request.url)
        status, code = fault
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        return AWSResponse(request.url, status, {}, _Raw(body))

    backend.client.meta.events.register_first("before-send.s3", before_send)
    return before_send


@pytest.mark.parametrize(
    "fault", [(503, "SlowDown"), (500, "InternalError"), "reset"], ids=["503-slowdown", "500", "connection-reset"]
)
def test_transient_failures_of_the_real_client_are_retried_with_backoff(s3, fault) -> None:
    """R-O20, G-54."""
    backend = S3Backend(_bucket(s3))
    store = ObjectStore(backend, backoff=0.001)
    faults = [fault, fault]
    hook = _inject(backend, faults)
    store.put("k", b"payload", if_absent=True)
    assert faults == [] and store.get("k") == b"payload"
    faults += [fault] * 6
    with pytest.raises(ckptkit.UnreadableFile, match=r"^s3://.*/k: get failed 6 times, last: "):
        store.get("k")
    backend.client.meta.events.unregister("before-send.s3", hook)


def test_a_retried_conditional_put_that_meets_its_own_first_attempt_succeeded(s3) -> None:
    """R-O20."""
    backend = S3Backend(_bucket(s3))
    store = ObjectStore(backend, backoff=0.001)

    class FirstAttemptLandsThenResets:
        bucket = backend.bucket
        calls = 0

        def __getattr__(self, name):
            return getattr(backend, name)

        def put(self, key, data, *, if_absent):
            self.calls += 1
            etag = backend.put(key, data, if_absent=if_absent)
            if self.calls == 1:
                from ckptkit.format._objectstore import TransientFault

                raise TransientFault("connection reset after the server stored it")
            return etag

    flaky = ObjectStore(FirstAttemptLandsThenResets(), backoff=0.001)
    flaky.put("rec", b"mine", if_absent=True)  # 412 on the retry, but the object is ours
    with pytest.raises(CommitConflict):
        flaky.put("rec", b"theirs", if_absent=True)
    assert store.get("rec") == b"mine"


def test_a_refused_request_is_not_retried_and_names_the_object(s3) -> None:
    """R-O20."""
    store = ObjectStore(S3Backend("no-such-bucket-ckptkit"), backoff=0.001)
    with pytest.raises(
        ckptkit.SaveFailed, match=r"^s3://no-such-bucket-ckptkit/k: put refused: NoSuchBucket \(HTTP 404\)$"
    ):
        store.put("k", b"x")


def test_a_large_object_goes_up_in_parallel_parts_and_comes_down_in_parallel_ranges(s3) -> None:
    """R-O21."""
    part = 5 << 20  # S3's smallest part
    store = ObjectStore(S3Backend(_bucket(s3)), part_size=part)
    data = os.urandom(2 * part + 12345)
    store.put("big", data, if_absent=True)
    head = _client().head_object(Bucket=_bucket(s3), Key="big")
    assert head["ContentLength"] == len(data) and head["ETag"].endswith('-3"')  # three parts
    with tempfile.TemporaryFile() as f:
        assert store.get_into("big", len(data), f.fileno()) == len(data)
        f.seek(0)
        assert f.read() == data
    with pytest.raises(CommitConflict):
        store.put("big", data[:-1], if_absent=True)  # completing the upload is conditional too


def test_the_s3_extra_and_the_test_server_are_in_the_packaging() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    extras = text[text.index("[project.optional-dependencies]") : text.index("[project.scripts]")]
    assert re.search(r'^s3 = \["boto3>=', extras, re.M)
    test = extras[extras.index("test = [") : extras.index("]\n", extras.index("test = ["))]
    assert '"ckptkit[s3]"' in test and '"moto[server]>=' in test


def test_verify_of_an_s3_checkpoint_runs_in_a_fresh_process_with_only_the_environment(s3) -> None:
    """R-O03: the endpoint and credentials come from the standard AWS variables alone."""
    ckptkit.save(f"{s3}/p/step-00000010.ckpt", _state())
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit", "verify", f"{s3}/p"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith(f"OK    {s3}/p/step-00000010.ckpt"), proc.stderr


def test_the_storage_bench_runs_and_reports_both_backends_and_the_commit_costs(monkeypatch, capsys) -> None:
    """bench/bench_storage.py still runs against what it measures (no timing asserted)."""
    from helpers import load_script

    for var in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(var, "restored-after-the-test")  # the bench points them at its own server
    bench = load_script("bench_storage", Path(__file__).resolve().parents[2] / "bench" / "bench_storage.py")
    assert bench.main(["--size-mb", "1", "--tensors", "2", "--rounds", "1", "--objects", "1,3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    if bench._peer_available():  # the peer, DCP's FsspecWriter/Reader, runs where s3fs is installed
        assert set(out["ratio"]) == {"save", "load"} and out["peer"] is None
        assert set(out["seconds"]) == {"ckptkit_save", "dcp_save", "ckptkit_load", "dcp_load"}
    else:  # CI's test extra has no s3fs (see bench_storage.PEER_MISSING): ckptkit is measured, the peer named
        assert out["ratio"] == {} and out["peer"] == bench.PEER_MISSING
        assert set(out["seconds"]) == {"ckptkit_save", "ckptkit_load"}
    assert out["commit"]["record_1_objects_bytes"] < out["commit"]["record_3_objects_bytes"]
