"""Private: the one rule for "an integer" a caller passes or a file holds, for every floor.

An ``int`` and never a ``bool`` (``True`` is an int to Python, but no step, count or size
is ever meant as one). Each check names the value as its caller spells it; the callers
keep their own exception where a file, not a caller, is wrong (``MalformedIndex``).
"""

from __future__ import annotations

import operator
from typing import Any, TypeGuard

__all__ = ["as_int", "check_int", "check_u64", "is_int", "is_number"]

_U64_END = 2**64


def is_int(value: Any, least: int | None = 0, below: int | None = None) -> TypeGuard[int]:
    """True for an ``int`` (not a bool) in ``[least, below)``; ``None`` leaves a bound open."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (least is None or value >= least) and (below is None or value < below)


def check_int(name: str, value: Any, least: int = 0) -> int:
    """``value``, an int >= ``least``.

    Raises:
        ValueError: "``name`` must be an int >= ``least`` (got ``value!r``)".
    """
    if not is_int(value, least):
        raise ValueError(f"{name} must be an int >= {least} (got {value!r})")
    return value


def check_u64(name: str, value: Any) -> int:
    """``value``, an int in [0, 2**64): what a u64 field of a file can hold.

    Raises:
        ValueError: "``name`` must be an integer in [0, 2**64) (got ``value!r``)".
    """
    if not is_int(value, 0, _U64_END):
        raise ValueError(f"{name} must be an integer in [0, 2**64) (got {value!r})")
    return value


def as_int(name: str, value: Any, least: int = 0, *, u64: bool = False) -> int:
    """``value`` as an int: anything with ``__index__`` (a numpy integer too), never a bool;
    >= ``least``, or with ``u64`` in [0, 2**64).

    Raises:
        TypeError: "``name`` must be an int (got <type>)".
        ValueError: "``name`` must be >= ``least`` (got N)", or "must be in [0, 2**64) (got N)".
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int (got bool)")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int (got {type(value).__name__})") from None
    if u64 and not 0 <= v < _U64_END:
        raise ValueError(f"{name} must be in [0, 2**64) (got {v})")
    if not u64 and v < least:
        raise ValueError(f"{name} must be >= {least} (got {v})")
    return v


def is_number(value: Any) -> bool:
    """True for an ``int`` or a ``float``, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
