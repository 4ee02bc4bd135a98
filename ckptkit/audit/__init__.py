"""Recording read back and compared: where two runs part, tensor by tensor.

Compare (``ckptkit diff --tensors``), a loop's recording and its first difference,
audit and replay of any loop's command, and the plot of a run. Stands on
:mod:`ckptkit.run` and :mod:`ckptkit.guard`; no tool is imported here
(``tests/meta/test_layers.py``). spec/replay.md is the contract.
"""

from __future__ import annotations

from ..run._difference import Difference, first_row_difference
from ._commands import AuditPlan, AuditReport, ReplayPlan, audit_command, audit_crashes, replay_command
from ._compare import TensorDiff, compare_checkpoints, compare_states
from ._plot import PlotSummary, RunSeries, plot_run, read_series, render, spike_config_of
from ._recording import RunRecording, first_difference, first_divergence_in_files

__all__ = [
    "AuditPlan",
    "AuditReport",
    "Difference",
    "PlotSummary",
    "ReplayPlan",
    "RunRecording",
    "RunSeries",
    "TensorDiff",
    "audit_command",
    "audit_crashes",
    "compare_checkpoints",
    "compare_states",
    "first_difference",
    "first_divergence_in_files",
    "first_row_difference",
    "plot_run",
    "read_series",
    "render",
    "replay_command",
    "spike_config_of",
]
