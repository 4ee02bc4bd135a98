"""R-DC20/R-DC21 (spec/distributed.md §3): a tensor's chunks tile it, and are bytes present.

The check is proven against the obvious one (count, per element, the chunks that hold
it) on small random layouts; the golden fixtures (``R-DC20-*``) prove that ``verify``
and ``load`` apply it. Then what a hostile declared size used to do to ``diff --tensors``
(allocate 2^63-1 rows), and a reader of the CLI's output that goes away (``| head``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import load_script
from hypothesis import given
from hypothesis import strategies as st

from ckptkit import errors
from ckptkit.cli import main
from ckptkit.distributed import _format as fmt
from ckptkit.distributed import verify_directory

ROOT = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURES = ROOT / "distributed"
GENERATE = load_script("generate_distributed", ROOT / "generate_distributed.py")


def _bad(problem: str, actual: Any = None, rule: str = "R-DC05") -> errors.FormatError:
    return errors.MalformedIndex(problem, field="metadata", hint=rule)


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> fmt.Chunk:
    return fmt.Chunk(offsets, sizes, 0, 0, 0, 0)


def _verdict(size: tuple[int, ...], chunks: list[fmt.Chunk]) -> str | None:
    try:
        fmt._check_tiling("t", size, chunks, _bad)
    except errors.MalformedIndex as e:
        return str(e)
    return None


@st.composite
def _layouts(draw: Any) -> tuple[tuple[int, ...], list[fmt.Chunk]]:
    """A small tensor and boxes inside it: half the time a grid (a tiling), else random boxes."""
    size = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
    if draw(st.booleans()):
        cuts = [sorted({0, d, *draw(st.lists(st.integers(0, d), max_size=2))}) for d in size]
        grid = [list(itertools.pairwise(c)) or [(0, 0)] for c in cuts]
        boxes: list[tuple[tuple[int, int], ...]] = [()]
        for ranges in grid:
            boxes = [(*b, r) for b in boxes for r in ranges]
        chunks = [_chunk(tuple(lo for lo, _ in b), tuple(hi - lo for lo, hi in b)) for b in boxes]
        chunks = draw(st.permutations(chunks))
        if chunks and draw(st.booleans()):  # break it: drop, repeat or shift one box
            i = draw(st.integers(0, len(chunks) - 1))
            how = draw(st.sampled_from(["drop", "repeat", "grow"]))
            c = chunks[i]
            if how == "drop":
                chunks = chunks[:i] + chunks[i + 1 :]
            elif how == "repeat":
                chunks = [*chunks, c]
            else:
                d = draw(st.integers(0, len(size) - 1))
                grown = list(c.sizes)
                grown[d] = min(grown[d] + 1, size[d] - c.offsets[d])
                chunks[i] = dataclasses.replace(c, sizes=tuple(grown))
        return size, chunks
    chunks = []
    for _ in range(draw(st.integers(0, 4))):
        offsets = tuple(draw(st.integers(0, d)) for d in size)
        sizes = tuple(draw(st.integers(0, d - o)) for o, d in zip(offsets, size, strict=True))
        chunks.append(_chunk(offsets, sizes))
    return size, chunks


@given(_layouts())
def test_the_corner_sums_agree_with_counting_every_element(layout):
    size, chunks = layout
    count = np.zeros(size, dtype=np.int64)
    for c in chunks:
        count[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] += 1
    twice = len({c.offsets for c in chunks}) != len(chunks)
    verdict = _verdict(size, chunks)
    if twice:
        assert verdict is not None and "a chunk listed twice" in verdict
    elif (count == 1).all():
        assert verdict is None
    else:
        assert verdict is not None and "do not tile" in verdict
        element = verdict.split("element ")[1].split("]")[0] + "]"
        n = int(verdict.split(" is in ")[1].split(" ")[0])
        assert count[tuple(json.loads(element))] == n != 1  # the element named is one that is wrong, with its count


def test_dcp_layouts_with_empty_shards_are_tilings():
    # 3 rows on 4 ranks (FSDP2): rank 3 holds an empty shard at row 3; a 2 x 2 grid (TP x FSDP)
    rows = [_chunk((r, 0), (1, 5)) for r in range(3)] + [_chunk((3, 0), (0, 5))]
    assert _verdict((3, 5), rows) is None
    grid = [_chunk((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    assert _verdict((4, 6), grid) is None
    assert _verdict((0, 4), [_chunk((0, 0), (0, 4))]) is None
    assert _verdict((), [_chunk((), ())]) is None


def test_row_blocks_of_a_petabyte_tensor_are_checked_without_touching_it():
    n = 1 << 16  # rows of 2^40 elements: the tensor would be 256 PiB of float32
    chunks = [_chunk((r, 0), (1, 1 << 40)) for r in range(n)]
    assert _verdict((n, 1 << 40), chunks) is None
    assert "element [65536, 0] is in 0 chunks" in (_verdict((n + 1, 1 << 40), chunks) or "")


def test_too_many_split_dimensions_are_refused_by_name():
    chunks = [_chunk(tuple(i >> b & 1 for b in range(20)), (1,) * 20) for i in range(8)]
    assert "8 chunks splitting 20 dimensions are too many to check" in (_verdict((2,) * 20, chunks) or "")


def _diff_huge(tmp_path: Path, source: str, transformed: bool, capsys: Any) -> tuple[Path, str]:
    """``diff --tensors`` of a copy of ``source`` whose model.w declares 2^63-1 rows (or 2^40, its
    second chunk zstd-transformed to cover them): the copy and what the command said on stderr."""
    d = tmp_path / "huge"
    shutil.copytree(FIXTURES / source, d)
    meta = fmt.read_metadata(str(d))
    w = meta.tensors["model.w"]
    rows = (1 << 40) if transformed else 2**63 - 1
    bottom = dataclasses.replace(w.chunks[1], sizes=(rows - 2, 3)) if transformed else w.chunks[1]
    w = dataclasses.replace(w, size=(rows, 3), chunks=(w.chunks[0], bottom))
    GENERATE._rewrite_metadata(d, dataclasses.replace(meta, tensors={**meta.tensors, "model.w": w}))
    assert main(["diff", str(d), str(FIXTURES / source), "--tensors"]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err
    return d, err


def test_diff_tensors_of_a_declared_2_pow_63_rows_is_a_clear_error(tmp_path, capsys):
    d, err = _diff_huge(tmp_path, "two-ranks", False, capsys)
    assert err.startswith(f"ckptkit diff: {d}/metadata.ckdcp: offset 32 (0x20): metadata: model.w: the chunks do not")
    assert "element [4, 0] is in 0 chunks, not 1 (a gap; the chunks hold 12 of its 27670116110564327421" in err
    assert "(R-DC20)" in err and not verify_directory(d).ok


def test_diff_tensors_refuses_a_transformed_chunk_too_large_to_assemble_before_allocating(tmp_path, capsys):
    d, err = _diff_huge(tmp_path, "two-ranks-zstd", True, capsys)
    need = (2 * (1 << 40) - 2) * 3 * 4  # the tensor and its largest chunk
    assert err.startswith(f"ckptkit diff: {d}: tensor 'model.w' (float32[1099511627776, 3]) needs {need} bytes ")
    assert "nothing was allocated" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "distributed/two-ranks"],
        ["inspect", "distributed/two-ranks", "--json"],
        ["verify", "distributed/two-ranks"],
        ["verify", "valid/v2-all-sections.ckpt", "--json"],
        ["inspect", "valid/v2-all-sections.ckpt"],
    ],
)
def test_a_reader_that_goes_away_ends_the_command_quietly_as_sigpipe_does(argv):
    read, write = os.pipe()
    os.close(read)  # `| head` that has already exited: every write is EPIPE
    try:
        p = subprocess.run(
            [sys.executable, "-m", "ckptkit", *argv],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT.parent)},
        )
    finally:
        os.close(write)
    assert (p.returncode, p.stderr.decode()) == (141, "")  # 128 + SIGPIPE, nothing said
