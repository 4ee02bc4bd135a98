"""The golden files in ``fixtures/`` against ckptkit (spec/validation.md, spec/container.md).

Every valid file loads, verifies and matches ``fixtures/MANIFEST.json``; every invalid
file is refused with exactly the manifest's error class and message by ``load``,
``verify`` and ``ckptkit verify``; the generator reproduces every file byte for byte
(the writer-determinism test), and re-saving a loaded file gives the same bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from helpers import fixture_generator

from ckptkit import errors
from ckptkit.cli import main
from ckptkit.format import verify
from ckptkit.format._checkpoint import Checkpoint, load, save
from ckptkit.format._container import LEGACY_MISSING, Source, read_layout
from ckptkit.format._sidecar import read_sidecar, verify_sidecar, write_sidecar
from ckptkit.format._verify import section_infos

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "MANIFEST.json").read_text())
VALID: dict[str, Any] = MANIFEST["valid"]
INVALID: dict[str, Any] = MANIFEST["invalid"]

VALID_CKPT = sorted(n for n, e in VALID.items() if e["kind"] == "checkpoint")
VALID_V2 = sorted(n for n in VALID_CKPT if VALID[n]["version"] == 2)
VALID_SIDECAR = sorted(n for n, e in VALID.items() if e["kind"] == "sidecar")
INVALID_CKPT = sorted(n for n, e in INVALID.items() if e["reader"] == "load")
INVALID_SIDECAR = sorted(n for n, e in INVALID.items() if e["reader"] != "load")


# The generator defines the manifest's facts (``tensor_table``) and rebuilds every file.
GENERATE = fixture_generator()

_ZSTD_NOW = ".".join(map(str, zstandard.ZSTD_VERSION))
_ZSTD_THEN = MANIFEST["environment"]["zstd_version"]


def _skip_if_zstd_differs(entry: dict[str, Any]) -> None:
    if entry["zstd_dependent"] and _ZSTD_NOW != _ZSTD_THEN:
        pytest.skip(
            f"libzstd {_ZSTD_NOW} is installed but the fixture was compressed with libzstd {_ZSTD_THEN}; "
            "compressed bytes may legitimately differ between libzstd versions"
        )


# ---------------------------------------------------------------------------- valid files


@pytest.mark.parametrize("name", VALID_CKPT)
def test_valid_checkpoint_loads_with_the_manifest_content(name: str) -> None:
    entry = VALID[name]
    ckpt = load(FIXTURES / "valid" / name)
    assert (ckpt.version, ckpt.step, ckpt.flags, ckpt.legacy) == (
        entry["version"],
        entry["step"],
        entry["flags"],
        entry["legacy"],
    )
    assert list(ckpt.missing) == entry["missing"]
    assert list(ckpt.absent) == entry["absent"]
    for section in ("model", "optim", "teacher", "monitor"):
        tree = getattr(ckpt, section)
        if section in entry["sections"]:
            assert GENERATE.tensor_table(section, tree) == entry["sections"][section]["tensors"], section
        else:
            assert tree is None, section


@pytest.mark.parametrize("name", VALID_CKPT)
def test_valid_checkpoint_verifies_ok_with_the_manifest_layout(name: str) -> None:
    entry = VALID[name]
    report = verify(FIXTURES / "valid" / name)
    assert report.ok and report.error is None
    assert (report.version, report.step, report.legacy) == (entry["version"], entry["step"], entry["legacy"])
    assert list(report.flags) == entry["flag_names"]
    assert report.size == entry["size"]
    present = {s.name: s for s in report.sections if s.present}
    assert sorted(present) == sorted(entry["sections"])
    for sec_name, s in present.items():
        want = entry["sections"][sec_name]
        assert (s.offset, s.length, s.codec, s.tensors, s.raw_len) == (
            want["offset"],
            want["length"],
            want["codec"],
            want["stored_tensors"],
            want["raw_len"],
        )


def test_v1_fixture_loads_as_legacy_lacking_teacher_flags_monitor_and_integrity() -> None:
    ckpt = load(FIXTURES / "valid" / "v1-legacy.ckpt")
    assert ckpt.legacy and ckpt.version == 1
    assert ckpt.missing == ("teacher", "flags", "monitor", "integrity") == LEGACY_MISSING
    assert ckpt.teacher is None and ckpt.monitor is None and ckpt.flags == 0
    assert ckpt.model is not None and ckpt.optim is not None


def test_v2_dtypes_fixture_keeps_shared_tensors_shared_and_tuples_tuples() -> None:
    model = load(FIXTURES / "valid" / "v2-dtypes.ckpt").model
    assert model["shared_a"] is model["shared_b"] is model["shared_view"]
    assert isinstance(model["tuple"], tuple) and model["tuple"][:2] == (1, "two") and model["tuple"][3] is None
    assert model["edge"]["ndim_64"].dim() == 64


@pytest.mark.parametrize("name", VALID_SIDECAR)
def test_valid_sidecar_reads_with_its_stamp_and_the_manifest_content(name: str) -> None:
    entry = VALID[name]
    path = FIXTURES / "valid" / name
    sc = read_sidecar(path, expect_step=entry["train_step"])
    assert (sc.train_step, sc.table_step) == (entry["train_step"], entry["table_step"])
    assert GENERATE.tensor_table("table", sc.tree) == entry["tensors"]
    assert verify_sidecar(path, expect_step=entry["train_step"]) == entry["train_step"]


# ---------------------------------------------------------------------------- same inputs, same bytes


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fixtures")
    assert GENERATE.main([str(out)]) == 0
    return out


ALL_FILES = [("valid", n) for n in sorted(VALID)] + [("invalid", n) for n in sorted(INVALID)]


@pytest.mark.parametrize(("kind", "name"), ALL_FILES, ids=[n for _, n in ALL_FILES])
def test_generator_reproduces_the_fixture_byte_for_byte(regenerated: Path, kind: str, name: str) -> None:
    entry = MANIFEST[kind][name]
    _skip_if_zstd_differs(entry)
    committed = (FIXTURES / kind / name).read_bytes()
    again = (regenerated / kind / name).read_bytes()
    hint = ""
    if name.endswith(".pt"):
        hint = (
            f" (torch.save output; the fixture was made with torch {MANIFEST['environment']['torch']}, "
            f"this is torch {torch.__version__})"
        )
    assert again == committed, f"{kind}/{name} differs from what fixtures/generate.py writes now{hint}"


def test_generator_reproduces_the_manifest(regenerated: Path) -> None:
    again = json.loads((regenerated / "MANIFEST.json").read_text())
    for kind in ("valid", "invalid"):
        assert sorted(again[kind]) == sorted(MANIFEST[kind])
        for name, entry in MANIFEST[kind].items():
            if entry["zstd_dependent"] and _ZSTD_NOW != _ZSTD_THEN:
                continue
            assert again[kind][name] == entry, f"{kind}/{name}"
    for key in ("conventions", "format", "generator"):
        assert again[key] == MANIFEST[key]


def test_manifest_file_is_sorted_stable_json() -> None:
    text = (FIXTURES / "MANIFEST.json").read_text()
    assert text == json.dumps(MANIFEST, sort_keys=True, indent=2) + "\n"


def test_fixture_directories_hold_exactly_the_manifest_files() -> None:
    assert sorted(p.name for p in (FIXTURES / "valid").iterdir()) == sorted(VALID)
    assert sorted(p.name for p in (FIXTURES / "invalid").iterdir()) == sorted(INVALID)


@pytest.mark.parametrize("name", VALID_V2)
def test_saving_a_loaded_v2_fixture_gives_identical_bytes(tmp_path: Path, name: str) -> None:
    entry = VALID[name]
    _skip_if_zstd_differs(entry)
    ckpt = load(FIXTURES / "valid" / name)
    again = Checkpoint(
        step=ckpt.step, model=ckpt.model, optim=ckpt.optim, teacher=ckpt.teacher, monitor=ckpt.monitor, flags=ckpt.flags
    )
    save(tmp_path / name, again, compression=entry["compression"])
    assert (tmp_path / name).read_bytes() == (FIXTURES / "valid" / name).read_bytes()


@pytest.mark.parametrize("name", VALID_SIDECAR)
def test_rewriting_a_loaded_sidecar_gives_identical_bytes(tmp_path: Path, name: str) -> None:
    sc = read_sidecar(FIXTURES / "valid" / name)
    write_sidecar(tmp_path / name, train_step=sc.train_step, table_step=sc.table_step, tree=sc.tree)
    assert (tmp_path / name).read_bytes() == (FIXTURES / "valid" / name).read_bytes()


PATCHED = sorted(n for n, e in INVALID.items() if not (isinstance(e["patch"], dict) and "generated" in e["patch"]))


@pytest.mark.parametrize("name", PATCHED)
def test_manifest_patch_applied_to_its_source_gives_the_invalid_fixture(name: str) -> None:
    """Generated fixtures have no patch to replay; the generator test pins their bytes."""
    entry = INVALID[name]
    data = (FIXTURES / "invalid" / name).read_bytes()
    p = entry["patch"]
    src = (FIXTURES / "valid" / entry["source"]).read_bytes()
    if isinstance(p, dict) and "truncate_to" in p:
        assert data == src[: p["truncate_to"]]
    elif isinstance(p, dict):
        assert data == src + bytes.fromhex(p["append"])
    else:
        out = bytearray(src)
        for q in p:
            old, new = bytes.fromhex(q["old"]), bytes.fromhex(q["new"])
            assert out[q["offset"] : q["offset"] + len(old)] == old
            out[q["offset"] : q["offset"] + len(new)] = new
        assert bytes(out) == data


# ---------------------------------------------------------------------------- invalid files


def _expected(name: str, path: Path) -> tuple[type[errors.CheckpointError], str]:
    entry = INVALID[name]
    return getattr(errors, entry["error"]), f"{path}: {entry['message']}"


@pytest.mark.parametrize("name", INVALID_CKPT)
def test_load_refuses_the_invalid_fixture_with_the_manifest_error(name: str) -> None:
    path = FIXTURES / "invalid" / name
    cls, message = _expected(name, path)
    with pytest.raises(errors.CheckpointError) as info:
        load(path)
    assert type(info.value) is cls
    assert str(info.value) == message
    assert getattr(info.value, "offset", None) == INVALID[name]["offset"]


@pytest.mark.parametrize("name", INVALID_CKPT)
def test_verify_reports_the_invalid_fixture_with_the_manifest_error(name: str) -> None:
    path = FIXTURES / "invalid" / name
    cls, message = _expected(name, path)
    report = verify(path)
    assert report.ok is False
    assert type(report.error) is cls
    assert str(report.error) == message


@pytest.mark.parametrize("name", INVALID_SIDECAR)
def test_sidecar_readers_refuse_the_invalid_fixture_with_the_manifest_error(name: str) -> None:
    path = FIXTURES / "invalid" / name
    cls, message = _expected(name, path)
    expect_step = INVALID[name]["reader"]["read_sidecar"]["expect_step"]
    for reader in (read_sidecar, verify_sidecar):
        with pytest.raises(errors.CheckpointError) as info:
            reader(path, expect_step=expect_step)
        assert type(info.value) is cls, reader.__name__
        assert str(info.value) == message, reader.__name__


@pytest.mark.parametrize("name", INVALID_CKPT)
def test_cli_verify_prints_one_fail_line_and_exits_1_for_the_invalid_fixture(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = FIXTURES / "invalid" / name
    _, message = _expected(name, path)
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert out == f"FAIL  {message}\n"


@pytest.mark.parametrize("name", VALID_CKPT)
def test_cli_verify_prints_one_ok_line_and_exits_0_for_the_valid_fixture(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = FIXTURES / "valid" / name
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(
        f"OK    {path}  v{VALID[name]['version']} step {VALID[name]['step']}"
    )


def test_cli_verify_accepts_a_valid_sidecar(capsys: pytest.CaptureFixture[str]) -> None:
    path = FIXTURES / "valid" / "sidecar-step-7.ngram"
    assert main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"OK    {path}  sidecar v1 step 7  ")


# ---------------------------------------------------------------------------- spec <-> fixtures <-> code


def _spec_rules() -> dict[str, str]:
    """Rule id -> fixture cell of the rule table in spec/validation.md."""
    rows = {}
    for line in (ROOT / "spec" / "validation.md").read_text().splitlines():
        m = re.match(r"\|\s*(R-\d{3})\s*\|", line)
        if m:
            rows[m.group(1)] = line.rsplit("|", 2)[-2]
    return rows


def test_every_rule_in_the_validation_spec_has_an_invalid_fixture_named_after_it() -> None:
    rules = _spec_rules()
    assert rules, "no rule table found in spec/validation.md"
    covered = {e["rule"] for e in INVALID.values()}
    assert sorted(rules) == sorted(covered)
    for name, entry in INVALID.items():
        assert name.startswith(entry["rule"] + "-"), name
        assert f"`{name}`" in rules[entry["rule"]], f"spec/validation.md {entry['rule']} row does not list {name}"


def test_every_rule_id_the_code_names_is_in_the_validation_spec() -> None:
    named = set()
    for mod in ("_container.py", "_read.py", "_verify.py", "_section.py", "_sidecar.py"):
        named |= set(re.findall(r"R-\d{3}", (ROOT / "ckptkit" / "format" / mod).read_text()))
    assert named <= set(_spec_rules())


def test_every_invalid_message_names_its_rule_except_the_reported_gaps() -> None:
    for name, entry in INVALID.items():
        if entry["message_names_rule"]:
            assert entry["rule"] in entry["message"], name


def test_layout_only_reader_agrees_with_the_manifest_offsets() -> None:
    for name in VALID_CKPT:
        with Source(FIXTURES / "valid" / name) as src:
            infos = {s.name: s for s in section_infos(read_layout(src)) if s.present}
        assert {k: (v.offset, v.length) for k, v in infos.items()} == {
            k: (v["offset"], v["length"]) for k, v in VALID[name]["sections"].items()
        }, name
