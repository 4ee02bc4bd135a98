"""Throttling and server errors on every request type (spec/objectstore.md R-O20, R-O50; G-58).

The tests' S3 server sits behind :class:`StoreProxy`, which answers chosen requests with
``503 SlowDown``, as a bucket does when 512 ranks LIST at once (dlio_benchmark#348). A burst
is survived with bounded, jittered backoff; a persistent one ends in an error naming the
object or prefix and the rule. A LIST that fails is never an empty listing: a resume refuses
instead of saying "no checkpoint" or starting fresh, and a read of the newest step that
keeps failing stops the resume instead of passing the step over as damaged.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
from _store_faults import run_state, saved

from ckptkit.cli import main
from ckptkit.errors import SaveFailed
from ckptkit.format import _objectstore as objectstore
from ckptkit.format._objectstore import ObjectStore, StoreUnavailable, store_for
from ckptkit.format._urls import parse

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

_RULE = "; the store is throttling (503 SlowDown) or failing (R-O50): try again once it answers"

#: Each request type, as the store makes it: (the operation's name in messages, the call).
_OPS: dict[str, tuple[str, Callable[[ObjectStore, str], Any]]] = {
    "PUT": ("put", lambda store, key: store.put(key, b"payload")),
    "GET": ("get", lambda store, key: store.get(key)),
    "HEAD": ("head", lambda store, key: store.head(key)),
    "LIST": ("list", lambda store, key: store.list(key)),
    "DELETE": ("delete", lambda store, key: store.delete(key)),
}


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The store's backoff waits, recorded instead of slept."""
    waited: list[float] = []
    monkeypatch.setattr(objectstore, "time", types.SimpleNamespace(sleep=waited.append))
    return waited


def test_every_request_type_survives_a_burst_of_slowdown_and_a_persistent_one_names_the_object_and_rule(
    s3, store_proxy, sleeps
) -> None:
    """R-O20, R-O50: 5 SlowDowns in a row are retried; 6 are an error (a write's SaveFailed,
    a read's StoreUnavailable); every wait is capped at 2 s and jittered 50..100 %."""
    url = parse(f"{s3}/run/object")
    store = store_for(url)
    store.put(url.key, b"payload")
    for kind, (op, call) in _OPS.items():
        before, sleeps[:] = [k for k, _ in store_proxy.seen].count(kind), []
        store_proxy.fail(kind, times=5)
        call(store, url.key)
        assert [k for k, _ in store_proxy.seen].count(kind) - before == 6, kind
        assert len(sleeps) == 5 and all(
            0.5 * min(2.0, 0.05 * 2**i) <= s <= min(2.0, 0.05 * 2**i) for i, s in enumerate(sleeps)
        ), sleeps
        store_proxy.fail(kind)
        with pytest.raises(SaveFailed if kind in ("PUT", "DELETE") else StoreUnavailable) as e:
            call(store, url.key)
        code = "503" if kind == "HEAD" else "SlowDown"  # a HEAD's answer has no body to name the code
        assert str(e.value) == f"{url}: {op} failed 6 times, last: {code} (HTTP 503){_RULE}", kind
        store_proxy.heal()
        store.put(url.key, b"payload")  # for the next kind (DELETE removed it)


def test_a_run_its_lease_listing_and_retention_survive_bursts_on_every_request_type(s3, store_proxy, sleeps) -> None:
    """R-O50: a start, saves whose retention deletes, the lease's create, renewal and release, and
    a resume, with 2 SlowDowns waiting at every request type before each phase."""
    run = f"{s3}/run"
    for phase in ("start and save", "resume"):
        for kind in ("LIST", "GET", "HEAD", "PUT", "DELETE"):
            store_proxy.fail(kind, times=2)
        if phase == "start and save":
            saved(run, [1, 2, 3], keep=1)  # keep=1: each save deletes the step before
        else:
            rs, net = run_state(run, keep=1)
            assert rs.resume().step == 3 and bool(net.lin.weight.eq(3.0).all())
            rs.close()
    faulted = [k for k, _ in store_proxy.seen]
    assert {k: faulted.count(k) >= 3 for k in ("LIST", "GET", "HEAD", "PUT", "DELETE")} == dict.fromkeys(
        ("LIST", "GET", "HEAD", "PUT", "DELETE"), True
    )
    assert sorted(k for k, _v, _t in store_for(parse(run)).list("run/step-")) == [
        "run/step-00000003.ckpt",
        "run/step-00000003.ckpt.commit.json",
        "run/step-00000003.ckpt.config.json",
    ]


def test_a_list_or_a_read_that_keeps_failing_makes_a_resume_refuse_never_start_fresh_or_fall_back(
    s3, store_proxy, sleeps, capsys
) -> None:
    """R-O50: not "no checkpoints to resume from", not a fresh start over a run that has them; and a
    throttled read of the newest step says nothing of it (R-026's fallback is for damage)."""
    run = f"{s3}/run"
    saved(run, [1, 2])  # step 1 is there to fall back to
    store_proxy.fail("LIST")
    listing = f"{s3}/run/: list failed 6 times, last: SlowDown (HTTP 503){_RULE}"
    with pytest.raises(StoreUnavailable) as e:
        run_state(run)[0].resume_or_start()
    assert str(e.value) == listing
    assert main(["verify", run]) == 2
    assert capsys.readouterr().err == f"ckptkit verify: {listing}\n"
    store_proxy.heal()
    store_proxy.fail("GET", containing="step-00000002.ckpt")
    rs, _net = run_state(run)
    with pytest.raises(StoreUnavailable, match=r"/run/step-00000002\.ckpt\.commit\.json: get failed 6 times, "):
        rs.resume()
    rs.close()
    store_proxy.heal()
    rs, net = run_state(run)
    assert rs.resume().step == 2 and bool(net.lin.weight.eq(2.0).all())  # untouched
    rs.close()
