"""torchtitan's resolved job config as a run's config snapshot, and the resume check (spec/torchtitan.md).

torch-free and torchtitan-free: a job config is a tree of dataclasses (``Trainer.Config``
and the nested ``Config`` of every component), walked field by field. torchtitan's own
``to_dict()`` is not used: it writes a callable as its ``repr``, memory address included,
which would differ on every resume.

- :func:`job_table` turns the job config into a snapshot table (R-TT05): dataclasses and
  dicts become tables, a list holding tables becomes a table keyed ``"0"``, ``"1"``, ...
  (so a difference names ``model_spec.model.layers.1.attention.n_heads``), a function,
  class or ``functools.partial`` its qualified name (with the partial's arguments); any
  other value is a snapshot value (spec/snapshot.md R-S04) or refused, naming the field.
- :func:`check_job` refuses a resume whose job config differs in a strict key (R-TT06),
  with torchtitan's progress keys exempt (:data:`EXEMPT_KEYS`, :data:`EXEMPT_TABLES`) and
  the LR schedule's length compared as torchtitan resolves it (R-TT07).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigDrift, UnsupportedValue
from ..format._snapshot import is_config_instance, normalize_value
from ..run._drift import KeyDiff, check_resume, flatten

__all__ = ["EXEMPT_KEYS", "EXEMPT_TABLES", "STRICT_KEYS", "check_job", "job_table"]

EXEMPT_KEYS: frozenset[str] = frozenset(
    {
        "training.steps",  # extending the run; the LR schedule's length is compared on its own (R-TT07)
        "training.gc_freq",
        "training.gc_debug",
        "validator.enable",
        "validator.freq",
        "validator.steps",
        "debug.print_config",
        "debug.save_config_file",
        "debug.enable_structured_logging",
        "comm.init_timeout_seconds",
        "comm.train_timeout_seconds",
        "comm.trace_buf_size",
        "comm.save_traces_folder",
        "comm.save_traces_file_prefix",
        "dump_folder",
    }
)
"""Dotted keys of a torchtitan job config that may change on resume (R-TT06): they decide
how long the run goes, when it saves, logs or evaluates, and where files go -- never what a
training step computes."""

EXEMPT_TABLES: tuple[str, ...] = ("checkpoint", "metrics", "profiler")
"""Tables whose every key may change on resume (save cadence and retention, logging,
profiling), except :data:`STRICT_KEYS`."""

STRICT_KEYS: frozenset[str] = frozenset({"checkpoint.exclude_from_loading"})
"""Keys inside :data:`EXEMPT_TABLES` that stay strict: what a resume restores."""

_TOTAL = "lr_scheduler.total_steps"
_STEPS = "training.steps"


# ------------------------------------------------------------------ the job config as a table


def job_table(job_config: Any) -> dict[str, Any]:
    """The snapshot table of a torchtitan job config (R-TT05).

    Args:
        job_config: the resolved job config, a dataclass instance (``Trainer.Config``).

    Raises:
        UnsupportedValue: ``job_config`` is not a dataclass instance, or a field holds a
            value no snapshot can carry (named by its dotted path).
    """
    if not is_config_instance(job_config):
        raise UnsupportedValue(
            f"the torchtitan job config must be a dataclass instance such as Trainer.Config "
            f"(got {type(job_config).__name__})"
        )
    return _fields(job_config, "", ())


def _fields(cfg: Any, prefix: str, active: tuple[int, ...]) -> dict[str, Any]:
    if id(cfg) in active:
        raise UnsupportedValue(f"config field {prefix[:-1] or '<root>'}: the config contains itself (a cycle)")
    active = (*active, id(cfg))
    return {
        f.name: _value(getattr(cfg, f.name), prefix + f.name, active)
        for f in dataclasses.fields(cfg)
        if not f.name.startswith("_")
    }


def _value(v: Any, where: str, active: tuple[int, ...]) -> Any:
    if is_config_instance(v):
        return _fields(v, where + ".", active)
    if isinstance(v, Mapping):
        return {_key(k, where): _value(x, f"{where}.{k}", active) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        items = [_value(x, f"{where}.{i}", active) for i, x in enumerate(v)]
        return {str(i): x for i, x in enumerate(items)} if any(isinstance(x, dict) for x in items) else items
    if isinstance(v, functools.partial):
        args = [_text(a, where, active) for a in v.args]
        args += [f"{k}={_text(x, where, active)}" for k, x in sorted(v.keywords.items())]
        return f"functools.partial({', '.join([_name(v.func), *args])})"
    if isinstance(v, type) or _is_function(v):
        return _name(v)
    if type(v).__module__ == "torch" and type(v).__name__ == "dtype":
        return str(v)
    return normalize_value(v, where)


def _key(k: Any, where: str) -> str:
    if isinstance(k, enum.Enum):  # torchtitan keys sharding tables by MeshAxisName, a str Enum
        k = k.value
    if not isinstance(k, str) or not k or "." in k:
        raise UnsupportedValue(
            f"config field {where}: cannot snapshot the key {k!r}; table keys are non-empty strings without '.'"
        )
    return str(k)


def _text(v: Any, where: str, active: tuple[int, ...]) -> str:
    return json.dumps(_value(v, where, active), sort_keys=True, ensure_ascii=True)


def _is_function(v: Any) -> bool:
    return callable(v) and hasattr(v, "__qualname__") and hasattr(v, "__module__")


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"


# ------------------------------------------------------------------ the resume check


def _effective(table: Mapping[str, Any]) -> dict[str, Any]:
    """The flat table, with the LR schedule's length as torchtitan resolves it (R-TT07):
    ``lr_scheduler.total_steps`` unset means ``training.steps``."""
    flat = flatten(table, "", {})
    if _TOTAL in flat and flat[_TOTAL] is None and _STEPS in flat:
        flat[_TOTAL] = flat[_STEPS]
    return flat


def _exempt(keys: set[str]) -> set[str]:
    tables = {k for k in keys if k.split(".", 1)[0] in EXEMPT_TABLES}
    return (set(EXEMPT_KEYS) | tables) - STRICT_KEYS


def check_job(snapshot: Mapping[str, Any], job: Mapping[str, Any], where: str) -> list[KeyDiff]:
    """Refuse a resume whose job config differs from the checkpoint's in a strict key (R-TT06).

    Args:
        snapshot: the table the checkpoint stores (:func:`job_table` at save).
        job: the table of the job config about to resume.
        where: the checkpoint, for the message.

    Returns:
        The exempt differences (each passes; log ``d.describe()``).

    Raises:
        ConfigDrift: every strict difference, listed; ``.differences`` holds them.
    """
    old, new = _effective(snapshot), _effective(job)
    try:
        return check_resume(old, new, exempt=_exempt(set(old) | set(new)))
    except ConfigDrift as e:
        message = f"{where}: {e}"
        if any(d.key == _TOTAL for d in e.differences) and _total_unset(job):
            old_total = old.get(_TOTAL)
            message += (
                f"\n(lr_scheduler.total_steps is unset, so the LR schedule spans training.steps; to extend the run "
                f"with the schedule it trained on, pass --lr_scheduler.total_steps {_show(old_total)})"
            )
        raise ConfigDrift(message, e.differences) from None


def _total_unset(job: Mapping[str, Any]) -> bool:
    lr = job.get("lr_scheduler")
    return isinstance(lr, Mapping) and lr.get("total_steps") is None


def _show(v: Any) -> str:
    return json.dumps(v)
