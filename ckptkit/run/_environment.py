"""The environment is part of the run: facts outside the config that change the numbers.

Concept: the same config and the same checkpoint give different floats under a
different torch version, intra-op thread count (reductions split differently),
deterministic-algorithms mode, default dtype, TF32 switches or GPU. A run records
:func:`capture` when it starts; a resume compares it with :func:`check_environment`
and refuses on any difference unless the user overrides (``--allow-env-change``),
in which case the caller records the returned differences in the run history.

Invariants (spec/determinism.md, rules R-D09..R-D12):

- :func:`capture` returns a flat dict with sorted ``str`` keys and ``str`` /
  ``int`` / ``bool`` values, stable within a process while nothing is changed.
- A fact recorded but not captured now, or captured with another value (type
  included: ``True`` is not ``1``), is drift. A fact captured now but absent
  from the recording (an older ckptkit recorded fewer facts) is reported, not
  fatal: the old value is unknowable, and refusing every resume after an
  upgrade would teach users to pass the override by reflex.
- ``import ckptkit.run._environment`` does not import torch; :func:`capture` does.

Example::

    recorded = capture()                      # at run start, stored with the run
    diffs = check_environment(recorded, capture(), allow=args.allow_env_change)
    for d in diffs:
        history.append({"env_override": str(d)})
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Mapping
from typing import Any

from ..errors import EnvironmentDrift, MalformedIndex

__all__ = ["ENV_HINT", "EnvDiff", "Fact", "capture", "check_environment", "diff_environment"]

Fact = str | int | bool
ENV_HINT = "pass --allow-env-change to resume anyway (the override is recorded in the run history)"
_ABSENT = "none"  # the value of a fact that does not apply here (no CUDA, no cuDNN)


def capture() -> dict[str, Fact]:
    """The facts of this process that change the numbers, with sorted keys.

    Keys (spec/determinism.md R-D09): ``python``, ``python_implementation``,
    ``numpy``, ``torch``, ``platform_machine``, ``platform_system``,
    ``intra_op_threads``, ``inter_op_threads``, ``deterministic_algorithms``,
    ``deterministic_algorithms_warn_only``, ``default_dtype``,
    ``float32_matmul_precision``, ``mkldnn_enabled``, ``cuda``, ``cuda_device``,
    ``cudnn``, ``cudnn_deterministic``, ``cudnn_benchmark``, ``cudnn_allow_tf32``,
    ``cuda_matmul_allow_tf32``, ``cuda_matmul_allow_fp16_reduced_precision``,
    ``cuda_matmul_allow_bf16_reduced_precision``. Versions and names are strings,
    thread counts ints, switches bools; a fact that does not apply is ``"none"``.

    Returns:
        A new dict, keys sorted.

    Example::

        >>> capture()["intra_op_threads"] >= 1
        True
    """
    import numpy as np
    import torch  # lazy: the format core imports this module without torch

    cuda_available = torch.cuda.is_available()
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    matmul = torch.backends.cuda.matmul
    facts: dict[str, Fact] = {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "numpy": str(np.__version__),
        "torch": str(torch.__version__),
        "platform_machine": platform.machine(),
        "platform_system": platform.system(),
        "intra_op_threads": int(torch.get_num_threads()),
        "inter_op_threads": int(torch.get_num_interop_threads()),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "deterministic_algorithms_warn_only": bool(torch.is_deterministic_algorithms_warn_only_enabled()),
        "default_dtype": str(torch.get_default_dtype()),
        "float32_matmul_precision": str(torch.get_float32_matmul_precision()),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "cuda": str(torch.version.cuda) if torch.version.cuda else _ABSENT,
        # Another GPU model runs other kernels; naming it initialises CUDA, which a
        # GPU run has done anyway.
        "cuda_device": torch.cuda.get_device_name(0) if cuda_available else _ABSENT,
        "cudnn": str(cudnn_version) if cudnn_version is not None else _ABSENT,
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cuda_matmul_allow_tf32": bool(matmul.allow_tf32),
        "cuda_matmul_allow_fp16_reduced_precision": bool(matmul.allow_fp16_reduced_precision_reduction),
        "cuda_matmul_allow_bf16_reduced_precision": bool(matmul.allow_bf16_reduced_precision_reduction),
    }
    return dict(sorted(facts.items()))


@dataclasses.dataclass(frozen=True)
class EnvDiff:
    """One fact that differs between the recording and now.

    Attributes:
        key: the fact's name, as :func:`capture` spells it.
        recorded: the recorded value, or None if the recording lacks the fact.
        current: the value now, or None if this process did not capture it.
        fatal: False only for a fact missing from the recording (R-D11).
    """

    key: str
    recorded: Fact | None
    current: Fact | None
    fatal: bool

    def __str__(self) -> str:
        rec = "not recorded" if self.recorded is None else f"recorded {self.recorded}"
        cur = "not captured now" if self.current is None else f"now {self.current}"
        return f"{self.key}: {rec}, {cur}"

    def to_json(self) -> dict[str, Fact | None]:
        """The difference as a history row holds it (a ``resume`` row's ``env_diffs``, R-D12)."""
        return {"key": self.key, "recorded": self.recorded, "current": self.current}

    @classmethod
    def from_json(cls, obj: Any, name: str) -> EnvDiff:
        """:meth:`to_json`'s object read back.

        Raises:
            MalformedIndex: it is not a ``{key, recorded, current}`` object of facts (``name`` says where).
        """
        if (
            not isinstance(obj, Mapping)
            or not isinstance(obj.get("key"), str)
            or set(obj) != {"key", "recorded", "current"}
        ):
            raise MalformedIndex(f"must be an object with key, recorded and current (got {obj!r})", field=name)
        sides = {k: v for k, v in obj.items() if k != "key" and v is not None}
        _check_facts(sides, name)
        return cls(obj["key"], obj["recorded"], obj["current"], fatal=obj["recorded"] is not None)


def _check_facts(facts: Any, name: str) -> Mapping[str, Fact]:
    if not isinstance(facts, Mapping):
        raise MalformedIndex(f"must be a dict of facts (got {type(facts).__name__})", field=name)
    for key, value in facts.items():
        if not isinstance(key, str):
            raise MalformedIndex(f"fact name {key!r} is not a string", field=name)
        if not isinstance(value, (str, int)):  # bool is an int
            raise MalformedIndex(f"fact {key} has a {type(value).__name__}; facts are str, int or bool", field=name)
    return facts


def _same(a: Fact, b: Fact) -> bool:
    # Type-strict: True == 1 in Python, but a switch that became a count is drift.
    return type(a) is type(b) and a == b


def diff_environment(recorded: Mapping[str, Fact], current: Mapping[str, Fact]) -> list[EnvDiff]:
    """Every fact that differs between ``recorded`` and ``current``, sorted by key.

    Args:
        recorded: the facts stored with the run (from :func:`capture`).
        current: the facts of this process.

    Returns:
        One :class:`EnvDiff` per differing key, including keys on one side only;
        empty when the environments match.

    Raises:
        MalformedIndex: either side is not a dict of str -> str | int | bool.

    Example::

        >>> diff_environment({"intra_op_threads": 2}, {"intra_op_threads": 1})[0].fatal
        True
    """
    recorded = _check_facts(recorded, "environment.recorded")
    current = _check_facts(current, "environment.current")
    out = []
    for key in sorted(set(recorded) | set(current)):
        if key not in recorded:
            out.append(EnvDiff(key, None, current[key], fatal=False))
        elif key not in current:
            out.append(EnvDiff(key, recorded[key], None, fatal=True))
        elif not _same(recorded[key], current[key]):
            out.append(EnvDiff(key, recorded[key], current[key], fatal=True))
    return out


def check_environment(
    recorded: Mapping[str, Fact],
    current: Mapping[str, Fact] | None = None,
    *,
    allow: bool = False,
) -> list[EnvDiff]:
    """Refuse a resume whose environment differs from the recording.

    Args:
        recorded: the facts stored with the run.
        current: the facts now; :func:`capture` if None.
        allow: the user's override (``--allow-env-change``): return the
            differences instead of raising, for the caller to record.

    Returns:
        Every difference (fatal or not), sorted by key; the caller logs them and,
        when it overrode, records them in the run history.

    Raises:
        EnvironmentDrift: a fatal difference and ``allow`` is False. The message
            names every differing fact, one per line, then :data:`ENV_HINT`;
            ``differences`` holds the :class:`EnvDiff` list.
        MalformedIndex: as :func:`diff_environment`.

    Example::

        diffs = check_environment(snapshot["environment"], allow=args.allow_env_change)
    """
    diffs = diff_environment(recorded, capture() if current is None else current)
    fatal = [d for d in diffs if d.fatal]
    if fatal and not allow:
        lines = [f"the environment differs from the run's recording in {len(fatal)} fact(s):"]
        lines += [f"  {d}" for d in fatal]
        others = [d for d in diffs if not d.fatal]
        if others:
            lines.append("also new since the recording (not fatal):")
            lines += [f"  {d}" for d in others]
        lines.append(ENV_HINT)
        raise EnvironmentDrift("\n".join(lines), diffs)
    return diffs
