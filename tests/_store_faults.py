"""The fault store the object-storage tests share: a backend that fails at its k-th request.

Used by tests/format/test_objectstore_faults.py, tests/run/test_objectstore_run.py and
tests/distributed/test_distributed_objectstore.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from helpers import same

import ckptkit
from ckptkit.errors import (
    CheckpointError,
    CheckpointNotFound,
    IncompleteCheckpoint,
)
from ckptkit.format import _objectstore as objectstore
from ckptkit.format._commit import RECORD_SUFFIX
from ckptkit.format._objectstore import Backend, RequestRefused, TransientFault


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


def state_of(seed: int) -> ckptkit.Checkpoint:
    g = torch.Generator().manual_seed(seed)
    return ckptkit.Checkpoint(step=seed, model={"net": {"w": torch.randn(8, 4, generator=g)}})


def under(k: int | None, mode: str, fn: Callable[[], Any]) -> tuple[Any, BaseException | None, int]:
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


def loads_whole_or_is_refused(url: str, ckpt: ckptkit.Checkpoint) -> bool:
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
        assert not ckptkit.verify(url).ok if exists(url) else True
        return False
    assert got.step == ckpt.step and same(got.model, ckpt.model)
    return True


def exists(url: str) -> bool:
    try:
        ckptkit.verify(url)
    except CheckpointNotFound:
        return False
    return True


def requests_of(fn: Callable[[], Any]) -> int:
    _result, error, n = under(None, "count", fn)
    assert error is None
    return n


MODES = ["error", "crash", "transient"]
