"""Output shared by the commands that end in a verdict (replay, audit)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["print_verdict", "progress"]


def print_verdict(report: Any, as_json: bool) -> int:
    """Print a report (``to_json()`` / ``describe()`` / ``ok``); exit 0 when ok, else 1."""
    if as_json:
        print(json.dumps(report.to_json(), sort_keys=True, indent=2))
    else:
        print(report.describe())
    return 0 if report.ok else 1


def progress(command: str) -> Callable[[str], None]:
    """A progress logger for ``command``: one prefixed line on stderr per message."""

    def log(msg: str) -> None:
        print(f"ckptkit {command}: {msg}", file=sys.stderr, flush=True)

    return log
