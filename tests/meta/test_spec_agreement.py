"""Where a reader written from spec/ alone and ckptkit used to part ways (issue 12 §2).

Each test names the rule the spec now states (spec/validation.md) and asserts the exact
message every reader prints: ``load``, ``verify``, the lazy reader and ``ckptkit
inspect`` agree. The fixtures are in ``fixtures/invalid/`` (built by fixtures/generate.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import fixture_generator

from ckptkit import BadTensorValue, MalformedIndex, open_checkpoint
from ckptkit.cli import main
from ckptkit.format import verify
from ckptkit.format._checkpoint import Checkpoint, load, save
from ckptkit.format._container import Source, read_layout

GENERATE = fixture_generator()

ROOT = Path(__file__).resolve().parents[2]
INVALID = ROOT / "fixtures" / "invalid"
_DAMAGED = "the file is damaged or was not written by ckptkit; resume from an earlier checkpoint"


def _refused(name: str, cls: type[Exception] = MalformedIndex) -> str:
    """The message ``load`` and ``verify`` both give for a fixture, without the leading path."""
    path = INVALID / name
    with pytest.raises(cls) as info:
        load(path)
    report = verify(path)
    assert not report.ok and type(report.error) is cls
    assert str(report.error) == str(info.value)
    text = str(info.value)
    assert text.startswith(f"{path}: ")
    return text[len(f"{path}: ") :]


# ---------------------------------------------------------------------------- 1. R-013: int64 shapes


def test_a_dimension_of_2_pow_63_is_refused_by_r013() -> None:
    assert _refused("R-013-dim-2-63.ckpt") == (
        "offset 64 (0x40): model index: tensor 0: shape does not fit in int64 element counts "
        f"(got [9223372036854775808]); {_DAMAGED} (R-013)"
    )


def test_an_element_count_of_2_pow_63_is_refused_by_r013_though_each_dimension_fits() -> None:
    assert _refused("R-013-element-count-overflows-int64.ckpt") == (
        "offset 64 (0x40): model index: tensor 0: shape does not fit in int64 element counts "
        f"(got [4294967296, 2147483648]); {_DAMAGED} (R-013)"
    )


def test_a_dimension_of_2_pow_63_minus_1_passes_r013_and_meets_the_nbytes_rule(tmp_path: Path) -> None:
    src = (ROOT / "fixtures" / "valid" / "v2-all-sections.ckpt").read_bytes()
    path = tmp_path / "edge.ckpt"
    path.write_bytes(GENERATE.repack(src, "model", lambda i: i["tensors"][0].__setitem__(1, [2**63 - 1])))
    with pytest.raises(MalformedIndex, match=r"nbytes disagrees with shape x itemsize .*\(R-014\)$"):
        load(path)


def test_the_spec_writes_the_int64_bounds_of_r013() -> None:
    row = _rule_row("R-013")
    assert "each `< 2^63`" in row and "product" in row


# ---------------------------------------------------------------------------- 2., 3. R-008: one frame, limits


def test_a_skippable_zstd_frame_before_the_frame_is_refused() -> None:
    assert _refused("R-008-zstd-skippable-frame-before.ckpt") == (
        "offset 320 (0x140): model data: zstd data region starts with a skippable frame, not a zstd frame "
        f"(exactly one frame is allowed); {_DAMAGED} (R-008)"
    )


def test_a_skippable_zstd_frame_after_the_frame_is_refused() -> None:
    assert _refused("R-008-zstd-skippable-frame-after.ckpt") == (
        "offset 320 (0x140): model data: 12 bytes after the zstd frame (exactly one frame, nothing after it) "
        f"(expected frame end at 415, got 403); {_DAMAGED} (R-008)"
    )


def test_a_zstd_window_over_128_mib_is_refused_before_decoding() -> None:
    assert _refused("R-008-zstd-window-over-128MiB.ckpt") == (
        "offset 320 (0x140): model data: zstd frame needs a larger window than a reader must support "
        f"(expected <= 134217728 bytes, got 268435456); {_DAMAGED} (R-008)"
    )


def test_a_raw_len_over_the_zstd_ratio_cap_is_refused_by_r008() -> None:
    assert _refused("R-008-zstd-raw-len-over-ratio-cap.ckpt") == (
        "offset 64 (0x40): model index: raw_len exceeds what any zstd frame of data_len bytes can decode to "
        f"(expected <= 3768320, got 3768321); {_DAMAGED} (R-008)"
    )


def test_the_spec_states_the_zstd_limits_in_r008_not_only_in_the_guarantees() -> None:
    row = _rule_row("R-008")
    assert "skippable" in row and "128 MiB" in row and "32768" in row
    container_md = (ROOT / "spec" / "container.md").read_text()
    assert "a reader\naccepts any valid frame." not in container_md


# ---------------------------------------------------------------------------- 4., 5., 7. map keys


def test_an_index_with_codec_twice_is_refused_by_r010() -> None:
    assert _refused("R-010-index-key-twice.ckpt") == (
        f"offset 64 (0x40): model index: the index map key 'codec' appears twice; {_DAMAGED} (R-010)"
    )


def test_a_tree_map_with_a_key_twice_is_refused_by_r016() -> None:
    assert _refused("R-016-map-key-twice.ckpt") == (
        f"offset 64 (0x40): model index: map key '0.bias' appears twice; {_DAMAGED} (R-016)"
    )


def test_an_array_map_key_is_r016_not_an_unhashable_type() -> None:
    assert _refused("R-016-array-map-key.ckpt") == (
        f"offset 64 (0x40): model index: map key [1, 2] is not a string or integer; {_DAMAGED} (R-016)"
    )


# ---------------------------------------------------------------------------- 6. nil tree of a present section


def test_a_present_section_with_a_nil_tree_is_refused_by_load_verify_and_inspect(
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = "R-016-present-section-nil-tree.ckpt"
    message = (
        f"offset 64 (0x40): model index: the tree of a present section is nil "
        f"(a section without state is absent: length 0); {_DAMAGED} (R-016)"
    )
    assert _refused(name) == message
    path = INVALID / name
    assert main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"ckptkit inspect: {path}: {message}\n")


def test_the_writer_never_writes_a_nil_tree_so_absent_has_one_encoding(tmp_path: Path) -> None:
    a, b = tmp_path / "none.ckpt", tmp_path / "empty.ckpt"
    save(a, Checkpoint(step=0, model=None))
    save(b, Checkpoint(step=0, model={}))
    assert load(a).absent == ("model", "optim", "teacher", "monitor")
    assert load(b).model == {}
    assert a.read_bytes() == (ROOT / "fixtures" / "valid" / "v2-header-only.ckpt").read_bytes()
    assert [s.present for s in verify(a).sections] == [False] * 4
    assert [s.present for s in verify(b).sections] == [True, False, False, False]


# ---------------------------------------------------------------------------- 8. R-017: bool bytes


def test_a_bool_byte_other_than_0_or_1_is_refused_by_r017() -> None:
    assert _refused("R-017-bool-byte-7.ckpt", BadTensorValue) == (
        "offset 1345 (0x541): model data: tensor 1 (bool[2, 3]): element 1 is byte 0x07; a bool is stored as "
        "0 or 1; the file was not written by a correct ckptkit writer; do not load it (R-017)"
    )


def test_the_lazy_reader_refuses_the_bad_bool_tensor_and_serves_the_others() -> None:
    with open_checkpoint(INVALID / "R-017-bool-byte-7.ckpt") as ck:
        with pytest.raises(BadTensorValue, match=r"element 1 is byte 0x07.*\(R-017\)$"):
            ck.tensor("model", "dtypes", "bool")
        assert ck.tensor("model", "dtypes", "int8").tolist() == [[-2, -1, 0], [1, 2, 3]]


def test_a_bad_bool_byte_in_a_zstd_section_is_refused_with_the_region_offset(tmp_path: Path) -> None:
    path = tmp_path / "z.ckpt"
    save(path, Checkpoint(step=1, model={"b": torch.tensor([True, False, True])}), compression="zstd")
    src = path.read_bytes()

    def bad_bools(index: dict) -> None:
        index["tensors"][0][4] = GENERATE._U64.pack(GENERATE.xxhash.xxh3_64_intdigest(b"\x01\xff\x01"))

    region = GENERATE.zstandard.ZstdCompressor().compress(b"\x01\xff\x01")
    path.write_bytes(GENERATE.repack(src, "model", bad_bools, lambda r: region))
    with pytest.raises(BadTensorValue) as info:
        load(path)
    assert re.search(
        r"model data: tensor 0 \(bool\[3\]\): element 1 is byte 0xff; a bool is stored as 0 or 1;", str(info.value)
    )


# ---------------------------------------------------------------------------- 9. R-014 wording


def test_empty_tensors_share_an_offset_and_the_spec_says_r014_allows_it() -> None:
    path = ROOT / "fixtures" / "valid" / "v2-dtypes.ckpt"
    assert verify(path).ok and load(path).model["edge"]["empty_bool"].shape == (0,)
    with Source(path) as src:
        model = read_layout(src).sections["model"]
    assert model is not None
    recs = model.tensors
    empty = {r.offset for r in recs if r.nbytes == 0}
    assert len([r for r in recs if r.offset in empty]) >= 3  # two empty records and the one after them
    row = _rule_row("R-014")
    assert "ascending, disjoint" not in row and "empty tensors may share an offset" in row


def _rule_row(rule: str) -> str:
    for line in (ROOT / "spec" / "validation.md").read_text().splitlines():
        if line.startswith(f"| {rule} |"):
            return line
    raise AssertionError(f"{rule} has no row in spec/validation.md")


SPEC = ROOT / "spec"
_RULE_ID = re.compile(r"(?<![\w-])((?:R|RS|G)-[A-Z]*)\d+")


def test_the_spec_index_lists_every_spec_file() -> None:
    index = (SPEC / "README.md").read_text()
    listed = set(re.findall(r"^\| \[([\w.-]+\.md)\]\(\1\) \|", index, flags=re.M))
    files = {p.name for p in SPEC.glob("*.md")} - {"README.md"}
    assert files - listed == set(), "spec/README.md's index leaves out these files"
    assert listed - files == set(), "spec/README.md's index lists files spec/ does not have"


def test_the_spec_index_names_every_rule_prefix_the_files_use() -> None:
    index = (SPEC / "README.md").read_text()
    named = set(re.findall(r"^\| `((?:R|RS|G)-[A-Z]*)`", index, flags=re.M))
    used = {m for p in SPEC.glob("*.md") for m in _RULE_ID.findall(p.read_text())}
    assert used - named == set(), "rule prefixes spec/ uses but spec/README.md does not name"
    assert named - used == set(), "rule prefixes spec/README.md names but no spec file uses"
