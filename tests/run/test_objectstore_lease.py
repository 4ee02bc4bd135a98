"""The run-directory lease on object storage (spec/lease.md R-LS10..R-LS13), against the real S3
HTTP server: ``lease.json`` is created with ``If-None-Match: *``, renewed and taken over with
``If-Match`` on its ETag, released with a conditional DELETE; ``ckptkit train --run-dir s3://...``
while another job holds the prefix exits 1 naming it, and over a gone holder it takes over, saying so.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import boto3
import pytest
import torch
from helpers import TINY_FLAGS

from ckptkit import LeaseLost, RunDirInUse, RunState
from ckptkit.cli import main
from ckptkit.format import _objectstore as objectstore
from ckptkit.format._objectstore import Backend
from ckptkit.format._urls import parse
from ckptkit.run._lease import LEASE_FILE, Holder, lease_for, this_job

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _holder(**changes: Any) -> Holder:
    base = {"host": "elsewhere", "pid": 4242, "started": time.time(), "ranks": 2, "launcher": 4241}
    return Holder(**{**base, "heartbeat": time.time(), "token": "t" * 32, **changes})


def _put(run: str, body: bytes | Holder) -> None:
    url = parse(run).child(LEASE_FILE)
    data = json.dumps(body.__dict__).encode() if isinstance(body, Holder) else body
    boto3.client("s3").put_object(Bucket=url.bucket, Key=url.key, Body=data)


def _exists(run: str) -> bool:
    url = parse(run).child(LEASE_FILE)
    return "Contents" in boto3.client("s3").list_objects_v2(Bucket=url.bucket, Prefix=url.key)


def test_an_object_lease_is_held_once_renewed_on_its_etag_and_never_removes_anothers(s3) -> None:
    """R-LS10, R-LS11, R-LS12, R-LS13, G-80."""
    run = f"{s3}/unit"
    mine = lease_for(run, ttl_s=100)
    assert mine.holder() is None and mine.acquire(this_job(1)) is None and mine.holder() == mine.mine
    live = _holder(host=socket.gethostname(), pid=os.getppid())  # a live process of this host
    with pytest.raises(RunDirInUse, match=rf"^{run}: in use by another job, pid {os.getpid()} on ") as e:
        lease_for(run).acquire(live)
    assert e.value.holder == mine.mine
    assert mine.acquire(this_job(1)) is None  # this same process again: silently its own (R-LS05)
    mine.refresh()
    assert mine.holder() == mine.mine  # renewed over the ETag it wrote
    _put(run, live)  # another job took it over under this one
    with pytest.raises(LeaseLost, match=rf"^{run}: this job no longer holds .* \(it is held by pid {os.getppid()} "):
        mine.refresh()
    mine.release()
    assert mine.holder() == live  # a job that lost the lease never removes another's
    _put(run, _holder(heartbeat=time.time() - 150))  # another host's, its heartbeat expired
    said = mine.acquire(this_job(1))
    assert said is not None and said.startswith("took over the run directory's lease from pid 4242 on elsewhere")
    assert said.endswith("(the lease lives 100 s)")
    mine.release()
    assert not _exists(run)
    _put(run, b"not json")
    with pytest.raises(RunDirInUse) as bad:
        mine.acquire(this_job(1))
    assert str(bad.value) == (
        f"{run}/{LEASE_FILE}: the run directory's lease is not a lease ckptkit wrote (not a flat JSON object, R-LS15); "
        f"if no job uses {run}, delete it and start again"
    )


def test_a_takeover_loses_to_a_renewal_between_its_read_and_its_conditional_put(s3) -> None:
    """R-LS12: the If-Match put over the ETag judged gone decides; the loser refuses and writes nothing."""
    run = f"{s3}/race"
    _put(run, _holder(heartbeat=time.time() - 150))
    renewed = _holder(heartbeat=time.time())

    class RenewedInBetween:
        def __init__(self, inner: Backend) -> None:
            self.inner, self.bucket = inner, inner.bucket

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def replace(self, key: str, data: bytes, etag: str) -> str:
            self.inner.put(key, json.dumps(renewed.__dict__).encode(), if_absent=False)  # the holder woke up
            return self.inner.replace(key, data, etag)

    with objectstore.intercept(RenewedInBetween), pytest.raises(RunDirInUse) as e:
        lease_for(run, ttl_s=100).acquire(this_job(1))
    assert str(e.value) == f"{run}: another job took the lease over while this one did"
    assert e.value.holder == renewed and lease_for(run).holder() == renewed


def test_train_on_s3_refuses_a_prefix_in_use_takes_a_gone_holders_over_and_a_state_that_lost_it_writes_nothing(
    s3, capsys
) -> None:
    """R-LS03, R-LS04, R-LS06, R-LS09 on object storage; G-81."""
    run = f"{s3}/demo"
    live = _holder(host=socket.gethostname(), pid=os.getppid(), ranks=1, launcher=None)
    _put(run, live)
    argv = ["train", "--run-dir", run, *TINY_FLAGS, "--threads", "1", "--steps", "2", "--ckpt-every", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"ckptkit train: {run}: in use by another job, pid {os.getppid()} on {socket.gethostname()} (1 rank(s); "
    ), err
    _put(run, _holder(heartbeat=time.time() - 7 * 3600))  # another host's, silent for longer than the 6 h lease
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "took over the run directory's lease from pid 4242 on elsewhere (2 rank(s), launcher pid 4241;" in err
    assert not _exists(run)  # released when the job ended

    other = f"{s3}/state"
    state = RunState(other, config={"lr": 0.1})
    state.add_model("net", torch.nn.Linear(2, 2))
    state.start()
    state.save(1)
    _put(other, live)
    with pytest.raises(LeaseLost, match=rf"^{other}: this job no longer holds the run directory's lease"):
        state.save(2)
    assert [s for s, _p in state.checkpoints()] == [1]  # nothing written
    assert main(["verify", other]) == 0  # the lease object is no checkpoint (R-LS09)
    assert LEASE_FILE not in capsys.readouterr().out
    state.close()
    assert lease_for(other).holder() == live
