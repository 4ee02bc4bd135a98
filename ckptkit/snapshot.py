"""Config snapshots: a resume is the same run, or it is a hard error (spec/snapshot.md).

A trainer's resolved config -- a dataclass, possibly with nested dataclass tables
(``model``, ``train``, ``data``) -- is written next to each checkpoint as
``<ckpt>.config.json``. On every resume the snapshot is diffed key by key against
the new config:

- keys that decide *when we look* (``steps``, ``log_every``, ``ckpt_every``,
  ``eval``, ``eval_every``: :data:`DEFAULT_EXEMPT`) may change; extending a
  finished run is a legitimate resume;
- every other difference is strict and :func:`check_resume` raises
  :class:`~ckptkit.errors.ConfigDrift` listing all of them at once.

Invariants:

- Every field is written. The only opt-out is ``field(metadata={"snapshot": False})``,
  and :func:`check_field_coverage` fails unless the opt-out is declared with a reason.
- Same config, same bytes: sorted keys, 2-space indent, ASCII, trailing newline.
- Floats round-trip exactly (shortest ``repr``); NaN and infinities are refused.
- A key the snapshot has and the config lacks is strict drift (a dead key), never
  dropped; a field the snapshot lacks is compared at its declared default.

This module imports no torch: it is part of the format core.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from .atomic import write_bytes_atomic
from .errors import (
    CheckpointNotFound,
    ConfigDrift,
    FormatError,
    UnsupportedValue,
    UnsupportedVersion,
)

__all__ = [
    "DEFAULT_EXEMPT",
    "CoverageReport",
    "KeyDiff",
    "Snapshot",
    "assert_field_coverage",
    "check_field_coverage",
    "check_resume",
    "diff_keys",
    "encode_snapshot",
    "read_small_file",
    "read_snapshot",
    "snapshot_config",
    "snapshot_path",
    "write_snapshot",
]

SCHEMA_VERSION = 1
"""The ``schema_version`` this module writes and the only one it reads (R-S03)."""

SNAPSHOT_SUFFIX = ".config.json"

DEFAULT_EXEMPT: frozenset[str] = frozenset({"steps", "log_every", "ckpt_every", "eval", "eval_every"})
"""Leaf names that may change on resume: they decide when we look, never what the
model computes (spec/snapshot.md R-S08). A name matches at any nesting depth."""

# A snapshot is a few kilobytes; anything this large is a checkpoint passed by mistake.
_MAX_SNAPSHOT_BYTES = 16 * 1024 * 1024

_TOP_KEYS = frozenset({"schema_version", "config_type", "config"})

Kind = Literal["changed", "only_old", "only_new"]
_KINDS = ("changed", "only_old", "only_new")


# --------------------------------------------------------------------------- snapshot


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A config snapshot as read from disk.

    Attributes:
        config: the nested config table (JSON values: tables are dicts).
        config_type: qualified name of the config class that wrote it (informational).
        schema_version: the file's ``schema_version``.
        path: the file it was read from, or ``None``.
    """

    config: dict[str, Any]
    config_type: str
    schema_version: int = SCHEMA_VERSION
    path: str | None = None


def snapshot_path(ckpt_path: str | os.PathLike[str]) -> str:
    """Return the snapshot file that belongs to a checkpoint: ``<ckpt>.config.json``.

    Example:
        >>> snapshot_path("run/step-00000120.ckpt")
        'run/step-00000120.ckpt.config.json'
    """
    return os.fspath(ckpt_path) + SNAPSHOT_SUFFIX


def _is_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _in_snapshot(f: dataclasses.Field[Any]) -> bool:
    return f.metadata.get("snapshot", True) is not False


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _refuse(where: str, value: Any, why: str, hint: str) -> UnsupportedValue:
    return UnsupportedValue(f"config field {where}: cannot snapshot {why} {value!r}; {hint}")


_SUPPORTED = "bool, int, float, str, None, list, tuple, Enum or a nested dataclass"


def _normalize(value: Any, where: str, active: tuple[int, ...] = ()) -> Any:
    """Turn one config value into its JSON value, refusing what JSON cannot carry exactly."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, enum.Enum):
        # Before int: an IntEnum is an int, but what we write is its value either way.
        return _normalize(value.value, where, active)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _refuse(
                where,
                value,
                "the non-finite float",
                'JSON has no NaN or infinity; use None for "no limit"',
            )
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_normalize(v, f"{where}[{i}]", active) for i, v in enumerate(value)]
    if _is_instance(value):
        return _table(value, where + ".", active)
    raise _refuse(
        where,
        value,
        f"a {type(value).__name__}",
        f"supported: {_SUPPORTED} (a dict becomes a nested dataclass)",
    )


def _table(cfg: Any, prefix: str, active: tuple[int, ...]) -> dict[str, Any]:
    if id(cfg) in active:
        raise UnsupportedValue(f"config field {prefix[:-1] or '<root>'}: the config contains itself (a cycle)")
    active = (*active, id(cfg))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if _in_snapshot(f):
            out[f.name] = _normalize(getattr(cfg, f.name), prefix + f.name, active)
    return out


def snapshot_config(cfg: Any) -> dict[str, Any]:
    """Return the config table of ``cfg``: every field, as JSON values.

    Nested dataclasses become nested tables, tuples become lists, enums their
    value. Fields with ``metadata={"snapshot": False}`` are left out (R-S05).

    Args:
        cfg: a dataclass instance.

    Returns:
        A nested ``dict`` ready for :func:`json.dumps`.

    Raises:
        UnsupportedValue: ``cfg`` is not a dataclass instance, or a field holds a
            value the snapshot cannot carry exactly (a dict, an object, NaN,
            infinity); the message names the field by its dotted path.

    Example:
        >>> @dataclasses.dataclass
        ... class Cfg:
        ...     lr: float = 3e-4
        ...     steps: int = 1000
        >>> snapshot_config(Cfg())
        {'lr': 0.0003, 'steps': 1000}
    """
    if not _is_instance(cfg):
        raise UnsupportedValue(f"a config snapshot needs a dataclass instance (got {type(cfg).__name__})")
    return _table(cfg, "", ())


def encode_snapshot(cfg: Any) -> bytes:
    """Return the canonical snapshot file bytes for ``cfg`` (R-S02, R-S03).

    Same config, same bytes: UTF-8 (ASCII-only) JSON, keys sorted, 2-space
    indent, no trailing spaces, one trailing newline.

    Raises:
        UnsupportedValue: as :func:`snapshot_config`.

    Example:
        >>> @dataclasses.dataclass
        ... class Cfg:
        ...     lr: float = 0.1
        >>> encode_snapshot(Cfg()).decode().splitlines()[1]
        '  "config": {'
    """
    doc = {
        "config": snapshot_config(cfg),
        "config_type": _qualname(type(cfg)),
        "schema_version": SCHEMA_VERSION,
    }
    text = json.dumps(doc, sort_keys=True, indent=2, separators=(",", ": "), ensure_ascii=True, allow_nan=False)
    return (text + "\n").encode("utf-8")


def write_snapshot(path: str | os.PathLike[str], cfg: Any) -> None:
    """Write the snapshot of ``cfg`` to ``path`` atomically (R-S01).

    Args:
        path: the snapshot file, normally ``snapshot_path(ckpt_path)``; write it
            before the checkpoint so a checkpoint never exists without it.
        cfg: a dataclass instance.

    Raises:
        UnsupportedValue: as :func:`snapshot_config`; nothing is written.
        SaveFailed: the write failed; the previous file at ``path`` is intact.

    Example:
        >>> write_snapshot(snapshot_path("run/step-00000120.ckpt"), cfg)  # doctest: +SKIP
    """
    write_bytes_atomic(path, encode_snapshot(cfg))


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-finite number {token}")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} overflows a float")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _check_keys(table: dict[str, Any], prefix: str, path: str | None) -> None:
    for key, value in table.items():
        if not key or "." in key:
            raise FormatError(
                f"table key {key!r} is not a field name",
                path=path,
                field=f"config.{prefix}{key}",
                hint="keys are dataclass field names: non-empty, no '.'",
            )
        if isinstance(value, dict):
            _check_keys(value, f"{prefix}{key}.", path)


def _decode(data: bytes, path: str | None) -> Snapshot:
    try:
        text = data.decode("utf-8")
        doc = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(
            f"not a config snapshot: invalid UTF-8 JSON ({e})",
            path=path,
            hint="a snapshot is the <ckpt>.config.json file written next to a checkpoint",
        ) from None
    if not isinstance(doc, dict):
        raise FormatError(
            "not a config snapshot: the document is not a JSON object",
            path=path,
            expected="object",
            actual=type(doc).__name__,
        )
    version = doc.get("schema_version")
    if type(version) is not int:
        raise FormatError("missing or non-integer schema_version", path=path, field="schema_version",
                          expected="integer", actual=json.dumps(version))
    if version != SCHEMA_VERSION:
        raise UnsupportedVersion(
            "unsupported snapshot schema_version",
            path=path,
            field="schema_version",
            expected=SCHEMA_VERSION,
            actual=version,
            hint="upgrade ckptkit to read it",
        )
    keys = set(doc)
    if keys != _TOP_KEYS:
        missing, extra = sorted(_TOP_KEYS - keys), sorted(keys - _TOP_KEYS)
        raise FormatError(
            "wrong top-level keys",
            path=path,
            expected="config, config_type, schema_version",
            actual=f"missing {missing}, unknown {extra}",
        )
    if not isinstance(doc["config_type"], str):
        raise FormatError("config_type is not a string", path=path, field="config_type",
                          expected="string", actual=json.dumps(doc["config_type"]))
    if not isinstance(doc["config"], dict):
        raise FormatError("config is not a table", path=path, field="config",
                          expected="object", actual=type(doc["config"]).__name__)
    _check_keys(doc["config"], "", path)
    return Snapshot(config=doc["config"], config_type=doc["config_type"], schema_version=version, path=path)


def read_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Read and validate a snapshot file (R-S02..R-S04, R-S06).

    Args:
        path: a ``*.config.json`` file.

    Returns:
        The :class:`Snapshot`.

    Raises:
        CheckpointNotFound: there is no file at ``path``.
        UnsupportedVersion: ``schema_version`` is not one this reader knows.
        FormatError: anything else wrong with the bytes: not UTF-8 JSON, NaN or an
            overflowing number, duplicate keys, wrong top-level keys, a table key
            that is not a field name, a file over 16 MiB.

    Example:
        >>> snap = read_snapshot("run/step-00000120.ckpt.config.json")  # doctest: +SKIP
        >>> snap.config["train"]["lr"]  # doctest: +SKIP
        0.0003
    """
    name = os.fspath(path)
    data = read_small_file(name, "config snapshot", missing="no config snapshot here",
                           hint="is this a checkpoint? its snapshot is <ckpt>.config.json")
    return _decode(data, name)


def read_small_file(path: str, what: str, *, missing: str, hint: str) -> bytes:
    """The bytes of a JSON file that is a few kilobytes (a snapshot, an environment
    record), refused unread beyond 16 MiB (R-S13).

    Raises:
        CheckpointNotFound: no file at ``path`` (message: ``"<path>: <missing>"``).
        FormatError: over 16 MiB, or unreadable (permissions, a directory...).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_SNAPSHOT_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{path}: {missing}") from None
    except OSError as e:
        raise FormatError(f"cannot read the {what} ({e.strerror})", path=path) from None
    if len(data) > _MAX_SNAPSHOT_BYTES:
        raise FormatError(f"file too large for a {what}", path=path, expected=f"<= {_MAX_SNAPSHOT_BYTES} bytes",
                          actual=f"> {_MAX_SNAPSHOT_BYTES}", hint=hint)
    return data


# --------------------------------------------------------------------------- diff


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
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _flatten(table: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    for key, value in table.items():
        if not isinstance(key, str):
            raise TypeError(f"snapshot key {prefix}{key!r} is not a string")
        path = prefix + key
        if _is_instance(value):
            value = snapshot_config(value)
        if isinstance(value, Mapping):
            _flatten(value, path + ".", out)
            continue
        if path in out:
            raise ValueError(f"snapshot key {path} is given twice (once dotted, once nested)")
        out[path] = _normalize(value, path)
    return out


def _as_flat(side: Any, name: str) -> dict[str, Any]:
    if isinstance(side, Snapshot):
        return _flatten(side.config, "", {})
    if isinstance(side, Mapping):
        return _flatten(side, "", {})
    if _is_instance(side):
        return _flatten(snapshot_config(side), "", {})
    raise TypeError(f"{name} must be a Snapshot, a mapping or a dataclass instance (got {type(side).__name__})")


def _exempt_set(exempt: Iterable[str]) -> frozenset[str]:
    if isinstance(exempt, str):
        raise TypeError(f"exempt must be a set of key names, not the string {exempt!r}")
    names = frozenset(exempt)
    bad = sorted(repr(n) for n in names if not isinstance(n, str) or not n)
    if bad:
        raise TypeError(f"exempt names must be non-empty strings (got {', '.join(bad)})")
    return names


def _is_exempt(key: str, exempt: frozenset[str]) -> bool:
    # A bare name matches the leaf at any depth; a dotted entry matches that exact path.
    return key in exempt or _leaf(key) in exempt


def _diff_flat(old: dict[str, Any], new: dict[str, Any], exempt: frozenset[str]) -> list[KeyDiff]:
    out = []
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            kind, a, b = "only_old", old[key], None
        elif key not in old:
            kind, a, b = "only_new", None, new[key]
        elif _same(old[key], new[key]):
            continue
        else:
            kind, a, b = "changed", old[key], new[key]
        out.append(KeyDiff(key, a, b, kind, _is_exempt(key, exempt)))
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
    return _diff_flat(_as_flat(old, "old"), _as_flat(new, "new"), _exempt_set(exempt))


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _declared_defaults(cfg: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """Dotted path -> declared default (JSON value) for every leaf of ``cfg``'s type that has one."""
    for f in dataclasses.fields(cfg):
        if not _in_snapshot(f):
            continue
        path = prefix + f.name
        default = _field_default(f)
        if _is_instance(default):
            _default_leaves(default, path + ".", out)
        elif default is not dataclasses.MISSING:
            _put_default(out, path, default)
        elif _is_instance(getattr(cfg, f.name)):
            # A nested table with no default of its own: its fields' defaults apply.
            _declared_defaults(getattr(cfg, f.name), path + ".", out)
    return out


def _default_leaves(default: Any, prefix: str, out: dict[str, Any]) -> None:
    """Every leaf of a default table instance is a default."""
    for f in dataclasses.fields(default):
        if _in_snapshot(f):
            value = getattr(default, f.name)
            if _is_instance(value):
                _default_leaves(value, prefix + f.name + ".", out)
            else:
                _put_default(out, prefix + f.name, value)


def _put_default(out: dict[str, Any], path: str, value: Any) -> None:
    try:
        out[path] = _normalize(value, path)
    except UnsupportedValue:
        pass  # a default no snapshot can carry is no default to assume: the key stays only_new


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _with_defaults(old: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """Fill the keys an old snapshot lacks with the config type's declared defaults (R-S09)."""
    present = set(old)
    ancestors = {p for key in old for p in _prefixes(key)}
    filled = dict(old)
    for key, value in _declared_defaults(cfg, "", {}).items():
        # Only where the snapshot says nothing about this key, its table or its subtree.
        if key in present or key in ancestors or any(p in present for p in _prefixes(key)):
            continue
        filled[key] = value
    return filled


def _drift_message(strict: list[KeyDiff], where: str | None) -> str:
    n = len(strict)
    source = f"the run's snapshot ({where})" if where else "the run's snapshot"
    lines = [f"config drift: {n} strict difference{'s' if n != 1 else ''} from {source}:"]
    lines += [f"  {d.describe()}" for d in strict]
    lines.append(
        "resuming would continue a different run; restore these values, "
        "or start a new run in a new directory"
    )
    return "\n".join(lines)


def check_resume(snapshot: Any, cfg: Any, *, exempt: Iterable[str] = DEFAULT_EXEMPT) -> list[KeyDiff]:
    """Refuse a resume whose config differs from the run's snapshot in any strict key.

    A key the snapshot lacks is compared at the field's declared default, so a
    snapshot written before the field existed still loads, and setting the field
    to a non-default value is drift (R-S09). A key the config no longer has is a
    dead key and strict (R-S10).

    Args:
        snapshot: a :class:`Snapshot`, a path to a snapshot file, or a table.
        cfg: the resolved config of the run about to resume (a dataclass instance).
        exempt: as :func:`diff_keys`.

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
    if not _is_instance(cfg):
        raise UnsupportedValue(f"check_resume needs the config as a dataclass instance (got {type(cfg).__name__})")
    old = _with_defaults(_as_flat(snapshot, "snapshot"), cfg)
    diffs = _diff_flat(old, _as_flat(cfg, "cfg"), _exempt_set(exempt))
    strict = [d for d in diffs if d.strict]
    if strict:
        raise ConfigDrift(_drift_message(strict, where), strict)
    return diffs


# --------------------------------------------------------------------------- coverage


@dataclasses.dataclass(frozen=True)
class CoverageReport:
    """What :func:`check_field_coverage` found.

    Attributes:
        fields: every leaf field of the config, as dotted paths, sorted.
        written: the keys the snapshot carries, sorted.
        problems: one line per violation, sorted by field; empty when ``ok``.
    """

    fields: tuple[str, ...]
    written: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.ok:
            return f"field coverage ok: the snapshot carries {len(self.written)} of {len(self.fields)} fields"
        head = f"field coverage: {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        return "\n".join([head + ":"] + [f"  {p}" for p in self.problems])


def _leaf_fields(cfg: Any, prefix: str, excluded_above: bool) -> list[tuple[str, bool]]:
    """(dotted path, excluded from the snapshot) for every leaf field of ``cfg``."""
    out: list[tuple[str, bool]] = []
    for f in dataclasses.fields(cfg):
        path = prefix + f.name
        excluded = excluded_above or not _in_snapshot(f)
        value = getattr(cfg, f.name)
        if _is_instance(value) and dataclasses.fields(value):
            out += _leaf_fields(value, path + ".", excluded)
        elif not _is_instance(value):
            out.append((path, excluded))
        # An empty nested table has no leaves to carry.
    return out


def _covered_by(path: str, names: Iterable[str]) -> str | None:
    for name in names:
        if path == name or path.startswith(name + "."):
            return name
    return None


_SCALAR_FLIPS: dict[type, Any] = {bool: True, int: 1, float: 1.0, str: "x"}


def _hint_for(owner: Any, name: str) -> Any:
    try:
        return typing.get_type_hints(type(owner)).get(name)
    except Exception:  # an unresolvable annotation just means no automatic flip
        return None


def _value_of_type(hint: Any) -> Any:
    """A non-None value of an annotated type, or MISSING when there is no obvious one."""
    if hint in _SCALAR_FLIPS:
        return _SCALAR_FLIPS[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(iter(hint), dataclasses.MISSING)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg is not type(None):
                value = _value_of_type(arg)
                if value is not dataclasses.MISSING:
                    return value
    if origin in (list, tuple):
        return origin()
    return dataclasses.MISSING


def _flip(value: Any, hint: Any) -> Any:
    """Another valid value of the same kind, or MISSING when none is obvious."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, enum.Enum):
        others = [m for m in type(value) if m is not value]
        return others[0] if others else dataclasses.MISSING
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        # One ulp: a snapshot that rounds floats (say "%.6g") is caught too.
        up = math.nextafter(value, math.inf)
        return up if math.isfinite(up) else math.nextafter(value, -math.inf)
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return _value_of_type(hint)
    if isinstance(value, (list, tuple)):
        if value:
            last = _flip(value[-1], None)
            return dataclasses.MISSING if last is dataclasses.MISSING else type(value)([*value[:-1], last])
        args = typing.get_args(hint)
        item = _value_of_type(args[0]) if args else dataclasses.MISSING
        return dataclasses.MISSING if item is dataclasses.MISSING else type(value)([item])
    return dataclasses.MISSING


def _get(cfg: Any, path: str) -> tuple[Any, Any]:
    """(value, owner instance) at a dotted path."""
    owner = cfg
    parts = path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return getattr(owner, parts[-1]), owner


def _replace(cfg: Any, path: str, value: Any) -> Any:
    """A copy of ``cfg`` with the field at ``path`` set to ``value``; runs ``__post_init__``."""
    head, _, rest = path.partition(".")
    if rest:
        value = _replace(getattr(cfg, head), rest, value)
    f = next(f for f in dataclasses.fields(cfg) if f.name == head)
    if f.init:
        return dataclasses.replace(cfg, **{head: value})
    clone = copy.copy(cfg)
    object.__setattr__(clone, head, value)
    return clone


def check_field_coverage(
    cfg_type_or_instance: Any,
    *,
    exempt_fields: Mapping[str, str] | None = None,
    flips: Mapping[str, Any] | None = None,
    exempt: Iterable[str] = DEFAULT_EXEMPT,
    snapshot: Callable[[Any], Mapping[str, Any]] = snapshot_config,
) -> CoverageReport:
    """Check the field-coverage invariant of a config type (R-S12).

    (a) The snapshot carries every leaf field of the config, nested tables
    included, compared by name and by count; a field left out (``metadata=
    {"snapshot": False}``) is a problem unless ``exempt_fields`` gives it a
    non-empty reason. (b) Flipping each field not in ``exempt_fields`` to another
    valid value makes :func:`diff_keys` report exactly that key, strict unless
    it is in ``exempt``: a key in the snapshot that the check ignores is decoration.

    Automatic flips: bool -> not, int -> +1, float -> next float up, str -> +"x",
    Enum -> another member, None -> a value of the annotated type, list/tuple ->
    last item flipped (or one item when empty). ``flips`` overrides them.

    Args:
        cfg_type_or_instance: a config dataclass, or a class whose fields all
            have defaults.
        exempt_fields: dotted path (or table) -> the reason it may be left out of
            the snapshot and is not flipped.
        flips: dotted path -> the value to flip that field to.
        exempt: as :func:`diff_keys`.
        snapshot: the function under test, ``cfg -> table``; default
            :func:`snapshot_config`.

    Returns:
        A :class:`CoverageReport`; ``report.ok`` is True when nothing is wrong.

    Raises:
        TypeError: the argument is not a dataclass, or the class cannot be built
            without arguments.

    Example:
        >>> report = check_field_coverage(TrainConfig, exempt_fields={"train.log_dir": "output path only"})  # doctest: +SKIP
        >>> report.ok  # doctest: +SKIP
        True
    """
    cfg = cfg_type_or_instance
    if isinstance(cfg, type) and dataclasses.is_dataclass(cfg):
        try:
            cfg = cfg()
        except TypeError as e:
            raise TypeError(f"{cfg.__qualname__} cannot be built without arguments ({e}); pass an instance") from None
    if not _is_instance(cfg):
        raise TypeError(f"check_field_coverage needs a dataclass or an instance (got {type(cfg).__name__})")
    exempt_fields = dict(exempt_fields or {})
    flips = dict(flips or {})
    exempt_names = _exempt_set(exempt)

    leaves = _leaf_fields(cfg, "", False)
    all_fields = sorted(path for path, _ in leaves)
    problems: list[tuple[str, str]] = []

    # Declared exemptions must name a field (or table) and give a reason.
    tables = {p for path in all_fields for p in _prefixes(path)}
    for name, reason in sorted(exempt_fields.items()):
        if name not in all_fields and name not in tables:
            problems.append((name, f"{name}: declared in exempt_fields but the config has no such field"))
        elif not isinstance(reason, str) or not reason.strip():
            problems.append((name, f"{name}: declared in exempt_fields without a reason; write why it cannot change a step"))
    for name in sorted(flips):
        if name not in all_fields:
            problems.append((name, f"{name}: given in flips but the config has no such field"))

    try:
        written = sorted(_flatten(snapshot(cfg), "", {}))
    except (UnsupportedValue, TypeError, ValueError) as e:
        problems.append(("", f"the snapshot of the config fails: {e}"))
        return CoverageReport(tuple(all_fields), (), tuple(p for _, p in sorted(problems)))

    # (a) every field is written, by name and by count.
    written_set = set(written)
    allowed_absent = {p for p in all_fields if _covered_by(p, exempt_fields)}
    for path, excluded in leaves:
        if path in written_set or path in allowed_absent:
            continue
        if excluded:
            problems.append((path, f'{path}: excluded from the snapshot (metadata={{"snapshot": False}}) without a reason; '
                                   f'declare it in exempt_fields={{"{path}": "why it cannot change a step"}}'))
        else:
            problems.append((path, f"{path}: a field of the config the snapshot does not carry"))
    for key in written:
        if key not in all_fields:
            problems.append((key, f"{key}: in the snapshot but not a field of the config"))
    expected = len(all_fields) - len(allowed_absent - written_set)
    if len(written) != expected:
        problems.append(("", f"count: the snapshot carries {len(written)} keys, the config has "
                             f"{len(all_fields)} fields ({len(allowed_absent - written_set)} exempt and absent)"))

    # (b) every carried, non-exempt field reaches diff_keys with the right class.
    base = _flatten(snapshot(cfg), "", {})
    for path, excluded in leaves:
        if path in allowed_absent or path not in written_set:
            continue
        value, owner = _get(cfg, path)
        new = flips[path] if path in flips else _flip(value, _hint_for(owner, path.rsplit(".", 1)[-1]))
        if new is dataclasses.MISSING:
            problems.append((path, f"{path}: no automatic flip for {value!r}; pass flips={{\"{path}\": <another valid value>}}"))
            continue
        try:
            flipped = _flatten(snapshot(_replace(cfg, path, new)), "", {})
        except Exception as e:  # the config's own validation may refuse the flip
            problems.append((path, f"{path}: flipping {value!r} -> {new!r} fails ({type(e).__name__}: {e}); "
                                   f"pass flips={{\"{path}\": <another valid value>}}"))
            continue
        diffs = _diff_flat(base, flipped, exempt_names)
        want_exempt = _is_exempt(path, exempt_names)
        if not diffs:
            problems.append((path, f"{path}: flipping {value!r} -> {new!r} does not reach diff_keys "
                                   f"(the snapshot carries it but does not change: decoration)"))
        elif [d.key for d in diffs] != [path]:
            keys = ", ".join(d.key for d in diffs)
            problems.append((path, f"{path}: flipping {value!r} -> {new!r} changes other keys ({keys})"))
        elif diffs[0].kind != "changed" or diffs[0].exempt != want_exempt:
            cls = "exempt" if diffs[0].exempt else "strict"
            problems.append((path, f"{path}: flipping {value!r} -> {new!r} is reported as {diffs[0].kind}, {cls} "
                                   f"(expected changed, {'exempt' if want_exempt else 'strict'})"))
    return CoverageReport(tuple(all_fields), tuple(written), tuple(p for _, p in sorted(problems)))


def assert_field_coverage(
    cfg_type_or_instance: Any,
    *,
    exempt_fields: Mapping[str, str] | None = None,
    flips: Mapping[str, Any] | None = None,
    exempt: Iterable[str] = DEFAULT_EXEMPT,
    snapshot: Callable[[Any], Mapping[str, Any]] = snapshot_config,
) -> CoverageReport:
    """Pytest helper: :func:`check_field_coverage`, raising when it finds a problem.

    Raises:
        AssertionError: the report is not ok; the message lists every problem.
            (Raised explicitly, so it survives ``python -O``.)

    Example:
        >>> def test_snapshot_carries_every_train_field():  # doctest: +SKIP
        ...     assert_field_coverage(TrainConfig, exempt_fields={"train.log_dir": "output path only"})
    """
    report = check_field_coverage(
        cfg_type_or_instance, exempt_fields=exempt_fields, flips=flips, exempt=exempt, snapshot=snapshot
    )
    if not report.ok:
        raise AssertionError(str(report))
    return report
