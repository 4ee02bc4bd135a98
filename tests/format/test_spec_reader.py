"""The reference reader in spec/container.md runs, stays small, and agrees with ckptkit.

The block is extracted from the spec and executed as written, so the spec's reader
cannot rot: a format change that the spec does not follow fails here.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptkit.format._container import Source, read_layout
from ckptkit.format._verify import section_infos

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
VALID_CKPT = sorted(n for n, e in MANIFEST["valid"].items() if e["kind"] == "checkpoint")
HEADER_RULES = ("R-001", "R-002", "R-003", "R-006")  # what a header-only reader can see
INVALID_CKPT = sorted(n for n, e in MANIFEST["invalid"].items() if e["reader"] == "load")


def _reader_source() -> str:
    text = (ROOT / "spec" / "container.md").read_text()
    section = text[text.index("## 13. Reference reader") :]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "spec/container.md §13 must hold exactly one python block"
    return blocks[0]


@pytest.fixture(scope="module")
def read_header() -> Callable[[Path], dict[str, Any]]:
    namespace: dict[str, Any] = {}
    exec(compile(_reader_source(), "spec/container.md#13", "exec"), namespace)
    return namespace["read_header"]


def test_reference_reader_uses_only_struct_and_stays_short() -> None:
    source = _reader_source()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported == {"struct"}
    assert len([ln for ln in source.splitlines() if ln.strip()]) <= 25


@pytest.mark.parametrize("name", VALID_CKPT)
def test_reference_reader_agrees_with_ckptkit_on_the_valid_fixture(
    read_header: Callable[[Path], dict[str, Any]], name: str
) -> None:
    path = FIXTURES / "valid" / name
    got = read_header(path)
    with Source(path) as src:
        layout = read_layout(src)
    assert (got["version"], got["step"], got["flags"]) == (layout.version, layout.step, layout.flags)
    assert got["lengths"] == {s.name: s.length for s in section_infos(layout)}


@pytest.mark.parametrize("name", INVALID_CKPT)
def test_reference_reader_refuses_the_header_level_invalid_fixtures(
    read_header: Callable[[Path], dict[str, Any]], name: str
) -> None:
    rule = MANIFEST["invalid"][name]["rule"]
    path = FIXTURES / "invalid" / name
    patches = MANIFEST["invalid"][name]["patch"]
    if rule in HEADER_RULES:
        with pytest.raises(ValueError, match=rule):
            read_header(path)
    elif isinstance(patches, list) and any(p["offset"] < 8 for p in patches):
        # A damaged magic: the reference reader checks no digest, so a flipped version bit reads as
        # an unsupported version there and as damage in ckptkit (R-005, spec/validation.md R-002).
        with pytest.raises(ValueError, match="R-002"):
            read_header(path)
    else:
        read_header(path)  # the header is intact; the damage is for the full reader to find
