"""Lines that fit the terminal they are shown on (spec/trainer.md R-T15).

A line wider than the terminal is broken at its own separators — ``" | "`` between the
fields of a progress line, else spaces — and continued under a hanging indent, so the
terminal never wraps a word or a number in two. A command line is broken between its
arguments with a shell continuation (``" \\"``), so it can still be copied and run.
Where the stream is not a terminal (a log file, a pipe) nothing is broken: one message,
one line.
"""

from __future__ import annotations

import os
import shlex
import shutil
from typing import IO

__all__ = ["fit", "fit_command", "terminal_width"]


def terminal_width(stream: IO[str]) -> int | None:
    """The columns of the terminal ``stream`` is, or None when it is not one (or says 0 columns)."""
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return None
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):  # a pseudo-stream that claims a terminal
        columns = shutil.get_terminal_size((0, 0)).columns
    return columns if columns > 0 else None  # a pseudo-terminal whose size was never set: unknown


def _pack(head: str, parts: list[str], sep: str, width: int, indent: str, end: str = "") -> list[str]:
    lines, line = [], head
    for part in parts:
        joined = line + (sep if line.strip() else "") + part
        if line.strip() and len(joined) + len(end) > width:
            lines.append(line + end)
            line = indent + sep.lstrip() + part if sep.strip() else indent + part
        else:
            line = joined
    return [*lines, line]


def fit(text: str, width: int | None, indent: int) -> list[str]:
    """``text`` as lines of at most ``width`` columns (where its pieces allow), continued at ``indent``."""
    if width is None or len(text) <= width:
        return [text]
    body = text.lstrip(" ")
    sep = " | " if " | " in body else " "
    pieces: list[str] = []
    for piece in body.split(sep):
        if pieces and (not piece or pieces[-1].endswith(" ")):  # a run of spaces (padding) is not a break
            pieces[-1] += " " + piece
        else:
            pieces.append(piece)
    first, *rest = pieces
    return _pack(text[: len(text) - len(body)] + first, rest, sep, width, " " * indent)


def fit_command(head: str, command: str, width: int | None, indent: int) -> list[str]:
    """``head + command`` broken between the command's arguments (a flag kept with its value),
    each line but the last ending ``" \\"``; ``command`` is a ``shlex.join`` line."""
    if width is None or len(head) + len(command) <= width:
        return [head + command]
    words: list[str] = []
    for arg in shlex.split(command):
        pair = words and words[-1].startswith("--") and " " not in words[-1] and not arg.startswith("-")
        words[-1:] = [f"{words[-1]} {shlex.quote(arg)}"] if pair else [*words[-1:], shlex.quote(arg)]
    first, *rest = words
    return _pack(head + first, rest, " ", width, " " * indent, end=" \\")
