"""Fingerprints are exact and order-independent."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptkit.run._fingerprint import float_bits, state_digest, tensor_digest


def test_float_bits_are_the_exact_pattern_at_the_values_own_width():
    assert float_bits(torch.tensor(1.1)) == "0x3f8ccccd"
    assert float_bits(torch.tensor(1.1, dtype=torch.bfloat16)) == "0x3f8d"
    assert float_bits(1.1) == "0x3ff199999999999a"
    assert float_bits(-0.0) != float_bits(0.0)


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=16), st.data())
def test_a_single_flipped_bit_changes_the_tensor_digest(values, data):
    t = torch.tensor(values, dtype=torch.float32)
    i = data.draw(st.integers(0, t.numel() * 32 - 1))
    flipped = t.clone()
    flipped.view(torch.int32)[i // 32] ^= 1 << (i % 32)
    assert tensor_digest("w", t) != tensor_digest("w", flipped)


def test_name_dtype_and_shape_are_part_of_the_digest():
    t = torch.zeros(2, 3)
    base = tensor_digest("w", t)
    assert base != tensor_digest("v", t)
    assert base != tensor_digest("w", t.reshape(3, 2))
    assert base != tensor_digest("w", t.to(torch.int32))
    assert base == tensor_digest("w", t.clone())


@given(st.permutations(list(range(5))))
def test_state_digest_ignores_order_but_not_a_swap_of_contents(order):
    named = [(f"t{i}", torch.full((2,), float(i))) for i in range(5)]
    assert state_digest([named[i] for i in order]) == state_digest(named)
    swapped = [("t0", named[1][1]), ("t1", named[0][1]), *named[2:]]
    assert state_digest(swapped) != state_digest(named)
