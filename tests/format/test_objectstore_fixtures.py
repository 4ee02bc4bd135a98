"""The golden commit records (fixtures/objectstore/, spec/objectstore.md R-O12/R-O13, R-O46..R-O48)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import boto3
import pytest
from helpers import load_script

import ckptkit
from ckptkit.errors import FormatError
from ckptkit.format._commit import decode_record, encode_record
from ckptkit.format._urls import parse

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "objectstore"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
GENERATE = load_script("generate_objectstore", ROOT / "fixtures" / "generate_objectstore.py")
SPEC = (ROOT / "spec" / "objectstore.md").read_text()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_generator_reproduces_every_byte(tmp_path: Path) -> None:
    assert GENERATE.main([str(tmp_path / "again")]) == 0
    committed, again = _files(FIXTURES), _files(tmp_path / "again")
    assert sorted(committed) == sorted(again)
    for name, data in committed.items():
        assert again[name] == data, f"{name} differs from a fresh generation (regenerate, never hand-edit)"


def test_the_valid_record_decodes_to_the_manifest_and_re_encodes_to_its_bytes() -> None:
    data = (FIXTURES / "valid" / "model.ckpt.commit.json").read_bytes()
    entries = decode_record(data, "URL", "model.ckpt")
    listed = {e.key: {"size": e.size, "xxh3": f"{e.xxh3:016x}"} for e in entries}
    assert listed == MANIFEST["valid"]["objects"]
    assert encode_record("model.ckpt", reversed(entries)) == data  # objects sorted by key, whatever the order given
    assert data.decode("ascii") in SPEC  # the spec's example is the fixture


@pytest.mark.parametrize("name", sorted(MANIFEST["invalid"]))
def test_each_broken_record_is_refused_with_the_manifest_error(name: str) -> None:
    want = MANIFEST["invalid"][name]
    with pytest.raises(FormatError) as e:
        decode_record((FIXTURES / "invalid" / name).read_bytes(), "URL", "model.ckpt")
    assert (type(e.value).__name__, str(e.value)) == (want["error"], want["message"])
    assert name.split("-")[0] + "-" + name.split("-")[1] in str(e.value)  # the rule it is named after


def test_the_valid_objects_uploaded_under_any_prefix_load_and_the_container_is_the_local_save(
    s3: str, tmp_path
) -> None:
    client = boto3.client("s3")
    for p in (FIXTURES / "valid").iterdir():
        client.put_object(Bucket=parse(s3).bucket, Key=f"some/where/{p.name}", Body=p.read_bytes())
    ckpt = ckptkit.load(f"{s3}/some/where/model.ckpt")
    assert ckpt.step == 10
    ckptkit.save(tmp_path / "model.ckpt", ckpt)  # R-O18: the object is a local checkpoint's bytes
    assert (tmp_path / "model.ckpt").read_bytes() == (FIXTURES / "valid" / "model.ckpt").read_bytes()


def test_every_rule_of_the_spec_has_a_fixture_or_a_test_that_names_it() -> None:
    rules = sorted(set(re.findall(r"^\| (R-O\d\d) \|", SPEC, re.M)))
    assert rules == [f"R-O{n:02d}" for n in (1, 2, 3, *range(10, 26), *range(30, 39), *range(40, 53))]
    names = (
        "format/test_objectstore.py",
        "format/test_objectstore_faults.py",
        "run/test_objectstore_run.py",
        "cli/test_objectstore_copies.py",
        "integrations/test_lightning.py",
        "distributed/test_distributed_objectstore.py",
        "run/test_multinode.py",
        "run/test_store_trust.py",
        "run/test_store_throttling.py",
        "run/test_objectstore_streaming.py",
        "format/test_objectstore_streamed_save.py",
    )
    tests = "".join((ROOT / "tests" / n).read_text() for n in names)
    fixtures = " ".join(MANIFEST["invalid"])
    for rule in rules:
        assert rule in tests or rule in fixtures, f"{rule}: no fixture or test names it"
