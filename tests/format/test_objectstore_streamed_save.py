"""A save to ``s3://`` uploads each part of the container (and a distributed save each part of a rank's
data file) while it is still being written (spec/objectstore.md R-O52), against the tests' S3 server
on 127.0.0.1 (tests/conftest.py ``s3``).

The parts are 5 MiB (S3's smallest) and the container about 5 parts, so that the writer is seen
mid-write: a wrapper between the store and the client logs every request, and the container
writer's ``write_all`` waits (20 s at most, never forever) for an UploadPart once it is 3 parts in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
import torch
from helpers import same

import ckptkit
import ckptkit.distributed as ckd
from ckptkit.distributed import _format as dcp_format
from ckptkit.format import _container
from ckptkit.format import _objectstore as objectstore
from ckptkit.format._commit import RECORD_SUFFIX
from ckptkit.format._objectstore import Backend, RequestRefused, intercept
from ckptkit.format._urls import parse

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # botocore's pooled sockets at exit

PART = 5 << 20


class Logged:
    """``inner``, logging each request's name into ``watch.log`` (an UploadPart as ``part N``);
    ``watch.fail_part`` is refused while ``watch.failing``."""

    def __init__(self, inner: Backend, watch: Watch) -> None:
        self.inner, self.bucket, self.watch = inner, inner.bucket, watch

    def put_part(self, key: str, upload: str, number: int, data: Any) -> str:
        self.watch.log.append(f"part {number}")
        self.watch.sent_at.setdefault(number, self.watch.position)
        self.watch.sent[number].set()
        self.watch.sent[0].set()
        if number == self.watch.fail_part and self.watch.failing:
            raise RequestRefused(f"injected failure of part {number}")
        return self.inner.put_part(key, upload, number, data)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        op = getattr(self.inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            self.watch.log.append(name)
            return op(*args, **kw)

        return call


def _state(mib: int, seed: int = 0) -> ckptkit.Checkpoint:
    g = torch.Generator().manual_seed(seed)
    return ckptkit.Checkpoint(step=seed, model={"net": {"w": torch.randn(mib << 18, generator=g)}})


class Watch:
    """What the fixture ``watched`` sees: ``log`` of every request (``"written"`` once the container
    writer returned) and ``seen``, whether the writer, 3 parts in, saw UploadPart number
    ``wait_for`` (0: any) within 20 s (appended once); ``sent_at``, how far the writer had written
    when each part was first sent. ``fail_part`` is refused; ``failing`` is False to stop refusing it."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.seen: list[bool] = []
        self.wait_for = 0
        self.position = 0
        self.sent_at: dict[int, int] = {}
        self.sent = [threading.Event() for _ in range(64)]
        self.fail_part: int | None = None
        self.failing = True


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watch]:
    """Parts of :data:`PART` bytes; every store's requests go through :class:`Logged` into a
    :class:`Watch`, and the container writer waits for an UploadPart once 3 parts are written."""
    watch = Watch()
    monkeypatch.setattr(objectstore, "PART_SIZE", PART)
    write_all, write_framed = _container.write_all, _container.write_framed

    def waiting_write_all(fd: int, buf: memoryview) -> None:
        write_all(fd, buf)
        watch.position = os.lseek(fd, 0, os.SEEK_CUR)
        if not watch.seen and watch.position >= 3 * PART:
            watch.seen.append(watch.sent[watch.wait_for].wait(20))

    def logged_write_framed(*args: Any) -> int:
        digest = write_framed(*args)
        watch.log.append("written")
        return digest

    monkeypatch.setattr(_container, "write_all", waiting_write_all)
    monkeypatch.setattr(_container, "write_framed", logged_write_framed)
    monkeypatch.setattr(dcp_format, "write_framed", logged_write_framed)  # a rank's data file
    with intercept(lambda inner: Logged(inner, watch)):
        yield watch


def _objects(s3: str) -> tuple[list[str], list[str]]:
    """The bucket's keys and its multipart uploads in progress."""
    client, bucket = boto3.client("s3"), parse(s3).bucket
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    uploads = [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    return sorted(keys), uploads


def test_a_save_uploads_its_first_parts_before_the_container_is_written(s3: str, watched: Watch, tmp_path) -> None:
    """R-O52: the writer, 3 parts in, sees an UploadPart; the part holding the section's index
    (rewritten with its digests after the section's data) goes up only once all the data is
    written, and the object is byte for byte the local file (R-O18)."""
    log, seen = watched.log, watched.seen
    state = _state(24)
    ckptkit.save(f"{s3}/run/a.ckpt", state)
    assert seen == [True]  # an UploadPart came while the writer waited, 3 of ~5 parts in
    assert "part 2" in log[: log.index("written")]
    assert watched.sent_at[1] >= 24 << 20  # part 1 holds the model index: held until its data is written
    assert log.index("start_multipart") < log.index("part 2")
    assert log.count("finish_multipart") == 1 and log.index("finish_multipart") > log.index("written")
    local = tmp_path / "a.ckpt"
    ckptkit.save(local, state)
    body = boto3.client("s3").get_object(Bucket=parse(s3).bucket, Key="run/a.ckpt")["Body"].read()
    assert body == local.read_bytes()
    assert same(ckptkit.load(f"{s3}/run/a.ckpt").model, state.model)


def test_a_section_index_goes_up_once_its_section_is_written_before_the_next_section_is(
    s3: str, watched: Watch, tmp_path
) -> None:
    """R-O52: the model index's part is sent when the model's data is written, while the optimizer's
    is being written, with the index's final digests (the object is the local file's bytes)."""
    watched.wait_for = 1
    g = torch.Generator().manual_seed(5)
    state = ckptkit.Checkpoint(
        step=5, model={"w": torch.randn(12 << 18, generator=g)}, optim={"m": torch.randn(12 << 18, generator=g)}
    )
    ckptkit.save(f"{s3}/run/two.ckpt", state)
    assert watched.seen == [True]  # the writer, in the optimizer's data, saw part 1 go up
    assert watched.sent_at[1] >= 12 << 20  # after the model's 12 MiB
    local = tmp_path / "two.ckpt"
    ckptkit.save(local, state)
    body = boto3.client("s3").get_object(Bucket=parse(s3).bucket, Key="run/two.ckpt")["Body"].read()
    assert body == local.read_bytes()


def test_a_distributed_save_uploads_a_rank_file_while_it_is_written(s3: str, watched: Watch) -> None:
    """R-O52, R-O31: the same for a rank's data file, whose index is also held to the end."""
    state = {"w": torch.randn(24 << 18, generator=torch.Generator().manual_seed(3))}
    ckd.save(state, f"{s3}/ck/step-1")
    assert watched.seen == [True]
    assert "part 2" in watched.log[: watched.log.index("written")]
    assert watched.sent_at[1] >= 24 << 20  # its index, held until its data is written
    into = {"w": torch.zeros(24 << 18)}
    ckd.load(into, f"{s3}/ck/step-1")
    assert torch.equal(into["w"], state["w"])


def test_a_run_uploads_its_step_file_while_it_is_written(s3: str, watched: Watch) -> None:
    """R-O52, R-O22: a one-process run's container streams up as ``save``'s does; its companions follow."""
    net = torch.nn.Module()
    net.w = torch.nn.Parameter(torch.randn(24 << 18, generator=torch.Generator().manual_seed(4)))
    rs = ckptkit.RunState(f"{s3}/run", config={}, keep=1)
    rs.add_model("net", net)
    rs.start()
    rs.save(1)
    rs.close()
    assert watched.seen == [True]
    assert "part 2" in watched.log[: watched.log.index("written")]
    assert watched.sent_at[1] >= 24 << 20
    again = torch.nn.Module()
    again.w = torch.nn.Parameter(torch.zeros(24 << 18))
    rs = ckptkit.RunState(f"{s3}/run", config={}, keep=1)
    rs.add_model("net", again)
    assert rs.resume().step == 1
    rs.close()
    assert torch.equal(again.w, net.w)


def test_a_small_checkpoint_is_one_conditional_put(s3: str, watched: Watch) -> None:
    """R-O52: at most one part, the object is not multipart."""
    log, seen = watched.log, watched.seen
    ckptkit.save(f"{s3}/run/small.ckpt", _state(1))
    assert seen == [] and "start_multipart" not in log and log.count("put") == 2  # the object, then its record
    assert same(ckptkit.load(f"{s3}/run/small.ckpt").model, _state(1).model)


def test_a_part_failing_mid_write_aborts_the_upload_and_commits_nothing(s3: str, watched: Watch) -> None:
    """R-O52, R-O15: the failed UploadPart fails the save, the upload is aborted, no object and no
    record of the save exist, the checkpoint saved before is untouched, and the name is saved again."""
    before = _state(1, seed=1)
    ckptkit.save(f"{s3}/run/a.ckpt", before)
    log, watched.fail_part = watched.log, 2
    with pytest.raises(ckptkit.SaveFailed, match=r"s3://.*/run/b\.ckpt: part 2 refused: injected failure of part 2"):
        ckptkit.save(f"{s3}/run/b.ckpt", _state(24))
    assert "abort_multipart" in log and "finish_multipart" not in log
    keys, uploads = _objects(s3)
    assert keys == ["run/a.ckpt", "run/a.ckpt" + RECORD_SUFFIX] and uploads == []
    assert same(ckptkit.load(f"{s3}/run/a.ckpt").model, before.model)
    watched.failing = False
    ckptkit.save(f"{s3}/run/b.ckpt", _state(24))
    assert same(ckptkit.load(f"{s3}/run/b.ckpt").model, _state(24).model)


def test_a_writer_failing_after_parts_went_up_aborts_the_upload_and_commits_nothing(
    s3: str, watched: Watch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-O52: parts sent before the writer's own failure are dropped with the upload."""
    log, seen = watched.log, watched.seen
    write_all = _container.write_all

    def failing(fd: int, buf: memoryview) -> None:
        write_all(fd, buf)
        if seen:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(_container, "write_all", failing)
    with pytest.raises(
        ckptkit.SaveFailed, match=r"/run/c\.ckpt: writing its local spool file failed \(ENOSPC: No space left"
    ):
        ckptkit.save(f"{s3}/run/c.ckpt", _state(24))
    assert seen == [True] and "abort_multipart" in log and "finish_multipart" not in log
    assert _objects(s3) == ([], [])
