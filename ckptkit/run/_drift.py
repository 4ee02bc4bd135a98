"""Config drift: a resume is the same run, or it is a hard error (spec/snapshot.md).

On every resume the run's snapshot (:mod:`ckptkit.format._snapshot`) is diffed key by key
against the new config:

- keys that decide *when we look* (``steps``, ``log_every``, ``ckpt_every``,
  ``eval``, ``eval_every``: :data:`DEFAULT_EXEMPT`) may change; extending a
  finished run is a legitimate resume;
- every other difference is strict and :func:`check_resume` raises
  :class:`~ckptkit.errors.ConfigDrift` listing all of them at once.

Invariants:

- A key the snapshot has and the config lacks is strict drift (a dead key), never
  dropped; a field the snapshot lacks is compared at its declared default.

This module imports no torch: `ckptkit diff` and `verify` use it without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from ..errors import ConfigDrift, UnsupportedValue
from ..format._snapshot import (
    Snapshot,
    in_snapshot,
    is_config_instance,
    normalize_value,
    read_snapshot,
    snapshot_config,
)

__all__ = ["DEFAULT_EXEMPT", "KeyDiff", "check_resume", "diff_keys"]

DEFAULT_EXEMPT: frozenset[str] = frozenset({"steps", "log_every", "ckpt_every", "eval", "eval_every"})
"""Leaf names that may change on resume: they decide when we look, never what the
model computes (spec/snapshot.md R-S08). A name matches at any nesting depth."""

Kind = Literal["changed", "only_old", "only_new"]
_KINDS = ("changed", "only_old", "only_new")


@dataclasses.dataclass(frozen=True)
class KeyDiff:
    """One difference between two snapshots.

    Attributes:
        key: dotted path of the leaf (``"train.lr"``).
        old: the snapshot's value (``None`` when ``kind == "only_new"``).
        new: the config's value (``None`` when ``kind == "only_old"``).
        kind: ``"changed"``, ``"only_old"`` (a dead key the config no longer has)
            or ``"only_new"`` (a live key the snapshot never carried).
        exempt: True when the key is in the exempt class (allowed to change).
    """

    key: str
    old: Any
    new: Any
    kind: Kind
    exempt: bool

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {', '.join(_KINDS)} (got {self.kind!r})")

    @property
    def strict(self) -> bool:
        """True when this difference refuses a resume."""
        return not self.exempt

    def describe(self) -> str:
        """One human line, e.g. ``train.steps 1000 -> 2000: extending the run``."""
        old = "(absent)" if self.kind == "only_new" else _show(self.old)
        new = "(absent)" if self.kind == "only_old" else _show(self.new)
        line = f"{self.key} {old} -> {new}"
        return f"{line}: {self.note}" if self.note else line

    @property
    def note(self) -> str:
        """Why this difference matters or passes, in words ("" for a plain strict change)."""
        if self.kind == "only_old":
            note = "dead key, the config no longer has it"
        elif self.kind == "only_new":
            note = "the snapshot never carried this key"
        else:
            note = ""
        if not self.exempt:
            return note
        if self.kind == "changed" and _leaf(self.key) == "steps" and _is_number(self.old) and _is_number(self.new):
            return "extending the run" if self.new > self.old else "shortening the run"
        return f"{note}; exempt" if note else "exempt (decides when we look, not what the model computes)"

    def __str__(self) -> str:
        return self.describe()


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=True)


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(a: Any, b: Any) -> bool:
    """Exact equality of JSON values; numbers by value (1 == 1.0), never bool == int."""
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def flatten(table: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    for key, value in table.items():
        if not isinstance(key, str):
            raise TypeError(f"snapshot key {prefix}{key!r} is not a string")
        path = prefix + key
        if is_config_instance(value):
            value = snapshot_config(value)
        if isinstance(value, Mapping):
            flatten(value, path + ".", out)
            continue
        if path in out:
            raise ValueError(f"snapshot key {path} is given twice (once dotted, once nested)")
        out[path] = normalize_value(value, path)
    return out


def _as_flat(side: Any, name: str) -> dict[str, Any]:
    if isinstance(side, Snapshot):
        return flatten(side.config, "", {})
    if isinstance(side, Mapping):
        return flatten(side, "", {})
    if is_config_instance(side):
        return flatten(snapshot_config(side), "", {})
    raise TypeError(f"{name} must be a Snapshot, a mapping or a dataclass instance (got {type(side).__name__})")


def exempt_set(exempt: Iterable[str]) -> frozenset[str]:
    if isinstance(exempt, str):
        raise TypeError(f"exempt must be a set of key names, not the string {exempt!r}")
    names = frozenset(exempt)
    bad = sorted(repr(n) for n in names if not isinstance(n, str) or not n)
    if bad:
        raise TypeError(f"exempt names must be non-empty strings (got {', '.join(bad)})")
    return names


def is_exempt(key: str, exempt: frozenset[str]) -> bool:
    # A bare name matches the leaf at any depth; a dotted entry matches that exact path.
    return key in exempt or _leaf(key) in exempt


def diff_flat(old: dict[str, Any], new: dict[str, Any], exempt: frozenset[str]) -> list[KeyDiff]:
    out = []
    kind: Kind
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            kind, a, b = "only_old", old[key], None
        elif key not in old:
            kind, a, b = "only_new", None, new[key]
        elif _same(old[key], new[key]):
            continue
        else:
            kind, a, b = "changed", old[key], new[key]
        out.append(KeyDiff(key, a, b, kind, is_exempt(key, exempt)))
    return out


def diff_keys(old: Any, new: Any, *, exempt: Iterable[str] = DEFAULT_EXEMPT) -> list[KeyDiff]:
    """Compare two snapshots key by key and return every difference (R-S07, R-S08).

    Each side may be a :class:`Snapshot`, a nested table, a flat dict of dotted
    paths, or a dataclass instance. Tables are compared leaf by leaf under dotted
    paths (``train.lr``); lists are leaves. Numbers compare by value, exactly
    (``1 == 1.0``, no tolerance); ``True`` never equals ``1``.

    Args:
        old: the run's snapshot.
        new: the config about to run.
        exempt: key names allowed to change. A name without a dot matches the leaf
            name at any depth (``"steps"`` exempts ``train.steps``); a dotted name
            matches that exact path.

    Returns:
        Every difference, sorted by key. Empty when the two agree.

    Raises:
        UnsupportedValue: a side holds a value a snapshot cannot carry.
        TypeError: a side is none of the accepted shapes, or ``exempt`` is a string.

    Example:
        >>> diff_keys({"train": {"lr": 0.1, "steps": 10}}, {"train.lr": 0.2, "train.steps": 20})
        [KeyDiff(key='train.lr', old=0.1, new=0.2, kind='changed', exempt=False), \
KeyDiff(key='train.steps', old=10, new=20, kind='changed', exempt=True)]
    """
    return diff_flat(_as_flat(old, "old"), _as_flat(new, "new"), exempt_set(exempt))


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _declared_defaults(cfg: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """Dotted path -> declared default (JSON value) for every leaf of ``cfg``'s type that has one."""
    for f in dataclasses.fields(cfg):
        if not in_snapshot(f):
            continue
        path = prefix + f.name
        default = _field_default(f)
        if is_config_instance(default):
            _default_leaves(default, path + ".", out)
        elif default is not dataclasses.MISSING:
            _put_default(out, path, default)
        elif is_config_instance(getattr(cfg, f.name)):
            # A nested table with no default of its own: its fields' defaults apply.
            _declared_defaults(getattr(cfg, f.name), path + ".", out)
    return out


def _default_leaves(default: Any, prefix: str, out: dict[str, Any]) -> None:
    """Every leaf of a default table instance is a default."""
    for f in dataclasses.fields(default):
        if in_snapshot(f):
            value = getattr(default, f.name)
            if is_config_instance(value):
                _default_leaves(value, prefix + f.name + ".", out)
            else:
                _put_default(out, prefix + f.name, value)


def _put_default(out: dict[str, Any], path: str, value: Any) -> None:
    # A default no snapshot can carry is no default to assume: the key stays only_new.
    with contextlib.suppress(UnsupportedValue):
        out[path] = normalize_value(value, path)


def prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _with_defaults(old: dict[str, Any], declared: dict[str, Any]) -> dict[str, Any]:
    """Fill the keys an old snapshot lacks with the config's declared defaults (R-S09)."""
    present = set(old)
    ancestors = {p for key in old for p in prefixes(key)}
    filled = dict(old)
    for key, value in declared.items():
        # Only where the snapshot says nothing about this key, its table or its subtree.
        if key in present or key in ancestors or any(p in present for p in prefixes(key)):
            continue
        filled[key] = value
    return filled


def _drift_message(strict: list[KeyDiff], where: str | None) -> str:
    n = len(strict)
    source = f"the run's snapshot ({where})" if where else "the run's snapshot"
    lines = [f"config drift: {n} strict difference{'s' if n != 1 else ''} from {source}:"]
    lines += [f"  {d.describe()}" for d in strict]
    lines.append("resuming would continue a different run; restore these values, or start a new run in a new directory")
    return "\n".join(lines)


def check_resume(
    snapshot: Any,
    cfg: Any,
    *,
    exempt: Iterable[str] = DEFAULT_EXEMPT,
    defaults: Mapping[str, Any] | None = None,
) -> list[KeyDiff]:
    """Refuse a resume whose config differs from the run's snapshot in any strict key.

    A key the snapshot lacks is compared at the field's declared default, so a
    snapshot written before the field existed still loads, and setting the field
    to a non-default value is drift (R-S09). A key the config no longer has is a
    dead key and strict (R-S10).

    Args:
        snapshot: a :class:`Snapshot`, a path to a snapshot file, or a table.
        cfg: the resolved config of the run about to resume: a dataclass instance, or a
            nested table (a mapping, as :func:`~ckptkit.format._snapshot.table_config`).
        exempt: as :func:`diff_keys`.
        defaults: for a table ``cfg``, the declared defaults (dotted path -> value) of
            the keys an older snapshot may lack; a dataclass declares its own.

    Returns:
        The exempt differences (all of them pass); log ``d.describe()`` for each,
        e.g. ``train.steps 1000 -> 2000: extending the run``.

    Raises:
        ConfigDrift: one or more strict differences; the message lists every one
            and ``.differences`` holds them as :class:`KeyDiff` (R-S11).
        CheckpointNotFound, FormatError: ``snapshot`` is a path that cannot be read.
        UnsupportedValue: ``cfg`` holds a value a snapshot cannot carry.

    Example:
        >>> for d in check_resume(snapshot_path(ckpt), cfg):  # doctest: +SKIP
        ...     print(d.describe())
        train.steps 1000 -> 2000: extending the run
    """
    if isinstance(snapshot, (str, os.PathLike)):
        snapshot = read_snapshot(snapshot)
    where = snapshot.path if isinstance(snapshot, Snapshot) else None
    if isinstance(cfg, Mapping):
        declared = flatten(defaults or {}, "", {})
    elif is_config_instance(cfg):
        declared = _declared_defaults(cfg, "", {})
    else:
        raise UnsupportedValue(
            f"check_resume needs the config as a dataclass instance or a table (got {type(cfg).__name__})"
        )
    new = _as_flat(cfg, "cfg")
    # Only a key the config has is compared at its default: an empty table (kwargs={}) has no leaf.
    old = _with_defaults(_as_flat(snapshot, "snapshot"), {k: v for k, v in declared.items() if k in new})
    diffs = diff_flat(old, new, exempt_set(exempt))
    strict = [d for d in diffs if d.strict]
    if strict:
        raise ConfigDrift(_drift_message(strict, where), strict)
    return diffs
