"""The store is trusted only after it is checked (spec/objectstore.md R-O49, guarantee G-57).

Before this process's first conditional write to a bucket, two racing ``If-None-Match: *``
PUTs of a probe key must give one success and one 412, and a GET after must see the winner.
A store that ignores the header -- here the tests' S3 server behind :class:`StoreProxy`,
which drops it -- is refused before anything is written; ``--single-writer-store``
(``CKPTKIT_SINGLE_WRITER_STORE=1``) skips the check, and the run's history records that.
"""

from __future__ import annotations

import json
import os
from typing import Any

import boto3
import pytest
import torch
from helpers import TINY_FLAGS

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import UnsupportedOption
from ckptkit.format._objectstore import PROBE_PREFIX, SINGLE_WRITER_ENV, ObjectMissing, ObjectStore, S3Backend
from ckptkit.format._urls import parse

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _keys(s3_server: str, s3: str) -> list[str]:
    """Every key in ``s3``'s bucket, read from the server itself (not through the proxy)."""
    page = boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket=parse(s3).bucket)
    return sorted(o["Key"] for o in page.get("Contents", []))


def _state() -> ckptkit.Checkpoint:
    return ckptkit.Checkpoint(step=1, model={"w": torch.arange(6.0)})


def test_a_store_that_ignores_if_none_match_is_refused_before_anything_is_written(
    s3, s3_server, store_proxy, capsys
) -> None:
    """R-O49, G-57: one line naming the endpoint, what failed and what to do; exit 2; the prefix stays empty."""
    store_proxy.ignore_if_none_match = True
    code = main(["train", "--run-dir", f"{s3}/run", *TINY_FLAGS, "--steps", "2", "--quiet"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1, err
    bucket = parse(s3).bucket
    assert err[0].startswith(
        f"ckptkit train: {store_proxy.url} (bucket {bucket}): the store does not enforce conditional writes: "
        f"2 of 2 racing If-None-Match: * PUTs of {s3}/run/{PROBE_PREFIX}"
    ), err
    assert err[0].endswith(
        " succeeded (expected 1, and 412 PreconditionFailed for the other); ckptkit's commit and run lease "
        "rely on them (R-O49): use a store that enforces If-None-Match, or, if only one job at a time ever "
        f"writes there, set {SINGLE_WRITER_ENV}=1 (ckptkit train --single-writer-store)"
    ), err
    assert _keys(s3_server, s3) == []  # no lease, no environment record, no probe left
    with pytest.raises(UnsupportedOption, match=r"R-O49"):  # the verdict is kept for the process
        ckptkit.save(f"{s3}/other/model.ckpt", _state())
    assert [k for k, _ in store_proxy.seen].count("PUT") == 2  # only the probe's two racers ever went up
    assert _keys(s3_server, s3) == []


def test_a_conforming_store_is_checked_once_per_bucket_and_the_probe_is_removed(s3, s3_server, store_proxy) -> None:
    """R-O49: two racing PUTs of one probe key, once for the process; then the saves as before."""
    ckptkit.save(f"{s3}/a/model.ckpt", _state())
    ckptkit.save(f"{s3}/b/model.ckpt", _state())
    probes = [p for k, p in store_proxy.seen if PROBE_PREFIX in p]
    assert [k for k, p in store_proxy.seen if PROBE_PREFIX in p] == ["PUT", "PUT", "GET", "DELETE"]
    assert len(set(probes)) == 1 and f"/a/{PROBE_PREFIX}" in probes[0]  # beside the first object written
    assert not any(PROBE_PREFIX in k for k in _keys(s3_server, s3))
    assert torch.equal(ckptkit.load(f"{s3}/b/model.ckpt").model["w"], _state().model["w"])
    client = boto3.client("s3", endpoint_url=s3_server)
    client.put_object(Bucket=parse(s3).bucket, Key=f"c/{PROBE_PREFIX}0", Body=b"x")  # what a killed probe leaves
    rs = ckptkit.RunState(f"{s3}/c", config={"lr": 0.1})
    assert not rs.never_saved()  # no sign that a run began there
    rs.close()


def test_a_store_whose_read_after_write_misses_the_object_is_refused(s3) -> None:
    """R-O49: the winner's bytes must be readable at once (R-O19's read-after-write)."""

    class Forgets:  # the conditional put is enforced, but a GET right after finds nothing
        def __init__(self, inner: S3Backend) -> None:
            self.inner, self.bucket, self.endpoint = inner, inner.bucket, "http://forgetful.invalid"

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
            raise ObjectMissing("NoSuchKey (HTTP 404)")

    forgets = Forgets(S3Backend(parse(s3).bucket))
    with pytest.raises(UnsupportedOption) as e:
        ObjectStore(forgets, probe=forgets).put("run/step.ckpt", b"x", if_absent=True)  # type: ignore[arg-type]
    assert str(e.value).startswith(
        f"http://forgetful.invalid (bucket {parse(s3).bucket}): the store does not enforce conditional writes: "
        f"a GET of {s3}/run/{PROBE_PREFIX}"
    )
    assert "right after its PUT did not return the bytes written; " in str(e.value)


def test_single_writer_store_skips_the_check_and_the_history_records_it(s3, s3_server, store_proxy, capsys) -> None:
    """R-O49: the user's promise replaces the check, in a row of the run's history (trainer.md)."""
    store_proxy.ignore_if_none_match = True
    flags = ["train", "--run-dir", f"{s3}/run", *TINY_FLAGS, "--steps", "2", "--quiet"]
    assert main([*flags, "--single-writer-store"]) == 0, capsys.readouterr().err
    assert not any(PROBE_PREFIX in p for _k, p in store_proxy.seen)
    assert SINGLE_WRITER_ENV not in os.environ  # the flag holds for its call only
    body = boto3.client("s3", endpoint_url=s3_server).get_object(Bucket=parse(s3).bucket, Key="run/history.jsonl")
    rows = [json.loads(line) for line in body["Body"].read().splitlines()]
    (row,) = [r for r in rows if r["kind"] == "unchecked_store"]
    assert row == {"kind": "unchecked_store", "step": 2, "run_dir": f"{s3}/run", "vouched": f"{SINGLE_WRITER_ENV}=1"}
    assert rows[0]["kind"] == "start"
    (extend,) = [line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("extend ")]
    assert extend.endswith(" --single-writer-store")  # the next call repeats the promise
