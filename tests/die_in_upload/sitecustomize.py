"""TESTING AID for tests/run/test_objectstore_run.py: a run SIGKILLs itself in the middle of an upload.

Put this directory on ``PYTHONPATH`` and set ``CKPTKIT_TEST_DIE_AT_PUT=NAME``: the process
SIGKILLs itself when it is about to put the object whose key ends in ``/NAME`` -- a real
death mid-save, after the objects written before it and before its commit record.
"""

from __future__ import annotations

import os
import signal
from typing import Any

_WANT = os.environ.get("CKPTKIT_TEST_DIE_AT_PUT", "")

if _WANT:
    from ckptkit.format import _objectstore as _store

    _real = _store.S3Backend.put

    def _die_at_put(self: Any, key: str, data: bytes, *, if_absent: bool) -> str:
        if key.endswith("/" + _WANT):
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(self, key, data, if_absent=if_absent)

    _store.S3Backend.put = _die_at_put  # type: ignore[method-assign]
