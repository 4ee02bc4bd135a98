"""Fixtures shared by the tests (the hypothesis profiles are in the root conftest.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The tests sit in one folder per floor; their shared helpers (helpers.py, the worker scripts) sit
# here, imported as top-level modules from every folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))


#: torch's process-wide determinism switches as a fresh process has them.
_FRESH_FLAGS = (False, False, False, False)


def _torch_flags() -> tuple[bool, bool, bool, bool]:
    """cudnn's deterministic and benchmark, deterministic algorithms and their warn-only; a process
    that has not imported torch has them as a fresh one does (torch is absent from the core venv)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return _FRESH_FLAGS
    return (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


@pytest.fixture(scope="module", autouse=True)
def _process_as_it_was() -> Iterator[None]:
    """Put torch's process-wide flags and the environment variables back after each module: an
    in-process Trainer (Lightning's ``deterministic=True``, Hugging Face's ``full_determinism``)
    switches them, and a later test's run would record an environment (``environment.json``'s
    ``deterministic_algorithms``) that its own child processes do not have."""
    flags, environ = _torch_flags(), dict(os.environ)
    yield
    torch = sys.modules.get("torch")
    if torch is not None and _torch_flags() != flags:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[:2]
        torch.use_deterministic_algorithms(flags[2], warn_only=flags[3])
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    """A pool of 2 real gloo ranks for one test module (tests/_dist_workers.py), reaped after it."""
    from _dist_workers import RankPool  # lazily: most test modules never start ranks

    p = RankPool(2)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real S3 HTTP server for the session: moto's ``ThreadedMotoServer`` on 127.0.0.1, a free port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """``s3://<a new bucket>`` on the session's server, the standard AWS variables pointing at it
    (subprocesses inherit them): what a user's environment looks like."""
    import re
    import uuid

    import boto3

    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    bucket = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}"


@pytest.fixture
def store_proxy(s3: str, s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A :class:`_store_faults.StoreProxy` in front of the session's S3 server, the AWS variables
    pointing at it (``s3``'s bucket is reached through it)."""
    from _store_faults import StoreProxy

    proxy = StoreProxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        proxy.close()
