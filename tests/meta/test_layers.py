"""The floors of ckptkit/ stay floors: imports point one way, no cycles, no reach-ins.

The package is built as floors (docs/architecture.md): bytes on disk (``format``) ->
DCP's storage (``distributed``) -> a run (``run``) -> the spike guard (``guard``) ->
record and compare (``audit``) -> the tools (``integrations``, ``testing``, then the
reference trainer, then the CLI) -> the faces. A module may import its own floor and
the floors below it, never one above; nothing in the library imports the trainer or the
CLI. The graph counts every import, at module level or inside a function (a lazy
import is still a dependency); only ``if TYPE_CHECKING:`` imports are left out, since
they never run. Every module inside a floor is a ``_module``: private to the package, its
folder's face is the public path (tests/meta/test_public_api.py). A private name of ``run/``
(``_registry``, a ``_name`` defined there, a private attribute of a run object) is used by
``run/`` alone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ckptkit"

#: floor of each folder (a top-level module not listed is the face: the top floor)
FLOORS = {
    "errors": 0,
    "format": 1,
    "distributed": 2,
    "run": 3,
    "guard": 4,
    "audit": 5,
    "integrations": 6,
    "testing": 6,
    "trainer": 7,
    "cli": 8,
}
TOP = 9


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.get(parts[1], TOP) if len(parts) > 1 else TOP


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """``(imported ckptkit module, line)`` for every import in ``path`` that runs."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_blocks(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ckptkit":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ckptkit":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            if len(subs) < len(node.names):
                yield target, node.lineno
            for sub in subs:
                yield sub, node.lineno


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    known = set(mods)
    return {m: [(t, line) for t, line in imports(m, p, known) if t != m] for m, p in mods.items()}


def cycles(g: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _line in g.get(v, []):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle() -> None:
    found = cycles(graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_climbs_a_floor() -> None:
    climbs = [
        f"{m} (line {line}) imports {t}: floor {floor(m)} -> {floor(t)}"
        for m, edges in graph().items()
        for t, line in edges
        if floor(t) > floor(m)
    ]
    assert climbs == [], "\n".join(climbs)


def test_the_library_never_imports_the_trainer_or_the_cli() -> None:
    tools = ("ckptkit.trainer", "ckptkit.cli")
    bad = [
        f"{m} (line {line}) imports {t}"
        for m, edges in graph().items()
        if floor(m) < FLOORS["trainer"]
        for t, line in edges
        if t.startswith(tools)
    ]
    assert bad == [], "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(value: ast.expr) -> bool:
    """``self._x`` / ``cls._x``: an object's own private attribute, not a reach-in."""
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


#: rooms of ``run/`` that no other floor enters. Every module inside a floor is ``_private``
#: to the package (users import the faces); these few are private to ``run/`` itself.
RUN_ONLY_ROOMS = {"_registry"}


def _private_names_of_run() -> set[str]:
    """The run-only rooms, and the private top-level names and ``self._x`` attributes of ``run/``."""
    names: set[str] = set(RUN_ONLY_ROOMS)
    for path in (PACKAGE / "run").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.update({node.attr} if _private(node.attr) else set())
    return names


def test_nothing_outside_run_touches_a_private_name_of_run() -> None:
    private = _private_names_of_run()
    assert {"_registry", "_reg", "_store", "_group"} <= private  # the rule is about something
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "run") in path.parents:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-2:-1] == ["run"]:
                room = node.module.rpartition(".")[2]  # type: ignore[union-attr]
                touched = [room] if room in RUN_ONLY_ROOMS else []
                touched += [a.name for a in node.names if a.name in private]
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in touched]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("run"):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}" for a in node.names if a.name in private]
            elif isinstance(node, ast.Attribute) and node.attr in private and not _own(node.value):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert bad == [], "\n".join(bad)


#: the place module and its URL parser: the only modules that tell a URL from a local path
#: (spec/objectstore.md §1); everything else asks the place (``place_for``, ``local_only``).
URL_TESTERS = {"format/_urls.py", "format/_place.py"}


def _scheme_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and "://" in node.value


def _url_tests(path: Path) -> list[int]:
    """Lines of ``path`` that name ``is_url`` (an import of it, or a call) or test a string for a
    scheme themselves (``p.startswith("s3://")``, ``"://" in p``)."""
    tree = ast.parse(path.read_text())
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if (isinstance(node, ast.Name) and node.id == "is_url")
        or (isinstance(node, ast.ImportFrom) and any(a.name == "is_url" for a in node.names))
        or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and any(_scheme_text(a) for a in node.args)
        )
        or (isinstance(node, ast.Compare) and _scheme_text(node.left) and isinstance(node.ops[0], ast.In))
    )


def test_only_the_place_tests_for_a_url(tmp_path: Path) -> None:
    """A caller that tested for a URL itself would decide local-or-object-storage apart from the place
    (issue 38): a new store or scheme would then have to be taught to it too."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from ..format._urls import is_url\n\ndef f(p):\n    return is_url(p)\n\n"
        "def g(p):\n    return p.lower().startswith('s3://') or '://' in p\n"
    )
    assert _url_tests(probe) == [1, 4, 7, 7]  # the rule can fail
    bad = [
        f"{path.relative_to(ROOT)}:{line}: is_url (ask ckptkit.format._place: place_for, local_only)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() not in URL_TESTERS
        for line in _url_tests(path)
    ]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from ..guard.spikeguard import SpikeGuard\n", "climbs"),
        ("def f():\n    from ..cli import main\n", "climbs"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..guard import SpikeGuard\n", "none"),
    ],
)
def test_the_floor_rule_sees_a_climb_at_module_level_and_inside_a_function(
    tmp_path: Path, source: str, found: str
) -> None:
    """The rule can fail: an import from run/ into guard/ or cli/ is a climb, a TYPE_CHECKING one is not."""
    path = tmp_path / "ckptkit" / "run" / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    known = {"ckptkit.guard._spikeguard", "ckptkit.guard", "ckptkit.cli"}
    edges = list(imports("ckptkit.run.probe", path, known))
    climbs = [t for t, _line in edges if floor(t) > floor("ckptkit.run.probe")]
    assert bool(climbs) == (found == "climbs"), edges


def test_the_cycle_finder_finds_a_cycle() -> None:
    g = {"a": [("b", 1)], "b": [("c", 1)], "c": [("a", 1)], "d": [("a", 1)]}
    assert cycles(g) == [["a", "b", "c"]]


def test_ls_ckptkit_shows_the_floors() -> None:
    """The top level holds the floors, the tools, the face, errors and testing: no aliases."""
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["audit", "cli", "distributed", "format", "guard", "integrations", "run", "trainer"]
    files = {p.stem for p in PACKAGE.glob("*.py")}
    assert files == {"__init__", "__main__", "errors", "testing"}
