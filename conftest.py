"""Shared test setup: hypothesis profiles.

``ci`` (the default under CI=true) bounds examples and disables the deadline so
shared, noisy machines never flake on timing; ``dev`` is the local default.
Select explicitly with ``HYPOTHESIS_PROFILE=dev|ci|thorough``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
