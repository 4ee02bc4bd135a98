"""TESTING AID for tests/trainer/test_trainer_distributed.py: one rank SIGKILLs itself half way through a save
(or rank 0 half way through retention's delete, ``CKPTKIT_TEST_DIE_IN_DELETE`` below).

Put this directory on ``PYTHONPATH`` and set ``CKPTKIT_TEST_DIE_IN_SAVE=RANK:STEP``: the
process whose ``RANK`` (set by torchrun) is RANK truncates its data file of checkpoint
STEP to half and kills itself with SIGKILL while writing it -- a real death mid-save,
not an exception. Any other process (the torchrun agent, other ranks) is untouched.
"""

from __future__ import annotations

import os
import signal
from typing import Any

_WANT = os.environ.get("CKPTKIT_TEST_DIE_IN_SAVE", "")

if _WANT and _WANT.partition(":")[0] == os.environ.get("RANK"):
    from ckptkit.distributed import _format as _fmt

    _step = int(_WANT.partition(":")[2])
    _real = _fmt.write_framed

    def _die_in_save(f: Any, *args: Any, **kwargs: Any) -> Any:
        if f"step-{_step:08d}.dcp" not in str(getattr(f, "name", "")):
            return _real(f, *args, **kwargs)
        _real(f, *args, **kwargs)
        f.flush()
        os.ftruncate(f.fileno(), f.tell() // 2)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL was sent")

    _fmt.write_framed = _die_in_save

# ``CKPTKIT_TEST_DIE_IN_DELETE=STEP``: rank 0 SIGKILLs itself half way through retention's
# delete of checkpoint STEP -- uncommitted (its metadata gone) and one rank file removed,
# the other and the companions left: a real death mid-delete.
_DELETE = os.environ.get("CKPTKIT_TEST_DIE_IN_DELETE", "")

if _DELETE and os.environ.get("RANK") == "0":
    from ckptkit.run import _dcp_store as _store

    _name = f"step-{int(_DELETE):08d}.dcp"
    _real_delete = _store.DcpStore.delete

    def _die_in_delete(self: Any, path: str) -> None:
        if os.path.basename(path) != _name:
            return _real_delete(self, path)
        os.unlink(os.path.join(path, "metadata.ckdcp"))
        os.unlink(os.path.join(path, "rank-00000.ckdcp"))
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL was sent")

    _store.DcpStore.delete = _die_in_delete  # type: ignore[method-assign]

# One process (no ``RANK``): ``CKPTKIT_TEST_DIE_IN_FILE_SAVE=STEP`` SIGKILLs the process once the
# companions of step-STEP.ckpt are written, before its container; ``CKPTKIT_TEST_DIE_IN_FILE_DELETE=STEP``
# once retention has deleted that container, before its companions.
_FILE_SAVE = os.environ.get("CKPTKIT_TEST_DIE_IN_FILE_SAVE", "")
_FILE_DELETE = os.environ.get("CKPTKIT_TEST_DIE_IN_FILE_DELETE", "")

if (_FILE_SAVE or _FILE_DELETE) and "RANK" not in os.environ:
    from ckptkit.run import _file_store as _files

    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL was sent")

    if _FILE_SAVE:
        _real_writer = _files.container_writer

        def _die_in_file_save(ckpt: Any, *args: Any, **kwargs: Any) -> Any:
            if ckpt.step == int(_FILE_SAVE):  # its companions written, its container not
                _die()
            return _real_writer(ckpt, *args, **kwargs)

        _files.container_writer = _die_in_file_save
    if _FILE_DELETE:
        _real_file_delete, _delete_name = _files.FileStore.delete, f"step-{int(_FILE_DELETE):08d}.ckpt"

        def _die_in_file_delete(self: Any, path: str) -> None:
            if os.path.basename(path) != _delete_name:
                return _real_file_delete(self, path)
            os.unlink(path)
            _die()

        _files.FileStore.delete = _die_in_file_delete  # type: ignore[method-assign]
