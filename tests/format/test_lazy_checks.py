"""What the lazy reader checks, and when (spec/guarantees.md G-71).

``open_checkpoint`` checks the header, each index's map and lengths, the tensor extents and
the skeleton digest; a section's records and tree are checked on the first use of that
section, a tensor's bytes on its first access. A damaged file is refused by the open with the
error ``load`` gives; a file whose digests were recomputed over a bad record or tree (hostile,
not damaged) is refused by the first use of that section, with ``load``'s message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from helpers import ROOT

import ckptkit.format._section as section
from ckptkit import Checkpoint, MalformedIndex, load, open_checkpoint, save, verify
from ckptkit.errors import CheckpointError
from ckptkit.format._container import Source, read_layout, skeleton_extents

FIXTURES = ROOT / "fixtures"
_MANIFEST: dict[str, Any] = json.loads((FIXTURES / "MANIFEST.json").read_text())
CONTAINERS = sorted(
    [f"valid/{n}" for n, e in _MANIFEST["valid"].items() if e["kind"] == "checkpoint"]
    + [f"invalid/{n}" for n, e in _MANIFEST["invalid"].items() if e["reader"] == "load"]
)


def _two_sections(path: Path) -> None:
    save(path, Checkpoint(step=3, model={"w": torch.arange(6.0)}, optim={"m": torch.arange(4, dtype=torch.int16)}))


def _bad_optim_dtype(path: Path, *, resign: bool) -> int:
    """Rename the optim record's dtype ``int16`` to the unknown ``int61`` (same length); with
    ``resign`` the skeleton digest is recomputed, so only R-013 is broken. Returns the index offset."""
    data = bytearray(path.read_bytes())
    with Source(path) as src:
        layout = read_layout(src)
    optim = layout.sections["optim"]
    assert optim is not None and layout.trailer_offset is not None
    at = data.index(b"\xa5int16", optim.start)
    data[at + 1 : at + 6] = b"int61"
    if resign:
        h = xxhash.xxh3_64()
        for a, b in skeleton_extents(layout):  # the extents did not move
            h.update(bytes(data[a:b]))
        data[layout.trailer_offset : layout.trailer_offset + 8] = h.intdigest().to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return optim.start + 8


def _refusal(path: Path) -> str:
    with pytest.raises(MalformedIndex) as e:
        load(path)
    return str(e.value)


def test_the_open_decodes_no_record_nor_tree_and_a_tensor_only_those_of_its_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.ckpt"
    _two_sections(path)
    calls: list[str] = []

    def counted(name: str) -> Any:
        real = getattr(section, name)

        def call(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return real(*a, **k)

        return call

    for name in ("_decode_records", "_decode_section_tree"):
        monkeypatch.setattr(section, name, counted(name))
    with open_checkpoint(path) as ck:
        assert calls == []
        assert torch.equal(ck.tensor("model", "w"), torch.arange(6.0))
        assert calls == ["_decode_records", "_decode_section_tree"]
        assert ck.keys("optim") == ["m"]
        assert len(calls) == 4


def test_a_signed_bad_record_is_refused_by_the_first_use_of_its_section_with_loads_message(tmp_path: Path) -> None:
    path = tmp_path / "hostile.ckpt"
    _two_sections(path)
    at = _bad_optim_dtype(path, resign=True)
    message = _refusal(path)
    assert message == (
        f"{path}: offset {at} (0x{at:x}): optim index: tensor 0: unknown dtype (expected a name from the dtype "
        "table, got 'int61'); the file is damaged or was not written by ckptkit; resume from an earlier "
        "checkpoint (R-013)"
    )
    assert str(verify(path).error) == message
    with open_checkpoint(path) as ck:  # the model section is sound, and its tensor is served
        assert torch.equal(ck.tensor("model", "w"), torch.arange(6.0))
        for use in (lambda: ck.tensor("optim", "m"), lambda: ck.keys("optim"), lambda: ck.get("optim")):
            with pytest.raises(MalformedIndex) as e:
                use()
            assert str(e.value) == message


def test_a_damaged_record_is_refused_by_the_open_with_its_own_rule_as_load_refuses_it(tmp_path: Path) -> None:
    path = tmp_path / "damaged.ckpt"
    _two_sections(path)
    _bad_optim_dtype(path, resign=False)
    message = _refusal(path)
    assert message.endswith("(R-013)")
    with pytest.raises(MalformedIndex) as e:
        open_checkpoint(path)
    assert str(e.value) == message
    assert e.value.__context__ is None  # one error, not the skeleton mismatch it was found under


def _lazy_verdict(path: Path) -> str | None:
    try:
        with open_checkpoint(path) as ck:
            for name in ck.sections:
                ck.get(name)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _load_verdict(path: Path) -> str | None:
    try:
        load(path)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("name", CONTAINERS)
def test_reading_every_section_lazily_gives_each_fixture_the_verdict_load_gives(name: str) -> None:
    path = FIXTURES / name
    assert _lazy_verdict(path) == _load_verdict(path)
