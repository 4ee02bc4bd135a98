"""TESTING AID for tests/test_trainer_distributed.py: one rank SIGKILLs itself half way through a save.

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
    from ckptkit.distributed import format as _fmt

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
