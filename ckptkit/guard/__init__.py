"""Spike detection and rollback: the monitor, the guard, its ring and its record.

Stands on :mod:`ckptkit.run` (a guard watches a :class:`~ckptkit.RunState` loop and
uses only its public methods) and never on :mod:`ckptkit.audit` or a tool
(``tests/meta/test_layers.py``). spec/rollback.md is the contract.
"""

from __future__ import annotations

from ._config import RollbackConfig
from ._faults import GradSpike
from ._monitor import SpikeConfig, SpikeMonitor, Verdict
from ._rollback_record import RollbackEvent, RollbackRecord, skipped_batches
from ._spikeguard import Continue, Executed, Outcome, RolledBack, SpikeGuard

__all__ = [
    "Continue",
    "Executed",
    "GradSpike",
    "Outcome",
    "RollbackConfig",
    "RollbackEvent",
    "RollbackRecord",
    "RolledBack",
    "SpikeConfig",
    "SpikeGuard",
    "SpikeMonitor",
    "Verdict",
    "skipped_batches",
]
