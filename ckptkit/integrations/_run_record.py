"""What every integration's recording shares (spec/transformers.md R-HF07, lightning.md R-L09, torchtitan.md R-TT11).

A trainer's recorder writes the run's ``history.jsonl`` through the run's one
:class:`~ckptkit.run.History`, as ``RunState.record`` does for a loop. The three recorders
differ in where they hear of a step; they share how the history opens (a fresh one and
``environment.json``, or the resumed step's with the rows after it set aside and compared),
the digests cadence and a step's data digest, which live here once.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..errors import UnsupportedOption, UnsupportedValue
from ..format._atomic import write_bytes_atomic
from ..format._checkpoint import Checkpoint
from ..format._checks import is_int
from ..format._tree import checkpoint_state
from ..run import ENVIRONMENT_FILE, History
from ..run._environment import Fact
from ..run._fingerprint import data_digest
from ..run._resume_check import ResumeCheck

__all__ = ["SMALL_STATE", "check_cadence", "data_field", "open_history", "small_state"]

#: The registered state up to which the default cadence digests it after every optimizer
#: step; a larger state is digested at each checkpoint (R-HF08, R-L10, R-TT12).
SMALL_STATE = 64 << 20


def check_cadence(every: int | None, rule: str) -> None:
    """Refuse a ``digests_every`` other than None or an int >= 1.

    Raises:
        UnsupportedOption: naming the value and ``rule``.
    """
    if every is not None and not is_int(every, least=1):
        raise UnsupportedOption(
            f"digests_every={every!r}: a digests row every N optimizer steps needs an int N >= 1, "
            f"or None for the default cadence ({rule})"
        )


def open_history(
    out: str, log: logging.Logger, facts: dict[str, Fact], check: ResumeCheck | None, step: int
) -> tuple[History, list[str]]:
    """The run's history in ``out``, made this process's where training begins: with no
    ``check`` a fresh one and ``environment.json`` (``facts``); else the resumed ``step``'s,
    the rows after it set aside and compared by ``check`` (spec/determinism.md R-D20).
    Returns the history and the notes the resume made."""
    os.makedirs(out, exist_ok=True)
    history = History(out, log=log.info)
    if check is None:
        history.start_fresh()
        text = json.dumps(facts, sort_keys=True, indent=2) + "\n"
        write_bytes_atomic(os.path.join(out, ENVIRONMENT_FILE), text.encode())
        return history, []
    history.expect(check)
    return history, history.resume_at(step)


def data_field(row: dict[str, Any], batches: Any, said: bool, log: logging.Logger, rule: str) -> bool:
    """The step's batches as the row's ``data`` digest; a batch holding what has no digest (a
    collator's own objects) leaves the field out, said once (``said``: already said), and
    training goes on. Returns whether it has been said."""
    try:
        row["data"] = data_digest(batches)
    except UnsupportedValue as e:
        if not said:
            log.warning("history.jsonl: step rows record no data digest: %s (%s)", e, rule)
        return True
    return said


def small_state(ckpt: Checkpoint) -> bool:
    """Whether the tensors of a state come to at most :data:`SMALL_STATE` bytes."""
    tensors = checkpoint_state(ckpt).values()
    return bool(sum(v.numel() * v.element_size() for v in tensors if hasattr(v, "element_size")) <= SMALL_STATE)
