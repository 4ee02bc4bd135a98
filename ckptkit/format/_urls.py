"""Storage URLs: ``scheme://bucket/key`` parsed, the helper of :mod:`ckptkit.format._place`.

Every function that takes a path (``save``/``load``/``verify``/``open_checkpoint``,
``RunState``'s run directory, ``ckptkit.distributed``, the Lightning plug-in, the CLI)
asks the place (``place_for``, ``local_only``), whose one test is :func:`is_url`, so a URL
never becomes a local folder named ``s3:`` (spec/objectstore.md R-O01). ``s3://`` is served by
:mod:`ckptkit.format._objectstore` when the ``ckptkit[s3]`` extra is installed; any other
scheme, and a place that does not serve object storage, is refused naming what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import UnsupportedOption

__all__ = ["S3_EXTRA", "StorageURL", "is_url", "parse", "require_client"]

_SCHEME = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$", re.S)
#: How to install object-storage support (the message of a missing client names it).
S3_EXTRA = "pip install -c constraints.txt 'ckptkit[s3]'"
_SERVED = ("s3",)


@dataclass(frozen=True)
class StorageURL:
    """``s3://bucket/key``: ``key`` without leading or trailing ``/`` (``""``: the bucket's root)."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def child(self, name: str) -> StorageURL:
        """The URL of ``name`` under this one (a run directory's checkpoint)."""
        return StorageURL(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        """The last component of the key (``step-00000010.ckpt``)."""
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> StorageURL:
        """The URL of the "folder" the key sits in."""
        return StorageURL(self.scheme, self.bucket, self.key.rpartition("/")[0])


def is_url(path: object) -> bool:
    """True for a string (or path-like) of the form ``scheme://...``."""
    return isinstance(path, (str, os.PathLike)) and _SCHEME.match(os.fspath(path)) is not None


def parse(path: str | os.PathLike[str]) -> StorageURL:
    """``path`` as a storage URL this version serves (R-O01, R-O02).

    Raises:
        UnsupportedOption: not a URL, a scheme other than ``s3``, or no bucket (named).
    """
    text = os.fspath(path)
    m = _SCHEME.match(text)
    if m is None:
        raise UnsupportedOption(f"{text}: not a storage URL (expected s3://bucket/prefix)")
    scheme = m.group("scheme").lower()
    if scheme not in _SERVED:
        raise UnsupportedOption(
            f"{text}: the {scheme}:// scheme is not supported; ckptkit serves s3:// (S3 and S3-compatible "
            "stores, AWS_ENDPOINT_URL selects one); use s3:// or a local (or mounted) directory"
        )
    bucket, _, key = m.group("rest").partition("/")
    if not bucket:
        raise UnsupportedOption(f"{text}: no bucket (expected s3://bucket/prefix)")
    return StorageURL(scheme, bucket, key.strip("/"))


def require_client() -> None:
    """The S3 client is importable.

    Raises:
        UnsupportedOption: boto3 is missing; the message is the one line that installs it.
    """
    try:
        import boto3  # noqa: F401
    except ImportError:
        raise UnsupportedOption(f"s3:// needs the S3 client (boto3), which is not installed: {S3_EXTRA}") from None
