"""Config snapshots: the resolved config written next to each checkpoint (spec/snapshot.md).

A trainer's resolved config -- a dataclass, possibly with nested dataclass tables
(``model``, ``train``, ``data``) -- is written next to each checkpoint as
``<ckpt>.config.json``. This module encodes and decodes that file; comparing it
with the config of a resume is :mod:`ckptkit.run._drift`, and proving that a config type
is carried whole is :mod:`ckptkit.run._field_coverage`.

Invariants:

- Every field is written. The only opt-out is ``field(metadata={"snapshot": False})``,
  and :func:`~ckptkit.run.assert_field_coverage` fails unless the opt-out is
  declared with a reason.
- Same config, same bytes: sorted keys, 2-space indent, ASCII, trailing newline.
- Floats round-trip exactly (shortest ``repr``); NaN and infinities are refused.

This module imports no torch: it is part of the format core.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from ..errors import (
    CheckpointNotFound,
    FormatError,
    UnsupportedValue,
    UnsupportedVersion,
)
from ._atomic import write_bytes_atomic
from ._io import open_regular

__all__ = [
    "SNAPSHOT_SUFFIX",
    "Snapshot",
    "encode_snapshot",
    "read_small_file",
    "read_snapshot",
    "snapshot_config",
    "snapshot_path",
    "table_config",
    "write_snapshot",
]

SCHEMA_VERSION = 1
"""The ``schema_version`` this module writes and the only one it reads (R-S03)."""

SNAPSHOT_SUFFIX = ".config.json"

# A snapshot is a few kilobytes; anything this large is a checkpoint passed by mistake.
_MAX_SNAPSHOT_BYTES = 16 * 1024 * 1024

_TOP_KEYS = frozenset({"schema_version", "config_type", "config"})


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


def is_config_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def in_snapshot(f: dataclasses.Field[Any]) -> bool:
    return f.metadata.get("snapshot", True) is not False


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _refuse(where: str, value: Any, why: str, hint: str) -> UnsupportedValue:
    return UnsupportedValue(f"config field {where}: cannot snapshot {why} {value!r}; {hint}")


_SUPPORTED = "bool, int, float, str, None, list, tuple, Enum or a nested dataclass"


def normalize_value(value: Any, where: str, active: tuple[int, ...] = ()) -> Any:
    """Turn one config value into its JSON value, refusing what JSON cannot carry exactly."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, enum.Enum):
        # Before int: an IntEnum is an int, but what we write is its value either way.
        return normalize_value(value.value, where, active)
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
        return [normalize_value(v, f"{where}[{i}]", active) for i, v in enumerate(value)]
    if is_config_instance(value):
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
        if in_snapshot(f):
            out[f.name] = normalize_value(getattr(cfg, f.name), prefix + f.name, active)
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
    if not is_config_instance(cfg):
        raise UnsupportedValue(f"a config snapshot needs a dataclass instance (got {type(cfg).__name__})")
    return _table(cfg, "", ())


def table_config(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Return a config given as a nested table (a mapping, not a dataclass), as JSON values.

    For configs a trainer owns as dicts (a ``TrainingArguments.to_dict()``): every key
    is a field name (R-S06) and every leaf a snapshot value (R-S04); a nested mapping
    is a nested table.

    Raises:
        UnsupportedValue: a key that is not a field name (empty, not a string, with a
            ``.``), or a leaf the snapshot cannot carry; the message names its dotted path.
    """
    out: dict[str, Any] = {}
    for key, value in table.items():
        if not isinstance(key, str) or not key or "." in key:
            raise UnsupportedValue(
                f"config field {prefix}{key!r}: cannot snapshot the key; table keys are non-empty strings without '.'"
            )
        path = prefix + key
        out[key] = table_config(value, path + ".") if isinstance(value, Mapping) else normalize_value(value, path)
    return out


def encode_snapshot(cfg: Any, config_type: str | None = None) -> bytes:
    """Return the canonical snapshot file bytes for ``cfg`` (R-S02, R-S03).

    Same config, same bytes: UTF-8 (ASCII-only) JSON, keys sorted, 2-space
    indent, no trailing spaces, one trailing newline.

    Args:
        cfg: a dataclass instance, or a nested table (:func:`table_config`).
        config_type: the ``config_type`` to write; default: the dataclass's qualified name
            (a table's: ``"builtins.dict"``).

    Raises:
        UnsupportedValue: as :func:`snapshot_config` and :func:`table_config`.

    Example:
        >>> @dataclasses.dataclass
        ... class Cfg:
        ...     lr: float = 0.1
        >>> encode_snapshot(Cfg()).decode().splitlines()[1]
        '  "config": {'
    """
    table = table_config(cfg) if isinstance(cfg, Mapping) else snapshot_config(cfg)
    doc = {
        "config": table,
        "config_type": config_type or _qualname(type(cfg)),
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
    """A snapshot's bytes as a :class:`Snapshot`: strict JSON, a known schema version, the fixed layout."""
    doc = _parse_json(data, path)
    version = _schema_version(doc, path)
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
        raise FormatError(
            "config_type is not a string",
            path=path,
            field="config_type",
            expected="string",
            actual=json.dumps(doc["config_type"]),
        )
    if not isinstance(doc["config"], dict):
        raise FormatError(
            "config is not a table", path=path, field="config", expected="object", actual=type(doc["config"]).__name__
        )
    _check_keys(doc["config"], "", path)
    return Snapshot(config=doc["config"], config_type=doc["config_type"], schema_version=version, path=path)


def _parse_json(data: bytes, path: str | None) -> dict[str, Any]:
    """The document as a JSON object: UTF-8, no duplicate keys, no NaN/Infinity, floats that fit."""
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
    return doc


def _schema_version(doc: dict[str, Any], path: str | None) -> int:
    """The document's ``schema_version``, which must be the one this ckptkit writes."""
    version = doc.get("schema_version")
    if type(version) is not int:
        raise FormatError(
            "missing or non-integer schema_version",
            path=path,
            field="schema_version",
            expected="integer",
            actual=json.dumps(version),
        )
    if version != SCHEMA_VERSION:
        raise UnsupportedVersion(
            "unsupported snapshot schema_version",
            path=path,
            field="schema_version",
            expected=SCHEMA_VERSION,
            actual=version,
            hint="upgrade ckptkit to read it",
        )
    return version


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
    data = read_small_file(
        name,
        "config snapshot",
        missing="no config snapshot here",
        hint="is this a checkpoint? its snapshot is <ckpt>.config.json",
    )
    return _decode(data, name)


def read_small_file(path: str, what: str, *, missing: str, hint: str) -> bytes:
    """The bytes of a JSON file that is a few kilobytes (a snapshot, an environment
    record), refused unread beyond 16 MiB (R-S13).

    Opened without blocking and checked to be a regular file before a byte is read
    (R-025): a FIFO, a directory or a device in its place is refused, never waited on.

    Raises:
        CheckpointNotFound: no file at ``path`` (message: ``"<path>: <missing>"``).
        UnreadableFile: something is there but is no readable regular file.
        FormatError: over 16 MiB.
    """
    try:
        fd, size = open_regular(path, what)
    except CheckpointNotFound:
        raise CheckpointNotFound(f"{path}: {missing}") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(_MAX_SNAPSHOT_BYTES + 1) if size <= _MAX_SNAPSHOT_BYTES else b""
    if size > _MAX_SNAPSHOT_BYTES or len(data) > _MAX_SNAPSHOT_BYTES:
        raise FormatError(
            f"file too large for a {what}",
            path=path,
            expected=f"<= {_MAX_SNAPSHOT_BYTES} bytes",
            actual=f"> {_MAX_SNAPSHOT_BYTES}",
            hint=hint,
        )
    return data
