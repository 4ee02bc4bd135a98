"""A run: the :class:`RunState` façade over one store, and what a run is made of.

A run directory's layout (names, discovery, retention: :mod:`~ckptkit.run._files`),
the registry of a run's state, the resume protocol (written once, for every store),
the stores (one file per step, a DCP directory per step), the group that lets rank 0
decide and every rank agree, config drift and field coverage, the environment,
(seed, step) randomness, preemption, ``history.jsonl`` and fingerprints. Stands on
:mod:`ckptkit.format` and :mod:`ckptkit.distributed`; never imports the guard, audit
or a tool (``tests/meta/test_layers.py``). spec/runstate.md is the contract.
"""

from __future__ import annotations

from ._difference import differing_names
from ._drift import DEFAULT_EXEMPT, KeyDiff, check_resume, diff_keys
from ._field_coverage import assert_field_coverage
from ._files import CKPT_SUFFIX, DCP_SUFFIX, ENVIRONMENT_FILE, checkpoint_name, list_checkpoints, read_environment
from ._fingerprint import (
    FINGERPRINT_FIELDS,
    checkpoint_digests,
    combine,
    float_bits,
    leaf_digest,
    leaf_digests,
    state_digest,
    step_rows,
    tensor_digest,
)
from ._history import History, HistoryCheck, check_history, compared_rows, kept_rows, read_rows
from ._lease import Lease, lease_for
from ._rng import (
    Stream,
    draw,
    mask_stream,
    numpy_generator,
    randint,
    sample_depth,
    step_rng,
    torch_generator,
    uniform,
    uniforms,
)
from ._state import ResumeInfo, RunState

__all__ = [
    "CKPT_SUFFIX",
    "DCP_SUFFIX",
    "DEFAULT_EXEMPT",
    "ENVIRONMENT_FILE",
    "FINGERPRINT_FIELDS",
    "History",
    "HistoryCheck",
    "KeyDiff",
    "Lease",
    "ResumeInfo",
    "RunState",
    "Stream",
    "assert_field_coverage",
    "check_history",
    "check_resume",
    "checkpoint_digests",
    "checkpoint_name",
    "combine",
    "compared_rows",
    "diff_keys",
    "differing_names",
    "draw",
    "float_bits",
    "kept_rows",
    "leaf_digest",
    "leaf_digests",
    "lease_for",
    "list_checkpoints",
    "mask_stream",
    "numpy_generator",
    "randint",
    "read_environment",
    "read_rows",
    "sample_depth",
    "state_digest",
    "step_rng",
    "step_rows",
    "tensor_digest",
    "torch_generator",
    "uniform",
    "uniforms",
]
