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
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import same

import ckptkit
from ckptkit.errors import (
    CheckpointError,
    CheckpointNotFound,
    ChecksumMismatch,
    CommitConflict,
    IncompleteCheckpoint,
)
from ckptkit.format import commit as commit_module
from ckptkit.format import objectstore
from ckptkit.format.commit import RECORD_SUFFIX, remove
from ckptkit.format.objectstore import Backend, RequestRefused, TransientFault
from ckptkit.format.urls import parse

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


class Crash(BaseException):
    """The process died at this storage operation."""


class Faulty:
    """``inner``, but request number ``k`` (1-based) fails as ``mode`` says; ``k=None`` only counts."""

    def __init__(self, inner: Backend, k: int | None, mode: str) -> None:
        self.inner, self.k, self.mode = inner, k, mode
        self.bucket = inner.bucket
        self.count, self.dead = 0, False
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        op = getattr(self.inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            with self.lock:
                self.count += 1
                n = self.count
                if self.dead:
                    raise Crash(f"request {n} after the crash")
                if n == self.k and self.mode == "crash":
                    self.dead = True
                    raise Crash(f"crashed at request {n} ({name})")
            if n == self.k and self.mode == "error":
                raise RequestRefused(f"injected failure of request {n} ({name})")
            if n == self.k and self.mode == "transient":
                raise TransientFault(f"injected 503 SlowDown at request {n} ({name})")
            return op(*args, **kw)

        return call


def _state(seed: int) -> ckptkit.Checkpoint:
    g = torch.Generator().manual_seed(seed)
    return ckptkit.Checkpoint(step=seed, model={"net": {"w": torch.randn(8, 4, generator=g)}})


def _under(k: int | None, mode: str, fn: Callable[[], Any]) -> tuple[Any, BaseException | None, int]:
    """``fn()`` with request ``k`` failing: ``(its result, what it raised, requests made)``."""
    made: list[Faulty] = []

    def wrap(backend: Backend) -> Backend:
        made.append(Faulty(backend, k, mode))
        return made[-1]

    with objectstore.intercept(wrap):
        try:
            return fn(), None, sum(f.count for f in made)
        except (Crash, CheckpointError) as e:
            return None, e, sum(f.count for f in made)


def _loads_whole_or_is_refused(url: str, ckpt: ckptkit.Checkpoint) -> bool:
    """The checkpoint at ``url`` loads to exactly ``ckpt``, or is refused as not there; True: it loaded."""
    refused: CheckpointNotFound | None = None
    try:
        got = ckptkit.load(url)
    except CheckpointNotFound as e:  # IncompleteCheckpoint included: no record, no checkpoint (R-O15)
        refused = e
    if refused is not None:
        name = url.rpartition("/")[2]
        # Refused as uncommitted, never as a committed checkpoint with an object gone (R-O17).
        assert not isinstance(refused, IncompleteCheckpoint) or refused.missing == (name + RECORD_SUFFIX,), refused
        assert not ckptkit.verify(url).ok if _exists(url) else True
        return False
    assert got.step == ckpt.step and same(got.model, ckpt.model)
    return True


def _exists(url: str) -> bool:
    try:
        ckptkit.verify(url)
    except CheckpointNotFound:
        return False
    return True


def _requests(fn: Callable[[], Any]) -> int:
    _result, error, n = _under(None, "count", fn)
    assert error is None
    return n


MODES = ["error", "crash", "transient"]


@pytest.mark.parametrize("mode", MODES)
def test_a_save_failing_at_every_request_never_leaves_a_partial_checkpoint_or_blocks_the_next(
    s3, mode, monkeypatch
) -> None:
    # The next save comes STALE_AFTER seconds later, when what a dead writer left is removed (R-O16).
    monkeypatch.setattr(commit_module, "STALE_AFTER", 0.0)
    old, new = f"{s3}/run/step-00000010.ckpt", f"{s3}/run/step-00000020.ckpt"
    ckptkit.save(old, _state(10))
    n = _requests(lambda: ckptkit.save(f"{s3}/count/step-00000020.ckpt", _state(20)))
    assert n >= 4  # HEAD record, LIST leftovers, PUT container, PUT record
    for k in range(1, n + 1):
        _r, error, _made = _under(k, mode, lambda: ckptkit.save(new, _state(20)))
        assert mode != "transient" or error is None, (k, error)  # retried with backoff (R-O20)
        assert _loads_whole_or_is_refused(old, _state(10))  # the previous checkpoint is intact
        if _loads_whole_or_is_refused(new, _state(20)):
            assert error is None  # committed exactly when the save returned (R-O10)
        else:
            assert error is not None
            ckptkit.save(new, _state(20))  # what the failed save left blocks nothing (R-O16)
            assert _loads_whole_or_is_refused(new, _state(20))
        remove(objectstore.store_for(parse(new)), parse(s3).child("run"), "step-00000020.ckpt")


@pytest.mark.parametrize("mode", MODES)
def test_a_read_failing_at_every_request_returns_the_checkpoint_or_a_typed_error(s3, mode) -> None:
    url = f"{s3}/run/step-00000010.ckpt"
    ckptkit.save(url, _state(10))
    n = _requests(lambda: ckptkit.load(url))
    for k in range(1, n + 1):
        got, error, _made = _under(k, mode, lambda: ckptkit.load(url))
        if error is None:
            assert same(got.model, _state(10).model)
        else:
            assert mode != "transient" and isinstance(error, (Crash, CheckpointError)), error


@pytest.mark.parametrize("mode", MODES)
def test_retention_failing_at_every_request_uncommits_first_and_the_name_is_saved_again(s3, mode) -> None:
    """R-O17: the record goes first, so a checkpoint is whole or gone, never half there."""
    base = parse(s3).child("run")
    url = f"{s3}/run/step-00000010.ckpt"
    ckptkit.save(url, _state(10))
    n = _requests(lambda: remove(objectstore.store_for(base), base, "step-00000010.ckpt"))
    for k in range(1, n + 1):
        ckptkit.save(url, _state(10))
        _r, error, _made = _under(k, mode, lambda: remove(objectstore.store_for(base), base, "step-00000010.ckpt"))
        assert mode != "transient" or error is None
        if _loads_whole_or_is_refused(url, _state(10)):
            assert error is not None and k <= 3  # failed before the record was deleted (GET, LIST, DELETE)
        remove(objectstore.store_for(base), base, "step-00000010.ckpt")  # a retry finishes the job
        assert not _exists(url)


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
        a = threading.Thread(target=ckptkit.save, args=(url, _state(1)))
        a.start()
        a_before_record.wait(30)
    with objectstore.intercept(lambda b: IgnoresConditions(b, pause=False)):
        ckptkit.save(url, _state(2))  # B overwrites A's container, then commits
    b_done.set()
    a.join(30)  # A's record, written last, lists A's digest over B's bytes
    with pytest.raises(ChecksumMismatch, match="object bytes differ from its commit record"):
        ckptkit.load(url)
    with pytest.raises(CommitConflict):  # on a conforming store the name stays taken until deleted
        ckptkit.save(url, _state(3))


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
            ckptkit.save(url, _state(1))
            result["a"] = "committed"
        except CommitConflict as e:
            result["a"] = str(e)

    with objectstore.intercept(PausesBeforeChecking):
        a = threading.Thread(target=writer_a)
        a.start()
        assert paused.wait(30)
    ckptkit.save(url, _state(2))  # B: A's objects have no record yet; B removes them and commits
    go.set()
    a.join(30)
    assert "step-00000010.ckpt: replaced by another writer" in str(result["a"]), result
    assert same(ckptkit.load(url).model, _state(2).model)  # exactly one committed, with its own bytes
