"""Fixtures shared by the distributed tests (the hypothesis profiles are in the root conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    """A pool of 2 real gloo ranks for one test module (tests/_dist_workers.py), reaped after it."""
    from _dist_workers import RankPool  # lazily: most test modules never start ranks

    p = RankPool(2)
    try:
        yield p
    finally:
        p.close()
