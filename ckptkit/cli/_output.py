"""Output shared by the commands that end in a verdict (replay, audit); their progress is ``_progress``."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["print_verdict"]


def print_verdict(report: Any, as_json: bool) -> int:
    """Print a report (``to_json()`` / ``describe()`` / ``ok``); exit 0 when ok, else 1."""
    if as_json:
        print(json.dumps(report.to_json(), sort_keys=True, indent=2))
    else:
        print(report.describe())
    return 0 if report.ok else 1
