"""Bounds on a commit record (spec/objectstore.md R-O13, R-O46..R-O48): every reader refuses a
hostile record with a FormatError naming it and the rule, before allocating what it declares."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
import xxhash

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import FormatError
from ckptkit.format._commit import Entry, decode_record, encode_record
from ckptkit.format._urls import parse

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # botocore's pooled sockets at exit

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "objectstore"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
HOSTILE = sorted(n for n in MANIFEST["invalid"] if n.split("-")[1] in ("O46", "O47", "O48") or "extra" in n)


def _upload(s3: str, record: bytes) -> str:
    """The valid fixture's objects under ``s3``/p, with ``record`` as their commit record."""
    client, bucket = boto3.client("s3"), parse(s3).bucket
    for p in (FIXTURES / "valid").iterdir():
        if not p.name.endswith(".commit.json"):
            client.put_object(Bucket=bucket, Key=f"p/{p.name}", Body=p.read_bytes())
    client.put_object(Bucket=bucket, Key="p/model.ckpt.commit.json", Body=record)
    return f"{s3}/p/model.ckpt"


def test_the_hostile_records_are_the_ones_the_spec_bounds() -> None:
    assert HOSTILE == [
        "R-O13-extra-key.commit.json",
        "R-O46-nested.commit.json",
        "R-O46-size-10-30.commit.json",
        "R-O46-size-4300-digits.commit.json",
        "R-O47-size-2-64.commit.json",
        "R-O48-empty-suffix.commit.json",
        "R-O48-nul-key.commit.json",
    ]


@pytest.mark.parametrize("name", HOSTILE)
def test_load_verify_and_the_cli_refuse_a_hostile_record_naming_it_and_its_rule(name: str, s3: str, capsys) -> None:
    url = _upload(s3, (FIXTURES / "invalid" / name).read_bytes())
    rule = "-".join(name.split("-")[:2])
    want = MANIFEST["invalid"][name]["message"].replace("URL", url + ".commit.json")
    with pytest.raises(FormatError) as e:
        ckptkit.load(url)
    assert str(e.value) == want and f"({rule})" in want
    assert not ckptkit.verify(url).ok
    capsys.readouterr()
    assert main(["verify", url]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"FAIL  {url}.commit.json: {want.split(': ', 1)[1]}"]
    assert "internal error" not in out + err


def test_a_declared_size_above_the_part_size_is_compared_with_the_object_before_it_is_read(s3: str, capsys) -> None:
    """R-O47: 2^40 bytes declared for a 296-byte object costs one HEAD, never 16384 ranges."""
    container = (FIXTURES / "valid" / "model.ckpt").read_bytes()
    record = encode_record("model.ckpt", [Entry("model.ckpt", 2**40, xxhash.xxh3_64_intdigest(container))])
    url = _upload(s3, record)
    want = f"{url}: size: object size differs from its commit record (expected {2**40}, got 296); "
    with pytest.raises(FormatError) as e:
        ckptkit.load(url)
    assert str(e.value) == want + "the file is damaged; resume from an earlier checkpoint (R-O47)"
    assert main(["verify", url]) == 1
    out, err = capsys.readouterr()
    assert out.startswith(f"FAIL  {want}") and "internal error" not in out + err


def _record(key: str = "model.ckpt.config.json", size: int = 27) -> bytes:
    return encode_record("model.ckpt", [Entry("model.ckpt", 296, 1), Entry(key, size, 2)])


@pytest.mark.parametrize("suffix", ["config.json", "ngram", "rank-00001.ckdcp", "\u00f1gram", "a_b.c-d"])
def test_every_companion_suffix_ckptkit_writes_is_a_valid_key(suffix: str) -> None:
    """R-O48: a sidecar kind is an identifier (Unicode letters too), a rank file has a dash."""
    assert decode_record(_record(f"model.ckpt.{suffix}"), "URL", "model.ckpt")[1].key == f"model.ckpt.{suffix}"


@pytest.mark.parametrize("suffix", ["", ".", "a.", ".a", "a..b", "a b", "a\\b", "a\tb", "a-", "a\x00"])
def test_a_companion_suffix_outside_the_bound_is_refused_by_r_o48(suffix: str) -> None:
    with pytest.raises(FormatError, match=r"objects\[\]\.key: .*\(R-O48\)$"):
        decode_record(_record(f"model.ckpt.{suffix}"), "URL", "model.ckpt")


def test_sizes_are_accepted_up_to_2_64_minus_1_and_refused_from_2_64() -> None:
    """R-O47 and R-O46 at their boundaries: 20 digits decode, 21 are refused unconverted."""
    assert decode_record(_record(size=2**64 - 1), "URL", "model.ckpt")[1].size == 2**64 - 1
    with pytest.raises(FormatError, match=r"below 2\^64, got 18446744073709551616\); .*\(R-O47\)$"):
        decode_record(_record(size=2**64), "URL", "model.ckpt")
    with pytest.raises(FormatError, match=r"got an integer of 21 digits\); .*\(R-O46\)$"):
        decode_record(_record(size=10**20), "URL", "model.ckpt")


def test_nesting_is_bounded_at_the_records_own_three_levels_and_strings_do_not_count() -> None:
    """R-O46: brackets inside a key are text; a fourth level is refused before decoding."""
    deep = _record().replace(b'"size":27', b'"size":[[27]]')
    with pytest.raises(FormatError, match=r"got nesting deeper than 3\); .*\(R-O46\)$"):
        decode_record(deep, "URL", "model.ckpt")
    text = _record().replace(b"model.ckpt.config.json", b"model.ckpt.x[[[[")
    with pytest.raises(FormatError, match=r"\(R-O48\)$"):  # decoded: the bracket is refused as a key character
        decode_record(text, "URL", "model.ckpt")


@pytest.mark.parametrize("version", ["1.0", "true", '"1"'])
def test_a_version_that_is_not_the_integer_1_is_r_o13_like_any_other_version(version: str) -> None:
    data = _record().replace(b'"version":1', b'"version":' + version.encode())
    with pytest.raises(FormatError, match=rf"version: .*\(expected 1, got {version}\); .*\(R-O13\)$"):
        decode_record(data, "URL", "model.ckpt")
