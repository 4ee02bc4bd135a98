"""Spike detection and rollback: the monitor, the guard, its ring and its record.

Stands on :mod:`ckptkit.run` (a guard watches a :class:`~ckptkit.RunState` loop and
uses only its public methods) and never on :mod:`ckptkit.audit` or a tool
(``tests/test_layers.py``). spec/rollback.md is the contract.
"""

from __future__ import annotations

from .config import RollbackConfig
from .faults import GradSpike
from .monitor import SpikeConfig, SpikeMonitor, Verdict
from .rollback_record import RollbackEvent, RollbackRecord, skipped_batches
from .spikeguard import Continue, Executed, Outcome, RolledBack, SpikeGuard

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
