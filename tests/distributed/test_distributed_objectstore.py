"""ckptkit.distributed on object storage, in one process against the real S3 HTTP server
(spec/objectstore.md R-O30..R-O34). Two nodes that share no filesystem: tests/run/test_multinode.py."""

from __future__ import annotations

import os

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

import ckptkit
import ckptkit.distributed as ckd
from ckptkit.errors import ChecksumMismatch, CommitConflict, IncompleteCheckpoint, UnsupportedOption
from ckptkit.format._commit import Entry, encode_record
from ckptkit.format._objectstore import StoreUnavailable


def state_of() -> dict:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}, "step": 7, "names": ["a"]}


def _blank() -> dict:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "step": 0, "names": []}


def _objects(url: str) -> dict[str, bytes]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {k[len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _put(url: str, rel: str, data: bytes) -> None:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=data)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP itself in one process
def test_a_distributed_checkpoint_on_s3_is_the_local_files_as_objects_listed_by_one_record(s3, tmp_path) -> None:
    """R-O30, R-O31, R-O18, R-DC22: the objects hold the local files' bytes; the record lists each with
    size and xxh3."""
    ckd.save(state_of(), f"{s3}/ck/step-1", companions={"config.json": b'{"lr": 1}\n'})
    ckd.save(state_of(), tmp_path / "step-1")
    objects = _objects(f"{s3}/ck")
    assert sorted(objects) == ["step-1", "step-1.commit.json", "step-1.config.json", "step-1.rank-00000.ckdcp"]
    assert objects["step-1"] == (tmp_path / "step-1" / "metadata.ckdcp").read_bytes()
    assert objects["step-1.rank-00000.ckdcp"] == (tmp_path / "step-1" / "rank-00000.ckdcp").read_bytes()
    listed = {k: v for k, v in objects.items() if k != "step-1.commit.json"}
    entries = [Entry(k, len(v), xxhash.xxh3_64_intdigest(v)) for k, v in listed.items()]
    assert objects["step-1.commit.json"] == encode_record("step-1", entries)
    out = _blank()
    ckd.load(out, f"{s3}/ck/step-1")
    assert torch.equal(out["model"]["w"], state_of()["model"]["w"]) and out["step"] == 7 and out["names"] == ["a"]
    dcp_out = _blank()  # DCP itself, through the Writer/Reader classes
    dcp.load(dcp_out, storage_reader=ckd.Reader(f"{s3}/ck/step-1"))
    assert torch.equal(dcp_out["model"]["b"], torch.ones(4))


def test_a_committed_s3_checkpoint_is_written_once_whatever_overwrite_says(s3) -> None:
    """R-O32, R-DC25: a second save of a committed id commits nothing and changes nothing."""
    ckd.save(state_of(), f"{s3}/ck/step-1")
    before = _objects(f"{s3}/ck")
    with pytest.raises(CommitConflict) as e:
        ckd.save({**state_of(), "step": 8}, f"{s3}/ck/step-1", overwrite=True)
    assert str(e.value) == (
        f"{s3}/ck/step-1.commit.json: step already committed; a checkpoint on object storage is written once "
        "(R-O11): delete it first, or save under another name"
    )
    assert _objects(f"{s3}/ck") == before


def test_a_load_trusts_only_what_the_record_lists_and_names_each_object_it_refuses(s3) -> None:
    """R-O15, R-O33, R-DC23, R-DC24: no record; a changed byte; a rank file the record does not list."""
    url = f"{s3}/ck/step-1"
    ckd.save(state_of(), url)
    objects = _objects(f"{s3}/ck")
    meta = objects["step-1"]
    _put(f"{s3}/ck", "step-1", meta[:-9] + bytes([meta[-9] ^ 1]) + meta[-8:])
    with pytest.raises(ChecksumMismatch) as bad:
        ckd.load(_blank(), url)
    assert bad.value.path == url and "differ from its commit record" in str(bad.value)  # R-O14
    _put(f"{s3}/ck", "step-1", meta)
    good = objects["step-1.rank-00000.ckdcp"]
    _put(f"{s3}/ck", "step-1.rank-00000.ckdcp", good[: len(good) // 2])
    with pytest.raises(ckptkit.FormatError) as short:
        ckd.load(_blank(), url)
    assert short.value.path == f"{url}.rank-00000.ckdcp" and f"the {len(good)} bytes its commit record" in str(
        short.value
    )
    _put(f"{s3}/ck", "step-1.rank-00000.ckdcp", good)
    meta = objects["step-1"]
    _put(
        f"{s3}/ck",
        "step-1.commit.json",
        encode_record("step-1", [Entry("step-1", len(meta), xxhash.xxh3_64_intdigest(meta))]),
    )
    with pytest.raises(IncompleteCheckpoint) as unlisted:
        ckd.load(_blank(), url)
    assert str(unlisted.value) == (
        f"{url}: step-1.rank-00000.ckdcp (rank 0) is not listed by its commit record step-1.commit.json (R-O33)"
    )
    boto3.client("s3").delete_object(Bucket=s3.removeprefix("s3://"), Key="ck/step-1.commit.json")
    with pytest.raises(IncompleteCheckpoint) as uncommitted:
        ckd.load(_blank(), url)
    assert str(uncommitted.value) == (
        f"{url}: not committed (no commit record step-1.commit.json; objects without a record: step-1, "
        "step-1.rank-00000.ckdcp); an interrupted save, which the next save removes (R-O15)"
    )
    with pytest.raises(ckptkit.CheckpointNotFound, match=rf"^{s3}/ck/step-9: no such checkpoint$"):
        ckd.load(_blank(), f"{s3}/ck/step-9")


def test_companions_are_committed_with_an_object_checkpoint_only(tmp_path) -> None:
    with pytest.raises(UnsupportedOption) as e:
        ckd.Writer(tmp_path / "c", companions={"config.json": b"{}"})
    assert str(e.value) == (
        f"{tmp_path / 'c'}: companions are committed with a checkpoint on object storage only (R-O30); beside a "
        "local directory write them as files"
    )


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize("mode", ["error", "crash", "transient"])
def test_a_distributed_save_failing_at_every_request_commits_whole_or_nothing_and_blocks_no_next_save(
    s3, mode, monkeypatch
) -> None:
    """R-O31, R-O34 (G-53 for ckptkit.distributed): for every k, a failure, a crash or a transient
    fault at the k-th storage request of a save leaves the checkpoint loaded whole or refused as not
    committed (never partial), and the next save of it commits."""
    from _store_faults import requests_of, under

    from ckptkit.format import _commit as commit_module

    monkeypatch.setattr(commit_module, "STALE_AFTER", 0.0)  # the next save comes later (R-O16)
    n = requests_of(lambda: ckd.save(state_of(), f"{s3}/count/step-1"))
    assert n == 7  # HEAD record, LIST leftovers, PUT rank file, PUT metadata, HEAD both (still ours), PUT record
    for k in range(1, n + 1):
        url = f"{s3}/ck/step-{k}"
        _r, error, _made = under(k, mode, lambda: ckd.save(state_of(), url))  # noqa: B023 - called at once
        out, refused = _blank(), None
        try:
            ckd.load(out, url)
        except ckptkit.CheckpointNotFound as e:  # IncompleteCheckpoint included: no record, nothing loaded
            refused = e
        if refused is not None:
            assert error is not None, f"request {k}: the save returned but {url} is not loadable: {refused}"
            ckd.save(state_of(), url)  # what it left does not block the next save
            ckd.load(out, url)
        assert torch.equal(out["model"]["w"], state_of()["model"]["w"]) and out["step"] == 7, k
        assert mode != "transient" or error is None, f"request {k}: a transient fault was not retried: {error}"


@pytest.mark.slow
def test_each_rank_of_a_sharded_resume_fetches_its_share_of_the_checkpoint_not_every_rank_file(
    pool, s3, tmp_path
) -> None:
    """R-O33, G-60: an FSDP2 + AdamW state of 3 MiB saved by 2 ranks and loaded back by them; each
    rank GETs the record, the metadata and the byte ranges of the chunks its plan reads: about half
    of the data, though AdamW's replicated step counters lie in both rank files. A 1-process load
    of the same checkpoint (a reshard) reads every chunk and gets the state bitwise. A load of an
    uncommitted checkpoint is listed by rank 0 alone."""
    from _dist_workers import assert_same, load_unsharded, wide

    url = f"{s3}/ck/step-1"
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    (saved, fetched0, loaded), (_, fetched1, _) = pool.run("fsdp_s3_fetched", url, env)
    assert_same(saved, loaded)  # rank 0's full view, gathered from both ranks' shards
    sizes = {k: len(v) for k, v in _objects(f"{s3}/ck").items()}
    data = sizes["step-1.rank-00000.ckdcp"] + sizes["step-1.rank-00001.ckdcp"]
    assert data > 3 << 20
    for fetched in (fetched0, fetched1):
        assert fetched["ck/step-1.commit.json"] == sizes["step-1.commit.json"]
        assert fetched["ck/step-1"] == sizes["step-1"]  # the metadata, checked whole against the record
        ranks = fetched.get("ck/step-1.rank-00000.ckdcp", 0) + fetched.get("ck/step-1.rank-00001.ckdcp", 0)
        assert 0.4 * data < ranks <= 0.6 * data, (fetched0, fetched1, data)
    assert_same(saved, load_unsharded(wide(7), url))
    _put(f"{s3}/ck", "step-2.rank-00000.ckdcp", b"left by a save that did not commit")
    (error0, lists0), (error1, lists1) = pool.run("s3_load_uncommitted", f"{s3}/ck/step-2", env)
    assert (lists0, lists1) == (1, 0)  # rank 0 alone lists what the save left (R-O33)
    assert error0 == (
        f"IncompleteCheckpoint: {s3}/ck/step-2: not committed (no commit record step-2.commit.json; objects "
        "without a record: step-2.rank-00000.ckdcp); an interrupted save, which the next save removes (R-O15)"
    )
    assert error1 == (
        f"CheckpointNotFound: {s3}/ck/step-2: no commit record step-2.commit.json: not committed, or no such "
        "checkpoint; the coordinator's error names which (R-O15)"
    )


def test_a_damaged_byte_inside_a_chunk_read_by_range_is_refused_naming_the_object(s3) -> None:
    """R-O33, R-DC07: the load GETs the chunk's byte range alone (not the object, whose digest in
    the record would catch it) and checks it against the chunk's digest in the checked metadata."""
    url = f"{s3}/ck/step-1"
    ckd.save(state_of(), url)
    rank = bytearray(_objects(f"{s3}/ck")["step-1.rank-00000.ckdcp"])
    at = bytes(rank).index(state_of()["model"]["w"].numpy().tobytes())
    rank[at + 20] ^= 0x10
    _put(f"{s3}/ck", "step-1.rank-00000.ckdcp", bytes(rank))
    with pytest.raises(ChecksumMismatch) as bad:
        ckd.load(_blank(), url)
    assert str(bad.value).startswith(
        f"{url}.rank-00000.ckdcp: offset {at} (0x{at:x}): tensor 'model.w' chunk at [0, 0] of [3, 4] (48 bytes): "
        "digest does not match"
    )
    assert str(bad.value).endswith("the rank data file is damaged; load an earlier checkpoint (R-DC07)")


def test_a_throttled_ranged_read_is_retried_and_a_persistent_one_named(s3, store_proxy) -> None:
    """R-O33, R-O20, R-O50: a ranged GET of a rank file answered 503 SlowDown is retried like every
    request; one that never succeeds is StoreUnavailable naming the object and the range."""
    url = f"{s3}/ck/step-1"
    ckd.save(state_of(), url)
    store_proxy.fail("GET", times=3, containing="rank-00000")
    out = _blank()
    ckd.load(out, url)
    assert torch.equal(out["model"]["w"], state_of()["model"]["w"]) and out["step"] == 7
    assert [k for k, p in store_proxy.seen if "rank-00000" in p] == ["PUT", "HEAD", "GET", "GET", "GET", "GET"]
    store_proxy.fail("GET", containing="rank-00000")
    with pytest.raises(StoreUnavailable) as e:
        ckd.load(_blank(), url)
    assert str(e.value).startswith(f"{url}.rank-00000.ckdcp: range ")
    assert "failed 6 times, last: SlowDown (HTTP 503)" in str(e.value)


def test_a_rank_file_is_read_in_windows_fetched_ahead_and_a_read_out_of_order_is_right(s3, monkeypatch) -> None:
    """R-O33, R-O51: windows of RANGE_WINDOW bytes (made tiny here) fetched ahead of the reads in
    file order; a load reads right through many of them, and a read behind them is fetched again."""
    from ckptkit.distributed import _objects as objects

    monkeypatch.setattr(objects, "RANGE_WINDOW", 40)
    url = f"{s3}/ck/step-1"
    ckd.save(state_of(), url)
    out = _blank()
    ckd.load(out, url)
    assert torch.equal(out["model"]["w"], state_of()["model"]["w"]) and torch.equal(out["model"]["b"], torch.ones(4))
    body = _objects(f"{s3}/ck")["step-1.rank-00000.ckdcp"]
    remote = objects.RemoteCheckpoint.at(url)
    ranges = remote.ranges(remote.entries(), 0, [(0, len(body))])
    try:
        for start in (len(body) - 50, 0, 130, 5):
            buf = bytearray(50)
            ranges.readinto(start, memoryview(buf))
            assert bytes(buf) == body[start : start + 50], start
    finally:
        ranges.close()
