"""The field-coverage invariant: a config type's snapshot carries every field, and each one counts (R-S12).

Reflection over a config dataclass: (a) every leaf field is written to the snapshot
(or declared exempt with a reason), and (b) flipping each field to another valid
value reaches :func:`ckptkit.run.diff_keys` as exactly that key. A trainer runs it
in its tests so a new config field cannot silently escape the drift check
(spec/snapshot.md).

This module imports no torch.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import UnsupportedValue
from ..format._snapshot import in_snapshot, is_config_instance, snapshot_config
from ._drift import DEFAULT_EXEMPT, diff_flat, exempt_set, flatten, is_exempt, prefixes

__all__ = ["CoverageReport", "assert_field_coverage"]


@dataclasses.dataclass(frozen=True)
class CoverageReport:
    """What :func:`assert_field_coverage` found.

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
        excluded = excluded_above or not in_snapshot(f)
        value = getattr(cfg, f.name)
        if is_config_instance(value) and dataclasses.fields(value):
            out += _leaf_fields(value, path + ".", excluded)
        elif not is_config_instance(value):
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
    except Exception:  # noqa: BLE001 - an unresolvable annotation just means no automatic flip
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


def assert_field_coverage(
    cfg_type_or_instance: Any,
    *,
    exempt_fields: Mapping[str, str] | None = None,
    flips: Mapping[str, Any] | None = None,
    exempt: Iterable[str] = DEFAULT_EXEMPT,
    snapshot: Callable[[Any], Mapping[str, Any]] = snapshot_config,
) -> CoverageReport:
    """Check the field-coverage invariant of a config type (R-S12); a pytest helper.

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
        The :class:`CoverageReport` of a config with nothing wrong.

    Raises:
        AssertionError: a problem; the message lists every one. (Raised
            explicitly, so it survives ``python -O``.)
        TypeError: the argument is not a dataclass, or the class cannot be built
            without arguments.

    Example:
        >>> def test_snapshot_carries_every_train_field():  # doctest: +SKIP
        ...     assert_field_coverage(TrainConfig, exempt_fields={"train.log_dir": "output path only"})
    """
    cfg = _instance_of(cfg_type_or_instance)
    exempt_fields = dict(exempt_fields or {})
    flips = dict(flips or {})
    leaves = _leaf_fields(cfg, "", False)
    all_fields = sorted(path for path, _ in leaves)
    problems = _declaration_problems(all_fields, exempt_fields, flips)
    try:
        table = flatten(snapshot(cfg), "", {})
    except (UnsupportedValue, TypeError, ValueError) as e:
        problems.append(("", f"the snapshot of the config fails: {e}"))
        return _verdict(CoverageReport(tuple(all_fields), (), tuple(p for _, p in sorted(problems))))
    written = sorted(table)
    allowed_absent = {p for p in all_fields if _covered_by(p, exempt_fields)}
    problems += _carry_problems(leaves, all_fields, written, allowed_absent)
    for path, _ in leaves:
        if path not in allowed_absent and path in table:
            problem = _flip_problem(cfg, path, flips, table, snapshot, exempt_set(exempt))
            if problem:
                problems.append((path, problem))
    return _verdict(CoverageReport(tuple(all_fields), tuple(written), tuple(p for _, p in sorted(problems))))


def _verdict(report: CoverageReport) -> CoverageReport:
    if not report.ok:
        raise AssertionError(str(report))
    return report


def _instance_of(cfg: Any) -> Any:
    """The config instance to check: the argument, or its class built with no arguments."""
    if isinstance(cfg, type) and dataclasses.is_dataclass(cfg):
        try:
            cfg = cfg()
        except TypeError as e:
            raise TypeError(f"{cfg.__qualname__} cannot be built without arguments ({e}); pass an instance") from None
    if not is_config_instance(cfg):
        raise TypeError(f"assert_field_coverage needs a dataclass or an instance (got {type(cfg).__name__})")
    return cfg


def _declaration_problems(
    all_fields: list[str], exempt_fields: dict[str, str], flips: dict[str, Any]
) -> list[tuple[str, str]]:
    """Declared exemptions must name a field (or table) and give a reason; flips must name a field."""
    problems: list[tuple[str, str]] = []
    tables = {p for path in all_fields for p in prefixes(path)}
    for name, reason in sorted(exempt_fields.items()):
        if name not in all_fields and name not in tables:
            problems.append((name, f"{name}: declared in exempt_fields but the config has no such field"))
        elif not isinstance(reason, str) or not reason.strip():
            problems.append(
                (name, f"{name}: declared in exempt_fields without a reason; write why it cannot change a step")
            )
    for name in sorted(flips):
        if name not in all_fields:
            problems.append((name, f"{name}: given in flips but the config has no such field"))
    return problems


def _carry_problems(
    leaves: list[tuple[str, bool]], all_fields: list[str], written: list[str], allowed_absent: set[str]
) -> list[tuple[str, str]]:
    """(a) every field is written, by name and by count."""
    problems: list[tuple[str, str]] = []
    written_set = set(written)
    for path, excluded in leaves:
        if path in written_set or path in allowed_absent:
            continue
        if excluded:
            problems.append(
                (
                    path,
                    (
                        f'{path}: excluded from the snapshot (metadata={{"snapshot": False}}) without a reason; '
                        f'declare it in exempt_fields={{"{path}": "why it cannot change a step"}}'
                    ),
                )
            )
        else:
            problems.append((path, f"{path}: a field of the config the snapshot does not carry"))
    for key in written:
        if key not in all_fields:
            problems.append((key, f"{key}: in the snapshot but not a field of the config"))
    expected = len(all_fields) - len(allowed_absent - written_set)
    if len(written) != expected:
        problems.append(
            (
                "",
                (
                    f"count: the snapshot carries {len(written)} keys, the config has "
                    f"{len(all_fields)} fields ({len(allowed_absent - written_set)} exempt and absent)"
                ),
            )
        )
    return problems


def _flip_problem(
    cfg: Any,
    path: str,
    flips: dict[str, Any],
    base: dict[str, Any],
    snapshot: Callable[[Any], Mapping[str, Any]],
    exempt_names: frozenset[str],
) -> str | None:
    """(b) flipping the carried field at ``path`` reaches diff_keys as exactly that key, rightly classed."""
    value, owner = _get(cfg, path)
    new = flips[path] if path in flips else _flip(value, _hint_for(owner, path.rsplit(".", 1)[-1]))
    if new is dataclasses.MISSING:
        return f'{path}: no automatic flip for {value!r}; pass flips={{"{path}": <another valid value>}}'
    try:
        flipped = flatten(snapshot(_replace(cfg, path, new)), "", {})
    except Exception as e:  # noqa: BLE001 - the config's own validation may refuse the flip, any way it likes
        return (
            f"{path}: flipping {value!r} -> {new!r} fails ({type(e).__name__}: {e}); "
            f'pass flips={{"{path}": <another valid value>}}'
        )
    diffs = diff_flat(base, flipped, exempt_names)
    want_exempt = is_exempt(path, exempt_names)
    if not diffs:
        return (
            f"{path}: flipping {value!r} -> {new!r} does not reach diff_keys "
            f"(the snapshot carries it but does not change: decoration)"
        )
    if [d.key for d in diffs] != [path]:
        keys = ", ".join(d.key for d in diffs)
        return f"{path}: flipping {value!r} -> {new!r} changes other keys ({keys})"
    if diffs[0].kind != "changed" or diffs[0].exempt != want_exempt:
        cls = "exempt" if diffs[0].exempt else "strict"
        return (
            f"{path}: flipping {value!r} -> {new!r} is reported as {diffs[0].kind}, {cls} "
            f"(expected changed, {'exempt' if want_exempt else 'strict'})"
        )
    return None
