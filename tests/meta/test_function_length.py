"""No function in ``ckptkit/`` is longer than a screen without a reason a reader accepts.

A screen is 50 code lines: the body after the docstring, without blank or comment-only
lines (nested functions count in their parent). The longer ones are listed below with
their reason; a new long function fails here, and so does a listed one that got short.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from helpers import ROOT

SCREEN = 50
ACCEPTED = {
    "cli/_replay.py:add_parser": "a flag table reads best as one list, in --help order",
    "cli/_train.py:add_parser": "a flag table reads best as one list, in --help order",
}


def code_lines(source: str) -> Iterator[tuple[str, int]]:
    """``(name, code lines)`` of every function in ``source``, methods and nested ones included."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if not body:
            continue
        span = lines[body[0].lineno - 1 : node.end_lineno]
        yield node.name, sum(1 for line in span if line.strip() and not line.strip().startswith("#"))


def test_no_function_is_longer_than_a_screen_without_a_reason() -> None:
    package = ROOT / "ckptkit"
    long = {
        f"{path.relative_to(package)}:{name}": n
        for path in sorted(package.rglob("*.py"))
        for name, n in code_lines(path.read_text(encoding="utf-8"))
        if n > SCREEN
    }
    assert set(long) - set(ACCEPTED) == set(), f"longer than {SCREEN} code lines: split them into named steps: {long}"
    assert set(ACCEPTED) - set(long) == set(), "no longer long: take them off ACCEPTED"


def test_code_lines_skip_the_docstring_blank_lines_and_comments() -> None:
    source = (
        'def f():\n    """Doc.\n\n    More."""\n    x = 1\n\n    # why\n    def g():\n        return x\n    return g\n'
    )
    assert dict(code_lines(source)) == {"f": 4, "g": 1}
