"""ckptkit.run._rng: randomness is a pure function of (seed, step) (spec/determinism.md)."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.run import _rng as rng
from ckptkit.run._rng import (
    GAMMA,
    Stream,
    draw,
    draws,
    mask_stream,
    mix64,
    numpy_generator,
    randint,
    sample_depth,
    torch_generator,
    uniform,
    uniforms,
)

U64 = st.integers(min_value=0, max_value=2**64 - 1)
SMALL = st.integers(min_value=0, max_value=10_000)

# (seed, step, stream, index) -> u64. The same table is in spec/determinism.md
# ("Test vectors"); an implementation in another language checks itself against it.
VECTORS = [
    ((0, 0, 0, 0), 0x2130748AAAC80268),
    ((0, 0, 0, 1), 0x0CC78FB979CE5090),
    ((1, 0, 0, 0), 0xE28195DDD9EE4956),
    ((0, 1, 0, 0), 0xD9EEF7F073D37C42),
    ((0, 0, 1, 0), 0xD1C0270687984B37),
    ((1, 120, 5, 3), 0x9BF9930CD443A020),
    ((42, 7, 3, 0), 0xC6A5886A07085B69),
    ((2**64 - 1, 2**64 - 1, 2**64 - 1, 2**64 - 1), 0xF6100EF5E4E763F6),
    ((20260927, 1000000, 4, 255), 0xB27B6F649CF47F32),
]


def _spec_draw(seed: int, step: int, index: int, stream: int) -> int:
    """The rule exactly as spec/determinism.md R-D02 writes it, independent of rng.py."""
    m = 2**64

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
        return z ^ (z >> 31)

    h = 0
    for x in (seed, stream, step):
        h = mix(((h ^ x) + 0x9E3779B97F4A7C15) % m)
    return mix((h + (index + 1) * 0x9E3779B97F4A7C15) % m)


class _GlobalRngUntouched:
    """Assert that random, numpy.random and torch's global generator are not advanced."""

    def __enter__(self) -> None:
        self.py = random.getstate()
        self.np = np.random.get_state()
        self.torch = torch.get_rng_state().clone()

    def __exit__(self, *exc: object) -> None:
        assert random.getstate() == self.py
        after = np.random.get_state()
        assert isinstance(after, tuple) and isinstance(self.np, tuple)  # the legacy (default) form
        assert after[0] == self.np[0] and np.array_equal(after[1], self.np[1]) and after[2:] == self.np[2:]
        assert torch.equal(torch.get_rng_state(), self.torch)


# ---------------------------------------------------------------------- splitmix64 and draw


def test_mix64_reproduces_the_reference_splitmix64_sequence() -> None:
    # Vigna's splitmix64.c seeded with 1234567: the widely published first outputs.
    got = [mix64(1234567 + (i + 1) * GAMMA) for i in range(5)]
    assert got == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


@pytest.mark.parametrize(("args", "expected"), VECTORS)
def test_draw_matches_spec_vectors(args: tuple[int, int, int, int], expected: int) -> None:
    seed, step, stream, index = args
    assert draw(seed, step, index, stream) == expected
    assert _spec_draw(seed, step, index, stream) == expected


@settings(max_examples=examples(12))
@given(U64, U64, U64, U64)
def test_draw_follows_the_spec_rule_for_any_u64_inputs(seed: int, step: int, index: int, stream: int) -> None:
    value = draw(seed, step, index, stream)
    assert 0 <= value < 2**64
    assert value == _spec_draw(seed, step, index, stream)


@settings(max_examples=examples(4))
@given(st.lists(st.tuples(SMALL, SMALL, SMALL, st.integers(0, 7)), min_size=1, max_size=20), st.randoms())
def test_draw_does_not_depend_on_call_order(calls: list[tuple[int, int, int, int]], shuffler: random.Random) -> None:
    first = {c: draw(*c) for c in calls}
    shuffled = list(calls)
    shuffler.shuffle(shuffled)
    assert {c: draw(*c) for c in reversed(shuffled)} == first


def test_draw_is_the_same_in_a_fresh_process() -> None:
    code = "from ckptkit.run._rng import draw; print(draw(7, 11, 13, 3))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == draw(7, 11, 13, 3)


@pytest.mark.parametrize("field", ["seed", "step", "index", "stream"])
def test_draw_changes_when_any_single_input_changes(field: str) -> None:
    # Over 2000 neighbouring inputs no value repeats, and the top bit is fair.
    base = {"seed": 1, "step": 100, "index": 5, "stream": 3}
    values = []
    for k in range(2000):
        args = dict(base, **{field: k})
        values.append(draw(args["seed"], args["step"], args["index"], args["stream"]))
    assert len(set(values)) == len(values)
    top = sum(v >> 63 for v in values)
    assert 850 < top < 1150  # binomial(2000, 0.5): mean 1000, sd 22


def test_draws_over_index_are_distinct_for_one_key() -> None:
    values = draws(3, 4, 100_000, Stream.MASK)
    assert len(np.unique(values)) == values.size


def test_uniform_is_the_top_53_bits() -> None:
    for args in [(0, 0, 0), (1, 2, 3), (2**64 - 1, 5, 9)]:
        u = uniform(*args)
        assert 0.0 <= u < 1.0
        assert u == (draw(*args) >> 11) / 2**53


def test_uniform_mean_is_one_half() -> None:
    u = uniforms(11, 12, 200_000)
    assert abs(u.mean() - 0.5) < 0.005
    assert u.min() >= 0.0 and u.max() < 1.0


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"seed": -1}, ValueError, "seed must be in [0, 2**64) (got -1)"),
        ({"step": 2**64}, ValueError, f"step must be in [0, 2**64) (got {2**64})"),
        ({"index": -5}, ValueError, "index must be in [0, 2**64) (got -5)"),
        ({"stream": -1}, ValueError, "stream must be in [0, 2**64) (got -1)"),
        ({"seed": 1.0}, TypeError, "seed must be an int (got float)"),
        ({"step": True}, TypeError, "step must be an int (got bool)"),
    ],
)
def test_draw_refuses_bad_arguments_naming_them(kwargs: dict[str, object], exc: type, message: str) -> None:
    args = dict({"seed": 0, "step": 0, "index": 0, "stream": 0}, **kwargs)
    with pytest.raises(exc) as info:
        draw(**args)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_draw_accepts_numpy_integers_and_stream_members() -> None:
    assert draw(np.uint64(5), np.int64(6), np.int32(7), Stream.DATA) == draw(5, 6, 7, 2)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0, 0, 0, 0), 0.1296456182997474),
        ((1, 120, 3, Stream.DROPOUT), 0.6092769533463653),
        ((20260927, 1000000, 255, Stream.DEPTH), 0.6971959705960716),
    ],
)
def test_uniform_matches_spec_vectors(args: tuple[int, int, int, int], expected: float) -> None:
    assert uniform(*args) == expected


@pytest.mark.parametrize(
    ("args", "bits"),
    [
        ((64, 0.3, 4, 1, 0), "0000000000011110000111100000000000000000000000000000011110111100"),
        ((32, 0.15, 10, 1, 120), "00000000000000000000000000000001"),
        ((16, 1.0, 1, 7, 3), "1111111111111111"),
    ],
)
def test_mask_stream_matches_spec_vectors(args: tuple[int, float, int, int, int], bits: str) -> None:
    t, frac, span, seed, step = args
    mask = mask_stream(t, frac, span, seed=seed, step=step)
    assert "".join("1" if x else "0" for x in mask) == bits


def test_sample_depth_and_randint_match_spec_vectors() -> None:
    assert [sample_depth(12, 4, seed=1, step=s) for s in range(10)] == [6, 11, 10, 7, 11, 11, 5, 10, 11, 4]
    assert randint(5, 0, 0, 999, index=2, stream=Stream.DATA) == 917


# ---------------------------------------------------------------------- vectorised == scalar


@settings(max_examples=examples(4))
@given(U64, U64, st.integers(0, 64), U64)
def test_vectorised_equals_scalar_exactly(seed: int, step: int, n: int, stream: int) -> None:
    d = draws(seed, step, n, stream)
    u = uniforms(seed, step, n, stream)
    assert d.dtype == np.uint64 and u.dtype == np.float64
    assert d.shape == u.shape == (n,)
    assert [int(x) for x in d] == [draw(seed, step, i, stream) for i in range(n)]
    assert [float(x) for x in u] == [uniform(seed, step, i, stream) for i in range(n)]


def test_draws_of_zero_is_empty_and_negative_is_refused() -> None:
    assert draws(1, 2, 0).shape == (0,)
    with pytest.raises(ValueError, match=r"^n must be >= 0 \(got -1\)$"):
        draws(1, 2, -1)


# ---------------------------------------------------------------------- mask_stream


@settings(max_examples=examples(8))
@given(
    st.integers(0, 300),
    st.floats(0.0, 1.0),
    st.integers(1, 20),
    SMALL,
    SMALL,
)
def test_mask_is_the_causal_dilation_of_its_starts(t: int, frac: float, span: int, seed: int, step: int) -> None:
    mask = mask_stream(t, frac, span, seed=seed, step=step)
    assert mask.dtype == np.bool_ and mask.shape == (t,)
    starts = [uniform(seed, step, j, Stream.MASK) < frac / span for j in range(t)]
    expected = [any(starts[max(0, i - span + 1) : i + 1]) for i in range(t)]
    assert mask.tolist() == expected
    assert np.array_equal(mask, mask_stream(t, frac, span, seed=seed, step=step))


@settings(max_examples=examples(4))
@given(st.integers(0, 60), st.integers(0, 6), st.floats(0.0, 1.0), st.integers(1, 8), SMALL, SMALL)
def test_a_mask_per_row_draws_row_r_at_indices_r_times_t(
    t: int, rows: int, frac: float, span: int, seed: int, step: int
) -> None:
    masks = mask_stream(t, frac, span, seed=seed, step=step, rows=rows)
    assert masks.dtype == np.bool_ and masks.shape == (rows, t)
    for r in range(rows):
        starts = [uniform(seed, step, r * t + j, Stream.MASK) < frac / span for j in range(t)]
        assert masks[r].tolist() == [any(starts[max(0, i - span + 1) : i + 1]) for i in range(t)]
    if rows:
        assert np.array_equal(masks[0], mask_stream(t, frac, span, seed=seed, step=step))


def test_mask_rows_match_the_spec_vector() -> None:
    masks = mask_stream(16, 0.5, 2, seed=1, step=7, rows=3)
    assert ["".join("1" if x else "0" for x in row) for row in masks] == [
        "0011001110001100",
        "0000001110111111",
        "0000000000111111",
    ]


def test_mask_every_masked_position_has_a_start_within_span_behind_it() -> None:
    t, span = 500, 7
    mask = mask_stream(t, 0.3, span, seed=5, step=9)
    starts = uniforms(5, 9, t, Stream.MASK) < 0.3 / span
    for i in np.flatnonzero(mask):
        assert starts[max(0, i - span + 1) : i + 1].any()
    for j in np.flatnonzero(starts):  # and every start masks its whole span
        assert mask[j : j + span].all()


@pytest.mark.parametrize(("frac", "span"), [(0.15, 10), (0.5, 4), (0.65, 1), (1.0, 5)])
def test_mask_fraction_matches_the_documented_expectation(frac: float, span: int) -> None:
    t = 1000
    p = frac / span
    steady = 1.0 - (1.0 - p) ** span  # spec/determinism.md R-D05
    total = np.stack([mask_stream(t, frac, span, seed=1, step=s) for s in range(200)])
    observed = total[:, span - 1 :].mean()  # away from the left edge
    assert abs(observed - steady) < 0.01


def test_mask_frac_zero_masks_nothing_and_one_with_span_one_masks_all() -> None:
    assert not mask_stream(1000, 0.0, 8, seed=1, step=0).any()
    assert mask_stream(1000, 1.0, 1, seed=1, step=0).all()
    assert mask_stream(0, 0.5, 3, seed=1, step=0).shape == (0,)


def test_mask_depends_on_step_and_seed() -> None:
    a = mask_stream(256, 0.3, 4, seed=1, step=10)
    assert not np.array_equal(a, mask_stream(256, 0.3, 4, seed=1, step=11))
    assert not np.array_equal(a, mask_stream(256, 0.3, 4, seed=2, step=10))
    assert not np.array_equal(a, mask_stream(256, 0.3, 4, seed=1, step=10, stream=Stream.DEFAULT))


@pytest.mark.parametrize(
    ("args", "exc", "message"),
    [
        ((10, 0.1, 0), ValueError, "mask_span must be >= 1 (got 0)"),
        ((10, 0.1, -3), ValueError, "mask_span must be >= 1 (got -3)"),
        ((-1, 0.1, 2), ValueError, "t must be >= 0 (got -1)"),
        ((10, -0.01, 2), ValueError, "mask_frac must be in [0, 1] (got -0.01)"),
        ((10, 1.5, 2), ValueError, "mask_frac must be in [0, 1] (got 1.5)"),
        ((10, float("nan"), 2), ValueError, "mask_frac must be in [0, 1] (got nan)"),
        ((10, 0.1, 2.0), TypeError, "mask_span must be an int (got float)"),
        ((10, "0.1", 2), TypeError, "mask_frac must be a number (got str)"),
    ],
)
def test_mask_stream_refuses_bad_arguments_naming_them(args: tuple, exc: type, message: str) -> None:
    with pytest.raises(exc) as info:
        mask_stream(*args, seed=1, step=0)
    assert str(info.value) == message


def test_mask_stream_refuses_a_bad_row_count_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^rows must be >= 0 \(got -1\)$"):
        mask_stream(8, 0.1, 2, seed=1, step=0, rows=-1)
    with pytest.raises(TypeError, match=r"^rows must be an int \(got bool\)$"):
        mask_stream(8, 0.1, 2, seed=1, step=0, rows=True)


def test_mask_boundaries_are_accepted() -> None:
    mask_stream(0, 0.0, 1, seed=0, step=0)
    mask_stream(1, 1.0, 1, seed=0, step=0)


# ---------------------------------------------------------------------- randint / sample_depth


@settings(max_examples=examples(8))
@given(SMALL, SMALL, st.integers(-50, 50), st.integers(0, 100), SMALL)
def test_randint_is_in_range_and_the_documented_map(seed: int, step: int, lo: int, width: int, index: int) -> None:
    hi = lo + width
    k = randint(seed, step, lo, hi, index=index, stream=Stream.DATA)
    assert lo <= k <= hi
    assert k == lo + ((draw(seed, step, index, Stream.DATA) * (width + 1)) >> 64)


def test_randint_covers_its_range_evenly() -> None:
    counts = np.bincount([randint(1, s, 0, 3) for s in range(8000)], minlength=4)
    assert counts.min() > 1800  # 2000 expected per value


def test_randint_refuses_an_empty_range() -> None:
    with pytest.raises(ValueError, match=r"^hi must be >= lo \(got lo=5, hi=4\)$"):
        randint(1, 2, 5, 4)


def test_sample_depth_is_randint_on_the_depth_stream() -> None:
    for step in range(200):
        d = sample_depth(6, 2, seed=3, step=step)
        assert 2 <= d <= 6
        assert d == randint(3, step, 2, 6, stream=Stream.DEPTH)
    assert {sample_depth(6, 2, seed=3, step=s) for s in range(200)} == {2, 3, 4, 5, 6}
    assert sample_depth(4, 4, seed=3, step=1) == 4


@pytest.mark.parametrize(
    ("n_layers", "min_depth", "message"),
    [
        (6, 0, "min_depth must be >= 1 (got 0)"),
        (6, 7, "min_depth must be <= n_layers (got min_depth=7, n_layers=6)"),
    ],
)
def test_sample_depth_refuses_bad_bounds(n_layers: int, min_depth: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sample_depth(n_layers, min_depth, seed=1, step=0)


# ---------------------------------------------------------------------- generators


def test_torch_generator_is_seeded_from_the_draw() -> None:
    g = torch_generator(1, 50, Stream.DROPOUT)
    assert g.initial_seed() == draw(1, 50, 0, Stream.DROPOUT)
    a = torch.rand(8, generator=g)
    b = torch.rand(8, generator=torch_generator(1, 50, Stream.DROPOUT))
    assert torch.equal(a, b)
    assert not torch.equal(a, torch.rand(8, generator=torch_generator(1, 51, Stream.DROPOUT)))


def test_numpy_generator_is_pcg64_seeded_from_the_draw() -> None:
    g = numpy_generator(1, 50, Stream.SAMPLE)
    expected = np.random.Generator(np.random.PCG64(draw(1, 50, 0, Stream.SAMPLE)))
    assert np.array_equal(g.integers(0, 2**63, 8), expected.integers(0, 2**63, 8))


def test_no_function_touches_a_global_rng() -> None:
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    with _GlobalRngUntouched():
        draw(1, 2, 3, 4)
        uniform(1, 2, 3)
        draws(1, 2, 100)
        uniforms(1, 2, 100)
        mask_stream(100, 0.3, 4, seed=1, step=2)
        randint(1, 2, 0, 9)
        sample_depth(6, 2, seed=1, step=2)
        torch.rand(4, generator=torch_generator(1, 2, Stream.DROPOUT))
        numpy_generator(1, 2).random(4)


def test_import_does_not_import_torch() -> None:
    code = "import sys, ckptkit.run._rng; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_stream_numbers_are_pinned() -> None:
    # Renumbering a stream changes every run that uses it (spec/determinism.md R-D03).
    assert {s.name: s.value for s in Stream} == {
        "DEFAULT": 0,
        "INIT": 1,
        "DATA": 2,
        "MASK": 3,
        "DEPTH": 4,
        "DROPOUT": 5,
        "SAMPLE": 6,
        "SPIKE": 7,
    }


def test_public_names() -> None:
    assert sorted(rng.__all__) == rng.__all__
