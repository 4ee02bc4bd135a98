"""Property tests take their example counts from the hypothesis profile (root ``conftest.py``).

A count written into a test cannot be widened by ``HYPOTHESIS_PROFILE=thorough``, so a
thorough run would silently test that property no harder than CI does.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from helpers import ROOT, examples
from hypothesis import settings


def _pinned_counts(path: Path) -> Iterator[int]:
    """Lines of ``path`` where a ``settings(...)`` call passes ``max_examples`` a literal."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name == "settings" and any(
            kw.arg == "max_examples" and isinstance(kw.value, ast.Constant) for kw in node.keywords
        ):
            yield node.lineno


def test_no_property_test_pins_its_example_count() -> None:
    files = sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / "examples").glob("*.py")])
    pinned = [f"{p.relative_to(ROOT)}:{line}" for p in files for line in _pinned_counts(p)]
    assert pinned == [], f"max_examples pinned to a number (write max_examples=examples(share)): {pinned}"


def test_the_pinned_count_finder_finds_one(tmp_path: Path) -> None:
    pinned = tmp_path / "test_x.py"
    pinned.write_text(
        "@settings(max_examples=300)\ndef f(): ...\n\n\n@hypothesis.settings(max_examples=examples(2))\ndef g(): ...\n"
    )
    assert list(_pinned_counts(pinned)) == [1]


def test_example_counts_scale_with_the_profile() -> None:
    settings.register_profile("_before_this_test", settings.default)
    try:
        settings.load_profile("ci")
        assert (examples(12), examples(1), examples(0.3), examples(0.001)) == (300, 25, 8, 1)
        settings.load_profile("thorough")
        assert (examples(12), examples(1), examples(0.3)) == (12000, 1000, 300)
    finally:
        settings.load_profile("_before_this_test")
