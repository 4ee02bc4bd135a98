"""Faults injected into every storage operation of a save, a read and a retention pass
(spec/objectstore.md, guarantees G-53/G-54), against the real S3 HTTP server.

:class:`Faulty` sits between the real client (:class:`S3Backend`) and ckptkit's store
(``objectstore.intercept``) and, at the k-th request, fails it (an error the store refuses),
fails it transiently (throttling: retried), or crashes: that request and every later one
raise :class:`Crash`, a ``BaseException`` no cleanup can catch and go on from, as if the
process had died there. For every k: never a partial checkpoint loaded, the previous one
intact, and nothing left that blocks the next save.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _store_faults import MODES, Crash, exists, loads_whole_or_is_refused, requests_of, state_of, under
from helpers import same

import ckptkit
from ckptkit.errors import (
    CheckpointError,
    ChecksumMismatch,
    CommitConflict,
)
from ckptkit.format import _commit as commit_module
from ckptkit.format import _objectstore as objectstore
from ckptkit.format._commit import remove
from ckptkit.format._objectstore import Backend
from ckptkit.format._urls import parse

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.mark.parametrize("mode", MODES)
def test_a_save_failing_at_every_request_never_leaves_a_partial_checkpoint_or_blocks_the_next(
    s3, mode, monkeypatch
) -> None:
    # The next save comes STALE_AFTER seconds later, when what a dead writer left is removed (R-O16).
    monkeypatch.setattr(commit_module, "STALE_AFTER", 0.0)
    old, new = f"{s3}/run/step-00000010.ckpt", f"{s3}/run/step-00000020.ckpt"
    ckptkit.save(old, state_of(10))
    n = requests_of(lambda: ckptkit.save(f"{s3}/count/step-00000020.ckpt", state_of(20)))
    assert n >= 4  # HEAD record, LIST leftovers, PUT container, PUT record
    for k in range(1, n + 1):
        _r, error, _made = under(k, mode, lambda: ckptkit.save(new, state_of(20)))
        assert mode != "transient" or error is None, (k, error)  # retried with backoff (R-O20)
        assert loads_whole_or_is_refused(old, state_of(10))  # the previous checkpoint is intact
        if loads_whole_or_is_refused(new, state_of(20)):
            assert error is None  # committed exactly when the save returned (R-O10)
        else:
            assert error is not None
            ckptkit.save(new, state_of(20))  # what the failed save left blocks nothing (R-O16)
            assert loads_whole_or_is_refused(new, state_of(20))
        remove(objectstore.store_for(parse(new)), parse(s3).child("run"), "step-00000020.ckpt")


@pytest.mark.parametrize("mode", MODES)
def test_a_read_failing_at_every_request_returns_the_checkpoint_or_a_typed_error(s3, mode) -> None:
    url = f"{s3}/run/step-00000010.ckpt"
    ckptkit.save(url, state_of(10))
    n = requests_of(lambda: ckptkit.load(url))
    for k in range(1, n + 1):
        got, error, _made = under(k, mode, lambda: ckptkit.load(url))
        if error is None:
            assert same(got.model, state_of(10).model)
        else:
            assert mode != "transient" and isinstance(error, (Crash, CheckpointError)), error


@pytest.mark.parametrize("mode", MODES)
def test_retention_failing_at_every_request_uncommits_first_and_the_name_is_saved_again(s3, mode) -> None:
    """R-O17: the record goes first, so a checkpoint is whole or gone, never half there."""
    base = parse(s3).child("run")
    url = f"{s3}/run/step-00000010.ckpt"
    ckptkit.save(url, state_of(10))
    n = requests_of(lambda: remove(objectstore.store_for(base), base, "step-00000010.ckpt"))
    for k in range(1, n + 1):
        ckptkit.save(url, state_of(10))
        _r, error, _made = under(k, mode, lambda: remove(objectstore.store_for(base), base, "step-00000010.ckpt"))
        assert mode != "transient" or error is None
        if loads_whole_or_is_refused(url, state_of(10)):
            assert error is not None and k <= 3  # failed before the record was deleted (GET, LIST, DELETE)
        remove(objectstore.store_for(base), base, "step-00000010.ckpt")  # a retry finishes the job
        assert not exists(url)


def test_a_store_that_ignores_conditional_writes_loses_the_step_but_never_loads_a_mix(s3, monkeypatch) -> None:
    """R-O19, G-56: without If-None-Match both racing writers "commit"; R-O14 then refuses the mix."""
    monkeypatch.setattr(commit_module, "STALE_AFTER", 0.0)  # A stalls longer than STALE_AFTER
    a_before_record, b_done = threading.Event(), threading.Event()

    class IgnoresConditions:
        def __init__(self, inner: Backend, pause: bool) -> None:
            self.inner, self.bucket, self.pause = inner, inner.bucket, pause

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def put(self, key: str, data: bytes, *, if_absent: bool) -> str:
            if self.pause and key.endswith(".commit.json"):
                a_before_record.set()
                b_done.wait(30)
            return self.inner.put(key, data, if_absent=False)

        def head(self, key: str) -> int | None:
            return None if key.endswith(".commit.json") else self.inner.head(key)

    url = f"{s3}/lax/step-00000010.ckpt"
    with objectstore.intercept(lambda b: IgnoresConditions(b, pause=True)):
        a = threading.Thread(target=ckptkit.save, args=(url, state_of(1)))
        a.start()
        a_before_record.wait(30)
    with objectstore.intercept(lambda b: IgnoresConditions(b, pause=False)):
        ckptkit.save(url, state_of(2))  # B overwrites A's container, then commits
    b_done.set()
    a.join(30)  # A's record, written last, lists A's digest over B's bytes
    with pytest.raises(ChecksumMismatch, match="object bytes differ from its commit record"):
        ckptkit.load(url)
    with pytest.raises(CommitConflict):  # on a conforming store the name stays taken until deleted
        ckptkit.save(url, state_of(3))


def test_a_save_whose_objects_another_save_cleaned_away_commits_nothing_and_the_other_wins(s3, monkeypatch) -> None:
    """R-O11, R-O16, G-52: A stalls longer than STALE_AFTER before its record; B takes A's objects
    for an interrupted save's and cleans them; A, checking its objects first, finds them replaced."""
    monkeypatch.setattr(commit_module, "STALE_AFTER", 0.0)
    paused, go = threading.Event(), threading.Event()

    class PausesBeforeChecking:
        def __init__(self, inner: Backend) -> None:
            self.inner, self.bucket = inner, inner.bucket

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def etag(self, key: str) -> str | None:
            paused.set()
            go.wait(30)
            return self.inner.etag(key)

    url, result = f"{s3}/clash/step-00000010.ckpt", {}

    def writer_a() -> None:
        try:
            ckptkit.save(url, state_of(1))
            result["a"] = "committed"
        except CommitConflict as e:
            result["a"] = str(e)

    with objectstore.intercept(PausesBeforeChecking):
        a = threading.Thread(target=writer_a)
        a.start()
        assert paused.wait(30)
    ckptkit.save(url, state_of(2))  # B: A's objects have no record yet; B removes them and commits
    go.set()
    a.join(30)
    assert "step-00000010.ckpt: replaced by another writer" in str(result["a"]), result
    assert same(ckptkit.load(url).model, state_of(2).model)  # exactly one committed, with its own bytes
