"""One verdict per file: whatever a loader refuses, ``verify`` refuses, and the other way round.

Every container fixture (``fixtures/valid``, ``fixtures/invalid``, ``fixtures/hostile``) goes
through ``ckptkit.load``, ``ckptkit.verify``, ``ckptkit verify`` and ``ckptkit inspect`` (in
process); every distributed directory (``fixtures/distributed``) through
``ckptkit.distributed.load``, ``dcp.load`` with the ``Reader``, ``verify_directory``,
``ckptkit verify`` and ``ckptkit inspect``. They accept it together, or refuse it together with
a ckptkit error: the same error from ``load`` and ``verify``, exit 1 from the CLI (never 2,
``internal error``). ``inspect`` reads no tensor bytes (spec/cli.md): it accepts what only a
check of tensor or chunk bytes refuses, and nothing else verify refuses.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from helpers import ROOT, load_script
from torch.distributed.checkpoint.api import CheckpointException

import ckptkit
import ckptkit.distributed as ckd
from ckptkit.cli import main
from ckptkit.errors import CheckpointError, IncompleteCheckpoint

FIXTURES = ROOT / "fixtures"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "MANIFEST.json").read_text())
CONTAINERS = sorted(
    [f"valid/{n}" for n, e in MANIFEST["valid"].items() if e["kind"] == "checkpoint"]
    + [f"invalid/{n}" for n, e in MANIFEST["invalid"].items() if e["reader"] == "load"]
    + [
        f"hostile/{c['file']}"
        for c in json.loads((FIXTURES / "hostile" / "MANIFEST.json").read_text())["cases"]
        if c["kind"] == "container"
    ]
)
DIRECTORIES = sorted(p.name for p in (FIXTURES / "distributed").iterdir() if p.is_dir())
#: Rules only a read of tensor (or chunk) bytes checks: the refusals ``inspect`` does not make.
TENSOR_BYTE_RULES = {"R-005", "R-007", "R-008", "R-017", "R-DC07", "R-DC11"}

GENERATE = load_script("generate_distributed", FIXTURES / "generate_distributed.py")


def _verdict(call: Any) -> CheckpointError | None:
    """None when ``call`` succeeds; the ckptkit error it raises otherwise (anything else fails the test)."""
    try:
        call()
    except CheckpointError as e:
        return e
    return None


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "internal error" not in out.err and "Traceback" not in out.err, out.err
    return rc, out.out + out.err


def _rule(error: CheckpointError) -> str:
    found = re.findall(r"\((R-[A-Z]*\d+)\)", str(error))
    return found[-1] if found else ""


def _agree(path: Path, loaded: CheckpointError | None, verified: CheckpointError | None, capsys: Any) -> None:
    """``load`` and ``verify`` gave ``loaded`` and ``verified``; the CLI must say the same."""
    assert type(loaded) is type(verified) and str(loaded) == str(verified), (loaded, verified)
    rc, text = _cli(capsys, "verify", str(path))
    assert rc == (0 if verified is None else 1)
    if verified is not None:
        assert str(verified).removeprefix(f"{path}: ") in text
    rc, text = _cli(capsys, "inspect", str(path))
    if verified is None:
        assert rc == 0
    elif rc == 0:
        assert _rule(verified) in TENSOR_BYTE_RULES, f"inspect accepts what verify refuses: {verified}"
    else:  # 1, or 2 for a checkpoint that is not all there (spec/cli.md: an unreadable path)
        assert rc == (2 if isinstance(verified, IncompleteCheckpoint) else 1), text
        assert str(verified) in text


@pytest.mark.parametrize("name", CONTAINERS)
def test_every_container_fixture_gets_one_verdict_from_every_reader(name: str, capsys) -> None:
    path = FIXTURES / name
    loaded = _verdict(lambda: ckptkit.load(path))
    verified = ckptkit.verify(path).error
    _agree(path, loaded, verified, capsys)


def _destination(name: str) -> dict[str, Any]:
    """A state of the keys the directory holds (the generator's own)."""
    state: dict[str, Any] = GENERATE.typed_state() if name == "typed-values" else GENERATE.rank_state()
    return state


def _dcp_load(path: Path, name: str) -> None:
    reader = ckd.Reader(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(_destination(name), storage_reader=reader, planner=ckd.LoadPlanner())
    except CheckpointException:
        assert reader.failure is not None
        raise reader.failure from None


@pytest.mark.parametrize("name", DIRECTORIES)
def test_every_distributed_fixture_gets_one_verdict_from_every_reader(name: str, capsys) -> None:
    path = FIXTURES / "distributed" / name
    loaded = _verdict(lambda: ckd.load(_destination(name), path))
    raw = _verdict(lambda: _dcp_load(path, name))
    assert type(raw) is type(loaded) and str(raw) == str(loaded), (raw, loaded)
    verified = ckd.verify_directory(path).error
    _agree(path, loaded, verified, capsys)
