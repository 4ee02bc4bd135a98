"""A run: the :class:`RunState` façade over one store, and what a run is made of.

A run directory's layout (names, discovery, retention: :mod:`~ckptkit.run.files`),
the registry of a run's state, the resume protocol (written once, for every store),
the stores (one file per step, a DCP directory per step), the group that lets rank 0
decide and every rank agree, config drift and field coverage, the environment,
(seed, step) randomness, preemption, ``history.jsonl`` and fingerprints. Stands on
:mod:`ckptkit.format` and :mod:`ckptkit.distributed`; never imports the guard, audit
or a tool (``tests/test_layers.py``). spec/runstate.md is the contract.
"""

from __future__ import annotations

from .drift import DEFAULT_EXEMPT, KeyDiff, check_resume, diff_keys
from .field_coverage import assert_field_coverage
from .files import CKPT_SUFFIX, DCP_SUFFIX, ENVIRONMENT_FILE, checkpoint_name, list_checkpoints, read_environment
from .history import History
from .rng import mask_stream, numpy_generator, step_rng, torch_generator
from .state import ResumeInfo, RunState

__all__ = [
    "CKPT_SUFFIX",
    "DCP_SUFFIX",
    "DEFAULT_EXEMPT",
    "ENVIRONMENT_FILE",
    "History",
    "KeyDiff",
    "ResumeInfo",
    "RunState",
    "assert_field_coverage",
    "check_resume",
    "checkpoint_name",
    "diff_keys",
    "list_checkpoints",
    "mask_stream",
    "numpy_generator",
    "read_environment",
    "step_rng",
    "torch_generator",
]
