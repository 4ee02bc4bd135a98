"""Objects in an S3 (or S3-compatible) bucket: the storage operations a commit is built of.

Two layers (spec/objectstore.md):

- a :class:`Backend` does one request per call and says what went wrong with one of the
  four :class:`StorageFault` classes (they live here, not in :mod:`ckptkit.errors`: none
  reaches a caller)::

    StorageFault (Exception)      how one object-storage request failed; inside the store only
    ├── ObjectMissing             no object at the key
    ├── WriteConflict             a conditional write found the object there (HTTP 412/409, R-O11)
    ├── TransientFault            throttling, a 5xx, a dropped connection: worth retrying
    └── RequestRefused            anything else: access denied, no bucket, a bad request

  :class:`S3Backend` is boto3's client; fault-injection tests put a wrapper between it and the store;
- :class:`ObjectStore` turns them into ckptkit's: transient failures of every request
  (LIST, GET, HEAD, PUT, DELETE) are retried with capped, jittered exponential backoff
  (R-O20, R-O50), large objects go up as parallel multipart uploads
  and come down as parallel ranged reads (R-O21), each part read from or written into a file
  as it goes, so no object is ever whole in memory (R-O51), and what is left is a ``SaveFailed``,
  ``UnreadableFile``, ``CheckpointNotFound`` or :class:`~ckptkit.errors.CommitConflict`
  that names the object; a read whose every attempt failed transiently is one kind of
  ``UnreadableFile`` of its own, which a resume does not take for damage (R-O50)::

    UnreadableFile (ckptkit.errors)
    └── StoreUnavailable          a read still throttled or failing after every attempt

  Before this process's first conditional write to a bucket, a store from :func:`store_for`
  checks that the bucket enforces ``If-None-Match: *`` (R-O49).

Why boto3 (docs/storage.md): it is the reference S3 client, speaks conditional writes
(``If-None-Match: *`` on a put and on completing a multipart upload), reads the standard
AWS environment variables and config files (``AWS_ENDPOINT_URL`` for an S3-compatible
server) and lets a test inject an HTTP 503 into the real client (botocore's events).
Nothing here imports boto3 before an ``s3://`` URL is used.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO, Protocol, TypeVar, cast

from ..errors import (
    CheckpointError,
    CheckpointNotFound,
    CommitConflict,
    SaveFailed,
    UnreadableFile,
    UnsupportedOption,
)
from ._io import Followed
from ._urls import StorageURL, require_client

__all__ = [
    "PROBE_PREFIX",
    "SINGLE_WRITER_ENV",
    "Backend",
    "Body",
    "FileSpan",
    "ObjectMissing",
    "ObjectStore",
    "RequestRefused",
    "S3Backend",
    "StorageFault",
    "StoreUnavailable",
    "TransientFault",
    "WriteConflict",
    "intercept",
    "piece",
    "single_writer_vouched",
    "store_for",
]

T = TypeVar("T")

#: Objects larger than this go up in parts of this size, in parallel (R-O21); S3's minimum part is 5 MiB.
#: At most ``_THREADS`` parts are in memory at once: a transfer's bound (R-O51).
PART_SIZE = 64 << 20
_THREADS = 8
#: A download is written into its file in pieces of this size, as they come off the connection.
_CHUNK = 1 << 20
#: Set to ``1``, the user vouches that one job at a time writes to the store: its conditional
#: writes are not checked (R-O49), and a run records that it relied on the promise.
SINGLE_WRITER_ENV = "CKPTKIT_SINGLE_WRITER_STORE"

# ---------------------------------------------------------------------------- faults


class StorageFault(Exception):
    """How one object-storage request failed (spec/objectstore.md): a backend's answer, turned
    into a :class:`CheckpointError` naming the object by the store, never seen by a caller."""


class ObjectMissing(StorageFault):
    """No object at the key."""


class WriteConflict(StorageFault):
    """A conditional write found the object there already (HTTP 412, or 409 for one in flight)."""


class TransientFault(StorageFault):
    """Throttling (503 SlowDown), a 5xx, a dropped connection: another attempt may succeed (R-O20)."""


class RequestRefused(StorageFault):
    """A failure another attempt meets again: access denied, no such bucket, a bad request."""


class StoreUnavailable(UnreadableFile):
    """A read that still failed transiently after every attempt (R-O20, R-O50): the store is
    throttling or failing, which says nothing about the object; a resume stops here rather than
    take the object for damaged and fall back to an older checkpoint."""


class FileSpan:
    """The first ``size`` bytes of an open file as an object's body: read a part at a time, when
    that part goes up, never whole (R-O51). The caller keeps ``fd`` open while it is put."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def __len__(self) -> int:
        return self.size

    def read(self, start: int, end: int) -> bytes:
        out = os.pread(self.fd, end - start, start)
        while len(out) < end - start:  # a short read of a regular file: read on
            more = os.pread(self.fd, end - start - len(out), start + len(out))
            if not more:
                raise SaveFailed(f"a file being uploaded shrank: it ends at {start + len(out)}, before {end}")
            out += more
        return out


#: What a put uploads: bytes in memory (run records, a lease, a probe), or a file's (a checkpoint).
Body = bytes | memoryview | FileSpan


class _Window(io.RawIOBase):
    """Bytes ``[start, end)`` of a file as a seekable stream: a part the client reads as it sends
    it, never whole in memory (R-O51)."""

    def __init__(self, fd: int, start: int, end: int) -> None:
        super().__init__()
        self.fd, self.start, self.size, self.pos = fd, start, end - start, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, self.size)[whence])
        return self.pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.size - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos)
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _window(data: Body, start: int, end: int) -> bytes | BinaryIO:
    """A part's body: a stream over the file's span, or bytes of data in memory."""
    if isinstance(data, FileSpan):
        return cast(BinaryIO, io.BufferedReader(_Window(data.fd, start, end), 1 << 20))
    return piece(data, start, end)


def piece(data: Body, start: int, end: int) -> bytes:
    """``data[start:end]`` as bytes (read from the file of a :class:`FileSpan`)."""
    return data.read(start, end) if isinstance(data, FileSpan) else bytes(memoryview(data)[start:end])


class Backend(Protocol):
    """One request per call against one bucket; failures are the four classes above."""

    bucket: str

    def put(self, key: str, data: bytes, *, if_absent: bool) -> str: ...
    def start_multipart(self, key: str) -> str: ...
    def put_part(self, key: str, upload: str, number: int, data: bytes | BinaryIO) -> str: ...
    def finish_multipart(self, key: str, upload: str, etags: list[str], *, if_absent: bool) -> str: ...
    def abort_multipart(self, key: str, upload: str) -> None: ...
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...
    def get_into(self, key: str, fd: int, start: int | None = None, end: int | None = None) -> int: ...
    def read(self, key: str) -> tuple[bytes, str]: ...
    def replace(self, key: str, data: bytes, etag: str) -> str: ...
    def delete_if(self, key: str, etag: str) -> None: ...
    def head(self, key: str) -> int | None: ...
    def etag(self, key: str) -> str | None: ...
    def list(self, prefix: str) -> list[tuple[str, int, float]]: ...
    def delete(self, key: str) -> None: ...


_THROTTLE = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed"}


def _status(e: Exception) -> int:
    """The HTTP status of a botocore ``ClientError`` (0 for anything else)."""
    response = getattr(e, "response", None)
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0) if isinstance(response, dict) else 0


def _classify(e: Exception) -> Exception:
    """A botocore exception as one of the four classes."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        HTTPClientError,
        IncompleteReadError,
        NoCredentialsError,
        ResponseStreamingError,
    )
    from botocore.exceptions import ConnectionError as Dropped

    _DROPPED = (Dropped, HTTPClientError, IncompleteReadError, ResponseStreamingError)

    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = _status(e)
        what = f"{code or 'error'} (HTTP {status})"
        if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return WriteConflict(what)
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectMissing(what)
        if status >= 500 or code in _THROTTLE:
            return TransientFault(what)
        return RequestRefused(what)
    if isinstance(e, _DROPPED):  # connection reset, closed, timed out, endpoint unreachable, body cut off
        return TransientFault(f"{type(e).__name__}: {e}")
    if isinstance(e, NoCredentialsError):
        return RequestRefused(f"{e}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (R-O03)")
    if isinstance(e, BotoCoreError):
        return RequestRefused(f"{type(e).__name__}: {e}")
    return e


class S3Backend:
    """boto3's S3 client for one bucket; endpoint and credentials the way every AWS tool finds them
    (``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``..., ``~/.aws/config``)."""

    def __init__(self, bucket: str) -> None:
        require_client()
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        # One attempt per call: ObjectStore retries, so that a test's injected fault is retried the same way.
        config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, max_pool_connections=2 * _THREADS)
        self.client = boto3.session.Session().client("s3", config=config)
        self.endpoint = str(self.client.meta.endpoint_url)

    def _call(self, fn: Callable[..., T], **kw: Any) -> T:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as e:
            raise _classify(e) from e

    def put(self, key: str, data: bytes, *, if_absent: bool) -> str:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        return str(self._call(self.client.put_object, Key=key, Body=data, **extra)["ETag"])

    def start_multipart(self, key: str) -> str:
        return str(self._call(self.client.create_multipart_upload, Key=key)["UploadId"])

    def put_part(self, key: str, upload: str, number: int, data: bytes | BinaryIO) -> str:
        r = self._call(self.client.upload_part, Key=key, UploadId=upload, PartNumber=number, Body=data)
        return str(r["ETag"])

    def finish_multipart(self, key: str, upload: str, etags: list[str], *, if_absent: bool) -> str:
        parts = {"Parts": [{"ETag": t, "PartNumber": i + 1} for i, t in enumerate(etags)]}
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        done = self._call(
            self.client.complete_multipart_upload, Key=key, UploadId=upload, MultipartUpload=parts, **extra
        )
        return str(done["ETag"])

    def abort_multipart(self, key: str, upload: str) -> None:
        self._call(self.client.abort_multipart_upload, Key=key, UploadId=upload)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or its bytes ``[start, end)``: short (empty) where the object ends
        sooner, as a file's read is (HTTP 416 for a range that starts past its end)."""
        extra = {} if start is None else {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key, **extra)["Body"]
            return bytes(body.read())
        except Exception as e:
            if start is not None and _status(e) == 416:
                return b""
            raise _classify(e) from e

    def get_into(self, key: str, fd: int, start: int | None = None, end: int | None = None) -> int:
        """The object's bytes ``[start, end)`` (None: all of it) written into the file ``fd`` at
        offset ``start``, read off the connection :data:`_CHUNK` bytes at a time; how many."""
        extra = {} if start is None else {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
        body = self._call(self.client.get_object, Key=key, **extra)["Body"]
        done = 0
        try:
            for chunk in body.iter_chunks(_CHUNK):
                done += _write_at(fd, chunk, (start or 0) + done)
        except Exception as e:
            raise _classify(e) from e
        return done

    def read(self, key: str) -> tuple[bytes, str]:
        """The whole object and the ETag of exactly those bytes (one GET)."""
        r = self._call(self.client.get_object, Key=key)
        try:
            return bytes(r["Body"].read()), str(r["ETag"])
        except Exception as e:
            raise _classify(e) from e

    def replace(self, key: str, data: bytes, etag: str) -> str:
        """Overwrite ``key`` only while it is still the object of ``etag`` (``If-Match``); its new ETag."""
        return str(self._call(self.client.put_object, Key=key, Body=data, IfMatch=etag)["ETag"])

    def delete_if(self, key: str, etag: str) -> None:
        """Remove ``key`` only while it is still the object of ``etag`` (``If-Match``)."""
        self._call(self.client.delete_object, Key=key, IfMatch=etag)

    def head(self, key: str) -> int | None:
        try:
            return int(self._call(self.client.head_object, Key=key)["ContentLength"])
        except ObjectMissing:
            return None

    def etag(self, key: str) -> str | None:
        try:
            return str(self._call(self.client.head_object, Key=key)["ETag"])
        except ObjectMissing:
            return None

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        out: list[tuple[str, int, float]] = []
        token: dict[str, str] = {}
        while True:
            page = self._call(self.client.list_objects_v2, Prefix=prefix, **token)
            out += [(o["Key"], int(o["Size"]), o["LastModified"].timestamp()) for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(out)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def delete(self, key: str) -> None:
        self._call(self.client.delete_object, Key=key)


_WRAP: list[Callable[[Backend], Backend]] = []
_CLIENTS: dict[tuple[str, ...], S3Backend] = {}
_LOCK = threading.Lock()
_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_DEFAULT_REGION")


@contextlib.contextmanager
def intercept(wrap: Callable[[Backend], Backend]) -> Iterator[None]:
    """While open, every store :func:`store_for` hands out talks through ``wrap(backend)``: the
    hook a fault-injection test uses to fail the k-th storage operation (tests/format/test_objectstore_faults.py)."""
    _WRAP.append(wrap)
    try:
        yield
    finally:
        _WRAP.remove(wrap)


def store_for(url: StorageURL) -> ObjectStore:
    """The store of ``url``'s bucket (one client per bucket and environment, reused)."""
    require_client()  # before a cached client: the extra may have gone (R-O02)
    ident = (url.bucket, *(os.environ.get(k, "") for k in _ENV))
    with _LOCK:
        client = _CLIENTS.get(ident)
        if client is None:
            client = _CLIENTS[ident] = S3Backend(url.bucket)
    backend: Backend = client
    for wrap in _WRAP:
        backend = wrap(backend)
    # PART_SIZE as it is now (a test sets it); the check talks to the store itself (R-O49).
    return ObjectStore(backend, url.scheme, part_size=PART_SIZE, probe=client)


class ObjectStore:
    """A bucket, in ckptkit's terms: retried, parallel, every failure a ckptkit error naming the object.

    Args:
        backend: the requests.
        scheme: for the URLs the messages name.
        part_size: objects above it are multipart (parts of this size, ``_THREADS`` at once).
        attempts: tries of one request before its transient failure is final (R-O20).
        backoff: seconds before the second try; doubled each time, capped at 2 s, jittered.
        probe: the client, without a test's wrapper, on which the bucket's conditional writes
            are checked before this process's first one (R-O49); None: not checked (a test's own backend).
    """

    def __init__(
        self,
        backend: Backend,
        scheme: str = "s3",
        *,
        part_size: int = PART_SIZE,
        attempts: int = 6,
        backoff: float = 0.05,
        probe: S3Backend | None = None,
    ) -> None:
        self.backend, self.scheme, self.part_size = backend, scheme, part_size
        self.attempts, self.backoff = attempts, backoff
        self.probe = probe

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.backend.bucket}/{key}"

    def _retry(self, op: str, key: str, fn: Callable[[], T], *, writing: bool) -> T:
        """``fn()``, again after each transient failure; the last one, or a refusal, as a ckptkit error."""
        for attempt in range(self.attempts):
            try:
                return fn()
            except TransientFault as e:
                if attempt == self.attempts - 1:
                    raise _exhausted(f"{self.url(key)}: {op} failed {self.attempts} times, last: {e}", writing) from e
                time.sleep(min(2.0, self.backoff * 2**attempt) * random.uniform(0.5, 1.0))
            except ObjectMissing:
                raise CheckpointNotFound(f"{self.url(key)}: no such object") from None
            except WriteConflict as e:
                raise CommitConflict(f"{self.url(key)}: already exists ({e})", path=self.url(key)) from None
            except RequestRefused as e:
                raise _failed(f"{self.url(key)}: {op} refused: {e}", writing) from e
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ writes

    def put(self, key: str, data: Body, *, if_absent: bool = False) -> str:
        """Create (``if_absent``: only create, R-O11) the object ``key`` holding ``data``; its ETag.
        Above the part size it goes up in parts, each read when it is sent (R-O21, R-O51).

        A conditional put retried after a transient failure may meet its own first attempt,
        which the store carried out before the connection dropped: a conflict is then ours
        when the object there holds exactly ``data`` (R-O20).
        """
        if if_absent:
            self._check_conditional_writes(key)
        attempt = self._own_retry(key, data)
        if len(data) > self.part_size:
            return self._put_parts(key, data, if_absent, attempt)
        body = piece(data, 0, len(data))
        return self._retry(
            "put", key, lambda: attempt(lambda: self.backend.put(key, body, if_absent=if_absent)), writing=True
        )

    def replace(self, key: str, data: bytes, etag: str) -> str:
        """Overwrite the small object ``key`` with ``data`` only while it is the object of ``etag``
        (``If-Match``: the run-directory lease's renewal and takeover, spec/lease.md R-LS11); its new ETag.

        Raises:
            CommitConflict: it is another object now (``CheckpointNotFound``: there is none).
        """
        attempt = self._own_retry(key, data)
        return self._retry("replace", key, lambda: attempt(lambda: self.backend.replace(key, data, etag)), writing=True)

    def delete_if(self, key: str, etag: str) -> None:
        """Remove ``key`` only while it is the object of ``etag`` (``If-Match``).

        Raises:
            CommitConflict: it is another object now (``CheckpointNotFound``: there is none).
        """
        self._retry("delete", key, lambda: self.backend.delete_if(key, etag), writing=True)

    def _check_conditional_writes(self, key: str) -> None:
        """Before this process's first conditional write to the bucket: the store enforces
        ``If-None-Match: *`` (R-O49), checked once per endpoint and bucket, unless the user vouches
        for a single writer (:data:`SINGLE_WRITER_ENV`).

        Raises:
            UnsupportedOption: it does not; the line names the endpoint, what failed and what to do.
        """
        if self.probe is None or single_writer_vouched():
            return
        ident = (self.probe.endpoint, self.probe.bucket)
        with _PROBED_LOCK:
            if ident not in _PROBED:
                _PROBED[ident] = _probe(ObjectStore(self.probe, self.scheme, backoff=self.backoff), key)
        why = _PROBED[ident]
        if why is not None:
            raise UnsupportedOption(
                f"{ident[0]} (bucket {ident[1]}): the store does not enforce conditional writes: {why}; "
                "ckptkit's commit and run lease rely on them (R-O49): use a store that enforces "
                f"If-None-Match, or, if only one job at a time ever writes there, set {SINGLE_WRITER_ENV}=1 "
                "(ckptkit train --single-writer-store)"
            )

    def _own_retry(self, key: str, data: Body) -> Callable[[Callable[[], str]], str]:
        """Runs a conditional write's attempts: a conflict met by a retry is the write's own first
        attempt when the object holds exactly ``data`` (R-O20)."""
        tried = [False]

        def attempt(fn: Callable[[], str]) -> str:
            try:
                return fn()
            except WriteConflict:
                if tried[0] and self._holds(key, data):
                    return self.etag(key) or ""
                raise
            finally:
                tried[0] = True

        return attempt

    def etag(self, key: str) -> str | None:
        """The object's ETag (what a put of it returned), or None when there is none."""
        return self._retry("head", key, lambda: self.backend.etag(key), writing=False)

    def _holds(self, key: str, data: Body) -> bool:
        """The object ``key`` is exactly ``data``, compared a part at a time."""

        def same(a: int, b: int) -> bool:
            return self._retry("get", key, lambda: self.backend.get(key, a, b), writing=False) == piece(data, a, b)

        try:
            return self.head(key) == len(data) and all(same(a, b) for a, b in self._spans(len(data)))
        except (TransientFault, ObjectMissing, RequestRefused, CheckpointError):
            return False

    def _spans(self, size: int) -> list[tuple[int, int]]:
        """``[start, end)`` of each part of an object of ``size`` bytes."""
        return [(i, min(i + self.part_size, size)) for i in range(0, size, self.part_size)]

    def _put_parts(self, key: str, data: Body, if_absent: bool, attempt: Callable[[Callable[[], str]], str]) -> str:
        """A multipart upload of ``data``, its parts in parallel, each read as it goes (R-O51),
        completed conditionally."""
        parts = _Parts(self, key)
        try:
            return parts.complete(data, if_absent, attempt)
        finally:
            parts.close()

    def put_written(
        self, key: str, write: Callable[[BinaryIO], object], then: Callable[[FileSpan], T], *, if_absent: bool = False
    ) -> tuple[str, T]:
        """Create the object ``key`` (``if_absent``: only create, R-O11) holding what ``write(f)``
        writes into a temporary file, uploaded while it is written: each part goes up as soon as the
        writer says its bytes are final, the rest once ``write`` returns (R-O52). ``then`` is given
        the written file while those last parts go up; its result is returned with the ETag. An object
        of at most the part size is one put, as :meth:`put`'s.

        Nothing is created before the upload completes: when ``write``, a part or ``then`` fails, the
        upload is aborted and the error raised.

        Raises:
            CommitConflict: ``if_absent`` and the object exists (R-O11).
            SaveFailed: a request failed, or writing the file did (an ``OSError``: a full disk), named.
        """
        if if_absent:
            self._check_conditional_writes(key)
        with tempfile.TemporaryFile(prefix="ckptkit-") as spool:
            fd = spool.fileno()
            parts = _Parts(self, key)
            try:
                with Followed(fd, _Streamed(parts, fd)) as f:
                    try:
                        write(f)
                    except CheckpointError:  # a part's failure (an OSError too), or the writer's own
                        raise
                    except OSError as e:
                        what = errno.errorcode.get(e.errno or 0, "I/O error")
                        raise SaveFailed(
                            f"{self.url(key)}: writing its local spool file failed ({what}: {e.strerror}); "
                            "nothing is uploaded (free space in the temporary directory, TMPDIR)",
                            cause=e,
                            path=self.url(key),
                        ) from e
                data = FileSpan(fd, os.fstat(fd).st_size)
                if parts.upload is None and len(data) <= self.part_size:
                    result = then(data)
                    return self.put(key, data, if_absent=if_absent), result
                parts.send_rest(data)
                result = then(data)
                return parts.complete(data, if_absent, self._own_retry(key, data)), result
            finally:
                parts.close()

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is gone)."""
        self._retry("delete", key, lambda: self.backend.delete(key), writing=True)

    # ------------------------------------------------------------------ reads

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """A small object's bytes (a record, a run's history, a lease), or its bytes ``[start, end)``
        (what a rank reads of a rank file, R-O33): one GET, retried as every request is (R-O20).
        A range past the object's end comes back short: the caller compares the length."""
        op = "get" if start is None else f"range {start}-{end}"
        return self._retry(op, key, lambda: self.backend.get(key, start, end), writing=False)

    def get_into(self, key: str, size: int, fd: int) -> int:
        """The object's bytes written into the open file ``fd`` from its start, ``size`` known (from
        a commit record): above the part size in parallel ranges, each written where it belongs as
        it comes off the connection, so no more than a piece per thread is ever in memory (R-O21,
        R-O51). Returns the number of bytes written: other than ``size`` when the object is."""
        if size <= self.part_size:
            return self._retry("get", key, lambda: self.backend.get_into(key, fd), writing=False)
        spans = self._spans(size)

        def fill(n: int) -> int:
            a, b = spans[n]
            return self._retry(f"range {a}-{b}", key, lambda: self.backend.get_into(key, fd, a, b), writing=False)

        return sum(_parallel(fill, len(spans)))

    def read(self, key: str) -> tuple[bytes, str]:
        """A small object's bytes and the ETag of exactly those bytes (for a later ``replace``)."""
        return self._retry("get", key, lambda: self.backend.read(key), writing=False)

    def head(self, key: str) -> int | None:
        """The object's size, or None when there is none."""
        return self._retry("head", key, lambda: self.backend.head(key), writing=False)

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        """``(key, size, last modified)`` of every object whose key starts with ``prefix``, sorted
        (the time in seconds since the epoch, as the store's clock gave it)."""
        return self._retry("list", prefix, lambda: self.backend.list(prefix), writing=False)


def single_writer_vouched() -> bool:
    """The user vouches that one job at a time writes to the store (:data:`SINGLE_WRITER_ENV` is ``1``)."""
    return os.environ.get(SINGLE_WRITER_ENV) == "1"


#: ``(endpoint, bucket)``: None once the store passed the check, else what failed (R-O49).
_PROBED: dict[tuple[str, str], str | None] = {}
_PROBED_LOCK = threading.Lock()
#: The probe object's name starts with this; it sits beside the first object written.
PROBE_PREFIX = ".ckptkit-probe-"


def _probe(store: ObjectStore, near: str) -> str | None:
    """Two racing ``If-None-Match: *`` PUTs of a new key beside ``near`` (one must succeed and the
    other meet 412), then a GET that must return the winner's bytes; the key is removed after.
    Returns what failed, or None (R-O49).

    Raises:
        SaveFailed, UnreadableFile: a request failed (throttled past its retries, refused).
    """
    folder = near.rpartition("/")[0]
    key = f"{folder}/{PROBE_PREFIX}{uuid.uuid4().hex}" if folder else f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    bodies = [f"ckptkit conditional-write probe, writer {n}\n".encode() for n in (1, 2)]
    start = threading.Barrier(2)

    def racer(n: int) -> bool:
        start.wait(30)
        try:
            store.put(key, bodies[n], if_absent=True)
        except CommitConflict:
            return False
        return True

    try:
        won = _parallel(racer, 2)
        if won.count(True) != 1:
            return (
                f"{won.count(True)} of 2 racing If-None-Match: * PUTs of {store.url(key)} succeeded "
                "(expected 1, and 412 PreconditionFailed for the other)"
            )
        try:
            seen: bytes | None = store.get(key)
        except CheckpointNotFound:
            seen = None
        if seen != bodies[won.index(True)]:
            return f"a GET of {store.url(key)} right after its PUT did not return the bytes written"
        return None
    finally:
        with contextlib.suppress(CheckpointError):
            store.delete(key)


def _failed(message: str, writing: bool) -> Exception:
    return SaveFailed(message) if writing else UnreadableFile(message)


def _exhausted(message: str, writing: bool) -> Exception:
    """The error of a request whose every attempt failed transiently (R-O20, R-O50)."""
    message += "; the store is throttling (503 SlowDown) or failing (R-O50): try again once it answers"
    return SaveFailed(message) if writing else StoreUnavailable(message)


def _write_at(fd: int, data: bytes, offset: int) -> int:
    """All of ``data`` into ``fd`` at ``offset``; its length."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


class _Parts:
    """One multipart upload (R-O21): started with its first part, each part sent in the background on
    up to ``_THREADS`` threads, read from its span as it goes (R-O51); the object exists only once
    :meth:`complete` succeeds, and :meth:`close` aborts an upload that did not."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store, self.key = store, key
        self.upload: str | None = None
        self.sent: dict[int, Future[str]] = {}
        self.done = False
        self.pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="ckptkit-s3")

    def send(self, n: int, data: Body) -> None:
        """Part ``n`` (from 0) of ``data``, which holds at least its bytes, goes up in the background."""
        store, key = self.store, self.key
        if self.upload is None:
            self.upload = store._retry("start upload", key, lambda: store.backend.start_multipart(key), writing=True)
        upload, a, b = self.upload, n * store.part_size, min((n + 1) * store.part_size, len(data))
        self.sent[n] = self.pool.submit(
            store._retry,  # a fresh stream for each attempt
            f"part {n + 1}",
            key,
            lambda: store.backend.put_part(key, upload, n + 1, _window(data, a, b)),
            writing=True,
        )

    def check(self) -> None:
        """Raises: SaveFailed: a part sent earlier failed already (its error)."""
        error = next((f.exception() for f in self.sent.values() if f.done() and f.exception()), None)
        if error is not None:
            raise error

    def send_rest(self, data: Body) -> None:
        """Every part of ``data`` not sent yet."""
        for n in range(-(-len(data) // self.store.part_size)):
            if n not in self.sent:
                self.send(n, data)

    def complete(self, data: Body, if_absent: bool, attempt: Callable[[Callable[[], str]], str]) -> str:
        """The object, from every part of ``data`` once each went up, created conditionally; its ETag.

        Raises:
            SaveFailed: a part or the completion failed (the first part's error, in order).
            CommitConflict: ``if_absent`` and the object exists.
        """
        self.send_rest(data)
        etags = [self.sent[n].result() for n in range(len(self.sent))]
        store, key, upload = self.store, self.key, self.upload
        assert upload is not None  # a part was sent
        finish = lambda: store.backend.finish_multipart(key, upload, etags, if_absent=if_absent)  # noqa: E731
        etag = store._retry("complete upload", key, lambda: attempt(finish), writing=True)
        self.done = True
        return etag

    def close(self) -> None:
        """Wait for the parts in flight (those not started are dropped); an upload that did not
        complete is aborted, after them, so no part lands after the abort."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.upload is not None and not self.done:
            with contextlib.suppress(Exception):
                self.store.backend.abort_multipart(self.key, self.upload)


class _Streamed:
    """The :class:`~._io.Progress` of a file written as an object: each whole part the writer has
    written goes up at once, unless a held range (bytes it rewrites later) meets it; that one goes
    once the range is released, or after the writer returned (R-O52)."""

    def __init__(self, parts: _Parts, fd: int) -> None:
        self.parts, self.fd = parts, fd
        self.held: list[tuple[int, int]] = []
        self.next = 0  # the first part not looked at yet
        self.waiting: list[int] = []  # parts looked at, held then

    def hold(self, start: int, end: int) -> None:
        self.held.append((start, end))

    def release(self, start: int, end: int) -> None:
        """Send each part the released range held, unless another still holds it.

        Raises:
            SaveFailed: a part sent earlier failed.
        """
        self.parts.check()
        self.held.remove((start, end))
        for n in list(self.waiting):
            if not self._held(n):
                self.waiting.remove(n)
                self._send(n)

    def reached(self, pos: int) -> None:
        """Send each part now below ``pos`` and not held, once the object is sure to be multipart.

        Raises:
            SaveFailed: a part sent earlier failed: the writer stops, and the upload is aborted.
        """
        size = self.parts.store.part_size
        if pos <= size:  # it may still be one put
            return
        self.parts.check()
        while (self.next + 1) * size <= pos:
            if self._held(self.next):
                self.waiting.append(self.next)
            else:
                self._send(self.next)
            self.next += 1

    def _held(self, n: int) -> bool:
        size = self.parts.store.part_size
        return any(start < (n + 1) * size and n * size < end for start, end in self.held)

    def _send(self, n: int) -> None:
        self.parts.send(n, FileSpan(self.fd, (n + 1) * self.parts.store.part_size))


def _parallel(fn: Callable[[int], T], n: int) -> list[T]:
    """``[fn(0), ..., fn(n - 1)]`` on up to ``_THREADS`` threads; the first failure is raised."""
    if n <= 1:
        return [fn(i) for i in range(n)]
    with ThreadPoolExecutor(min(n, _THREADS), thread_name_prefix="ckptkit-s3") as pool:
        return list(pool.map(fn, range(n)))
