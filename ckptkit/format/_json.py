"""Private: JSON a file holds, decoded with bounded work, for every floor that reads a small
JSON record (a commit record, spec/objectstore.md R-O46; a lease, spec/lease.md R-LS15).

Python's decoder recurses once per nesting level and converts integers of any length, so a
few hundred kilobytes of ``[[[[...`` or a 4000-digit number would surface as
``RecursionError``, ``ValueError`` or a huge number. :func:`loads_bounded` counts the
nesting first (outside strings, stopping at the bound), refuses an integer longer than a
u64 is (20 digits) before converting it, and refuses ``NaN``/``Infinity``, so its caller
sees one :class:`ValueError` it turns into its own ckptkit error: a
:class:`json.JSONDecodeError` for text that is not JSON, a plain one naming the bound broken.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_DIGITS", "loads_bounded"]

#: The longest integer a record may spell: 2^64 - 1 has 20 digits.
MAX_DIGITS = 20
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"')  # possessive: linear on any input
_BRACKET = re.compile(r"[\[\]{}]")


def _nesting_exceeds(text: str, most: int) -> bool:
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > most:
            return True
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _short_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-'))} digits")
    return int(digits)


def loads_bounded(text: str, most: int) -> Any:
    """``json.loads(text)`` for a document nested at most ``most`` levels, its integers at most
    :data:`MAX_DIGITS` digits long, without NaN/Infinity.

    Raises:
        json.JSONDecodeError: not JSON.
        ValueError: deeper nesting, a longer integer, or a constant such as NaN (in words a
            caller can show).
    """
    if _nesting_exceeds(text, most):
        raise ValueError(f"nesting deeper than {most}")
    return json.loads(text, parse_constant=_no_constant, parse_int=_short_int)
