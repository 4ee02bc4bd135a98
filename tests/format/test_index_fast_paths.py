"""The index parser's fast paths accept only what its full checks accept, with the same result.

``_plain_record`` (a tensor record) and ``_map``'s first try (a msgpack map) exist for speed
(spec/performance.md §4); the full checks name what is wrong. A fast path that accepted a
record or map the full check refuses would let a hostile index through, so each is compared
with its full check on random input. ``_record_extents`` (the lazy open's pass over a tensor
table, G-71) may leave more to the full check, but the extents it gives are in order, inside
the data region, and the full check's own.
"""

from __future__ import annotations

from typing import Any

import msgpack
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import FormatError, MalformedIndex
from ckptkit.format._section import _BadMap, _check_record, _decode_records, _map, _plain_record, _record_extents


def _bad(problem: str, **kw: Any) -> FormatError:
    return MalformedIndex(problem, **kw)


_SCALAR = st.one_of(
    st.integers(-(2**64), 2**64), st.booleans(), st.floats(allow_nan=False), st.none(), st.binary(max_size=9)
)
_DIM = st.one_of(st.integers(-2, 4096), st.sampled_from([True, False, 2.0, 2**63, 2**62]))
_RECORD = st.tuples(
    st.one_of(st.sampled_from(["float32", "bfloat16", "int8", "bool", "complex", "f32"]), _SCALAR),
    st.one_of(st.lists(_DIM, max_size=4), _SCALAR),
    st.one_of(st.integers(0, 1 << 16).map(lambda n: n * 64), st.integers(-64, 1 << 22), _SCALAR),
    st.one_of(st.integers(0, 1 << 24), _SCALAR),
    st.one_of(st.binary(min_size=8, max_size=8), _SCALAR),
)


@settings(max_examples=examples(4))
@given(
    fields=_RECORD,
    width=st.sampled_from([4, 5]),
    end_prev=st.integers(0, 1 << 20),
    raw_len=st.integers(0, 1 << 26),
    shape_of_nbytes=st.booleans(),
)
def test_a_record_the_fast_path_accepts_passes_the_full_check_with_the_same_digest(
    fields: tuple[Any, ...], width: int, end_prev: int, raw_len: int, shape_of_nbytes: bool
) -> None:
    r = list(fields[:width])
    if shape_of_nbytes and isinstance(r[1], list) and all(type(d) is int and d > 0 for d in r[1]):
        n = 1
        for d in r[1]:
            n *= d
        r[3] = n * {"float32": 4, "bfloat16": 2}.get(r[0], 1)  # often well-formed: the fast path's own case
    fast = _plain_record(r, width, end_prev, raw_len)
    if fast is None:
        return
    assert _check_record("tensor 0", r, width, end_prev, raw_len, _bad) == fast


@settings(max_examples=examples(2))
@given(
    table=st.lists(_RECORD, max_size=3),
    legacy=st.booleans(),
    raw_len=st.integers(0, 1 << 26),
    shape_of_nbytes=st.booleans(),
)
def test_the_extents_of_the_lazy_open_are_ordered_in_bounds_and_the_full_checks_own(
    table: list[tuple[Any, ...]], legacy: bool, raw_len: int, shape_of_nbytes: bool
) -> None:
    width = 4 if legacy else 5
    records = []
    for fields in table:
        r = list(fields[:width])
        if shape_of_nbytes and isinstance(r[1], list) and all(type(d) is int and d > 0 for d in r[1]):
            n = 1
            for d in r[1]:
                n *= d
            r[3] = n * {"float32": 4, "bfloat16": 2}.get(r[0], 1)
        records.append(r)
    try:
        packed = memoryview(msgpack.packb(records, use_bin_type=True))
    except OverflowError:  # an integer msgpack cannot hold: no index carries it
        return
    got = _record_extents(packed, raw_len, width)
    try:
        full = _decode_records(packed, raw_len, legacy=legacy, bad=_bad)
    except MalformedIndex:
        full = None
    if full is not None:
        assert got is None or got == (full.offsets, full.sizes)
    if got is not None:
        end = 0
        for offset, nbytes in zip(*got, strict=True):
            assert offset % 64 == 0 and offset >= end and offset + nbytes <= raw_len
            end = offset + nbytes
        assert len(got[0]) == len(records)


def test_a_well_formed_record_takes_the_fast_path() -> None:
    r = ["float32", [3, 4], 128, 48, b"\x01" + bytes(7)]
    assert _plain_record(r, 5, 64, 176) == 1 == _check_record("tensor 0", r, 5, 64, 176, _bad)


_KEY = st.one_of(st.text(max_size=3), st.integers(-3, 3), st.booleans(), st.floats(allow_nan=False), st.none())


@settings(max_examples=examples(4))
@given(pairs=st.lists(st.tuples(_KEY, st.integers()), max_size=6))
def test_a_map_is_built_as_the_key_by_key_check_builds_it(pairs: list[tuple[Any, int]]) -> None:
    got = _map(pairs)
    problem = None
    seen: dict[Any, int] = {}
    for k, v in pairs:  # the rule, spelled out: string or integer keys (no bool), none twice
        if isinstance(k, bool) or not isinstance(k, (int, str)):
            problem = f"map key {k!r} is not a string or integer"
            break
        if k in seen:
            problem = f"map key {k!r} appears twice"
            break
        seen[k] = v
    if problem is None:
        assert got == seen and list(got) == list(seen)
    else:
        assert isinstance(got, _BadMap) and got.problem == problem


def test_an_unhashable_key_is_named_not_raised() -> None:
    got = _map([([1], 2)])
    assert isinstance(got, _BadMap) and got.problem == "map key [1] is not a string or integer"
