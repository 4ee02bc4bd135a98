"""Recording read back and compared: where two runs part, tensor by tensor.

Compare (``ckptkit diff --tensors``), a loop's recording and its first difference,
audit and replay of any loop's command, and the plot of a run. Stands on
:mod:`ckptkit.run` and :mod:`ckptkit.guard`; no tool is imported here
(``tests/test_layers.py``). spec/replay.md is the contract.
"""

from __future__ import annotations

from ..run.difference import Difference
from .commands import AuditPlan, AuditReport, ReplayPlan, audit_command, replay_command
from .compare import TensorDiff, compare_checkpoints, compare_states
from .recording import RunRecording, first_difference, first_divergence_in_files

__all__ = [
    "AuditPlan",
    "AuditReport",
    "Difference",
    "ReplayPlan",
    "RunRecording",
    "TensorDiff",
    "audit_command",
    "compare_checkpoints",
    "compare_states",
    "first_difference",
    "first_divergence_in_files",
    "replay_command",
]
