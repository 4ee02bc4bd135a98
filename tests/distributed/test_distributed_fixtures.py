"""The distributed golden directories in ``fixtures/distributed/`` (spec/distributed.md).

The generator reproduces every byte (the writer-determinism test for the distributed
backend); the valid 2-rank checkpoint loads at world size 1 to its literal values; each
damaged variant is refused by ``load`` and ``verify`` with exactly the manifest's error.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import load_script
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptkit import errors
from ckptkit.cli import main
from ckptkit.distributed import load, verify_directory

ROOT = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURES = ROOT / "distributed"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "MANIFEST.json").read_text())


GENERATE = load_script("generate_distributed", ROOT / "generate_distributed.py")  # a script, not a module


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_generator_reproduces_every_byte(tmp_path):
    assert GENERATE.main([str(tmp_path / "again")]) == 0
    committed, again = _files(FIXTURES), _files(tmp_path / "again")
    assert sorted(committed) == sorted(again)
    for name, data in committed.items():
        assert again[name] == data, f"{name} differs from a fresh generation (regenerate, never hand-edit)"


def _fresh_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64)},
        "step": 0,
        "betas": None,
        "name": "",
    }


def test_the_two_rank_directory_loads_at_world_size_1_to_its_literal_values(capsys):
    path = str(FIXTURES / "two-ranks")
    state = _fresh_state()
    load(state, path)
    assert torch.equal(state["model"]["w"], GENERATE.W) and torch.equal(state["model"]["b"], GENERATE.B)
    assert (state["step"], state["betas"], state["name"]) == (7, (0.5, 0.25), "golden")
    report = verify_directory(path)
    assert report.ok and report.world_size == 2 and report.chunks == 3
    assert main(["verify", path]) == 0
    assert capsys.readouterr().out.startswith(f"OK    {path}  distributed world size 2  2 tensors in 3 chunks, ")


def test_the_zstd_directory_stores_compressed_chunks_and_loads_to_the_same_values():
    path = str(FIXTURES / "two-ranks-zstd")
    state = _fresh_state()
    load(state, path)
    assert torch.equal(state["model"]["w"], GENERATE.W) and torch.equal(state["model"]["b"], GENERATE.B)
    assert (state["step"], state["betas"], state["name"]) == (7, (0.5, 0.25), "golden")
    chunks = [c for t in MANIFEST["valid"]["two-ranks-zstd"]["tensors"].values() for c in t["chunks"]]
    assert len(chunks) == 3 and all(c[3:] == ["stream.zstd/1"] for c in chunks)
    assert verify_directory(path).ok


@pytest.mark.parametrize("name", sorted(MANIFEST["invalid"]))
def test_each_damaged_directory_is_refused_with_the_manifest_error(name, capsys):
    entry, path = MANIFEST["invalid"][name], FIXTURES / name
    assert entry["load"] == entry["verify"]  # one check, shared: the same error from both
    for call, want in (
        (lambda: load(_fresh_state(), path), entry["load"]),
        (lambda: _raise(verify_directory(path).error), entry["verify"]),
    ):
        with pytest.raises(getattr(errors, want["error"])) as e:
            call()
        assert str(e.value) == want["message"].replace("DIR", str(path))
    assert main(["verify", str(path)]) == 1
    assert entry["verify"]["message"].replace("DIR", str(path)) in capsys.readouterr().out


def _raise(error: BaseException | None) -> None:
    assert error is not None
    raise error


def test_the_reference_reader_in_the_spec_reads_the_golden_directory():
    text = (Path(__file__).resolve().parents[2] / "spec" / "distributed.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text[text.index("## 8. Reference reader") :], re.S)
    assert len(blocks) == 1 and len(blocks[0].splitlines()) <= 20
    namespace: dict[str, Any] = {}
    exec(compile(blocks[0], "spec/distributed.md#8", "exec"), namespace)
    path = str(FIXTURES / "two-ranks")
    assert (namespace["read_tensor"](path, "model.w") == GENERATE.W.numpy()).all()
    assert (namespace["read_tensor"](path, "model.b") == GENERATE.B.numpy()).all()


def test_every_rule_of_the_spec_has_a_fixture_or_a_named_test():
    text = (Path(__file__).resolve().parents[2] / "spec" / "distributed.md").read_text()
    rules = sorted(set(re.findall(r"^\| (R-DC\d\d) \|", text, re.M)))
    assert rules == [f"R-DC{i:02d}" for i in (*range(1, 14), *range(20, 26))]
    fixtures = {name.split("-")[0] + "-" + name.split("-")[1] for name in MANIFEST["invalid"]}
    # tests/distributed/test_distributed.py: dtype/missing keys, committed directory;
    # tests/distributed/test_dcp_dropin.py: transforms; tests/format/test_typed_values.py: int keys;
    # tests/trainer/test_trainer_distributed.py: canonical order (a writer rule)
    tested = {"R-DC08", "R-DC09", "R-DC11", "R-DC12", "R-DC13"}
    # object storage (R-DC22..R-DC25): tests/distributed/test_distributed_objectstore.py names each
    on_objects = (Path(__file__).resolve().parents[1] / "distributed" / "test_distributed_objectstore.py").read_text()
    tested |= {r for r in ("R-DC22", "R-DC23", "R-DC24", "R-DC25") if r in on_objects}
    assert set(rules) <= fixtures | tested


def test_verify_and_inspect_json_on_the_golden_directory(capsys):
    path = str(FIXTURES / "two-ranks")
    assert main(["verify", path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    size = sum(p.stat().st_size for p in (FIXTURES / "two-ranks").iterdir())
    assert doc["ok"] is True and doc["files"] == [
        {
            "path": path,
            "kind": "distributed",
            "ok": True,
            "error": None,
            "world_size": 2,
            "tensors": 2,
            "chunks": 3,
            "values": 3,
            "size": size,
        }
    ]
    assert main(["inspect", path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 2 and doc["dcp_version"] == "1.0.0" and doc["values"] == ["betas", "name", "step"]
    assert [r["chunks"] for r in doc["ranks"]] == [1, 2]
    assert doc["tensors"]["model.w"]["chunks"][1] == {
        "offsets": [2, 0],
        "sizes": [2, 3],
        "rank": 1,
        "offset": 256,  # R-DC13: rank 1's file holds model.b first, its model.w shard after
        "nbytes": 24,
    }


def test_inspect_refuses_a_torn_directory_and_names_what_is_missing(capsys):
    assert main(["inspect", str(FIXTURES / "R-DC03-no-metadata")]) == 2
    assert "metadata.ckdcp is missing" in capsys.readouterr().err


def test_verifying_a_distributed_directory_never_imports_torch():
    import subprocess

    code = (
        "import sys; from ckptkit.cli import main; import ckptkit.distributed as d; d.verify_directory; "
        f"rc = main(['verify', {str(FIXTURES / 'two-ranks')!r}]); "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True)


_FILES = sorted(p.name for p in (FIXTURES / "two-ranks").iterdir())


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(_FILES), where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_is_caught_by_verify_and_never_loads_wrong_values(tmp_path, name, where, bit):
    import shutil

    d = tmp_path / f"flip-{name}-{where}-{bit}"
    shutil.copytree(FIXTURES / "two-ranks", d)
    p = d / name
    data = bytearray(p.read_bytes())
    data[int(where * len(data))] ^= 1 << bit
    p.write_bytes(bytes(data))
    report = verify_directory(d)
    assert not report.ok and isinstance(report.error, errors.CheckpointError)
    # load checks what verify checks before it reads a chunk (R-DC06), then each chunk it reads:
    # a flip anywhere, a data file's header, index or padding too, is the same refusal
    with pytest.raises(type(report.error)) as e:
        load(_fresh_state(), d)
    assert str(e.value) == str(report.error)


def test_the_short_forms_leave_the_garbage_collector_as_they_found_it():
    import gc

    load(_fresh_state(), FIXTURES / "two-ranks")
    assert gc.isenabled()
    with pytest.raises(errors.ChecksumMismatch):
        load(_fresh_state(), FIXTURES / "R-DC07-flipped-chunk-byte")
    assert gc.isenabled()
    gc.disable()
    try:
        load(_fresh_state(), FIXTURES / "two-ranks")
        assert not gc.isenabled()
    finally:
        gc.enable()
