"""The fault stores the object-storage tests share: a backend that fails at its k-th request,
one that counts the bytes each object's reads fetched (:class:`Fetched`), and
:class:`StoreProxy`, a loopback HTTP proxy in front of the tests' S3 server that answers
chosen requests with ``503 SlowDown`` or drops ``If-None-Match`` (a store that ignores it).

Used by tests/format/test_objectstore_faults.py, tests/run/test_objectstore_run.py,
tests/run/test_store_trust.py and tests/distributed/test_distributed_objectstore.py.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

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


class Fetched:
    """``inner``, counting the bytes its reads (GET, ranged or whole) brought back, by key, and its LISTs."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.bucket = inner, inner.bucket
        self.bytes: dict[str, int] = {}
        self.lists = 0
        self.lock = threading.Lock()

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        with self.lock:
            self.lists += 1
        return self.inner.list(prefix)

    def _count(self, key: str, n: int) -> None:
        with self.lock:
            self.bytes[key] = self.bytes.get(key, 0) + n

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self.inner.get(key, start, end)
        self._count(key, len(data))
        return data

    def get_into(self, key: str, fd: int, start: int | None = None, end: int | None = None) -> int:
        n = self.inner.get_into(key, fd, start, end)
        self._count(key, n)
        return n

    def read(self, key: str) -> tuple[bytes, str]:
        data, etag = self.inner.read(key)
        self._count(key, len(data))
        return data, etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def state_of(seed: int) -> ckptkit.Checkpoint:
    g = torch.Generator().manual_seed(seed)
    return ckptkit.Checkpoint(step=seed, model={"net": {"w": torch.randn(8, 4, generator=g)}})


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)


def run_state(run_dir: str, keep: int = 2) -> tuple[ckptkit.RunState, Net]:
    """A ``RunState`` on ``run_dir`` keeping ``keep`` steps, with one small model registered."""
    net = Net()
    rs = ckptkit.RunState(run_dir, config={"lr": 0.1}, keep=keep)
    rs.add_model("net", net)
    return rs, net


def saved(run_dir: str, steps: list[int], keep: int = 2) -> None:
    """A run started on ``run_dir`` that saves each of ``steps`` with its weight filled with the step."""
    rs, net = run_state(run_dir, keep)
    rs.start()
    for s in steps:
        with torch.no_grad():
            net.lin.weight.fill_(float(s))
        rs.save(s)
    rs.close()


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


_SLOW_DOWN = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>injected</Message></Error>"


class StoreProxy:
    """Forwards every request to the S3 server at ``upstream``; :meth:`fail` answers the next
    requests of a type with ``503 SlowDown``, and ``ignore_if_none_match`` drops that header
    from every request, as a store that accepts and ignores it does (mountx#19).

    A request's type is ``LIST`` (a GET with ``list-type``), ``GET``, ``HEAD``, ``PUT``,
    ``DELETE`` or ``POST`` (multipart); :attr:`seen` holds ``(type, path)`` of every request.
    """

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.ignore_if_none_match = False
        self.seen: list[tuple[str, str]] = []
        self._faults: list[list[Any]] = []  # [type, path part, times left (-1: always)]
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def fail(self, kind: str, times: int = -1, containing: str = "") -> None:
        """Answer the next ``times`` requests of ``kind`` whose path holds ``containing`` with 503
        SlowDown (-1: every one from now on)."""
        with self._lock:
            self._faults.append([kind, containing, times])

    def heal(self) -> None:
        with self._lock:
            self._faults.clear()

    def failing(self, kind: str, path: str) -> bool:
        """Records the request; True when a fault answers it."""
        with self._lock:
            self.seen.append((kind, path))
            for fault in self._faults:
                if fault[0] == kind and fault[1] in path and fault[2] != 0:
                    fault[2] -= 1 if fault[2] > 0 else 0
                    return True
        return False

    def forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list[Any], bytes]:
        if self.ignore_if_none_match:
            headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.getheaders(), r.read()
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def request_kind(method: str, path: str) -> str:
    return "LIST" if method == "GET" and "list-type=" in path else method


def _handler(proxy: StoreProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if proxy.failing(request_kind(self.command, self.path), self.path):
                status, headers, data = 503, [("Content-Type", "application/xml")], _SLOW_DOWN
            else:
                status, headers, data = proxy.forward(self.command, self.path, dict(self.headers.items()), body)
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            sizes = [v for k, v in headers if k.lower() == "content-length"]  # a HEAD's is the object's
            self.send_header("Content-Length", sizes[0] if self.command == "HEAD" and sizes else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    return Handler
