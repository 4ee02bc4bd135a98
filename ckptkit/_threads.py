"""A tiny work pool for I/O and copies that release the GIL (preadv, xxh3, numpy copies).

Private: shared by the container's readers and the async saver's snapshot copy.
Plain threads, not torch's pool: torch's parallel ``copy_`` spins its OpenMP pool
per tensor and is many times slower on a busy machine (``bench/``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["cpus", "run_parallel"]

T = TypeVar("T")


def cpus() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def run_parallel(fn: Callable[[T], None], items: Iterable[T], lanes: int, name: str) -> None:
    """Call ``fn(item)`` for every item, in ``lanes`` threads (the caller's included).

    Items are handed out in order; ``fn`` must not raise (record failures itself).
    """
    lock = threading.Lock()
    it = iter(items)

    def worker() -> None:
        while True:
            with lock:
                item = next(it, _DONE)
            if item is _DONE:
                return
            fn(item)  # type: ignore[arg-type]

    pool = [threading.Thread(target=worker, name=f"{name}-{n}", daemon=True) for n in range(max(lanes, 1) - 1)]
    for t in pool:
        t.start()
    worker()
    for t in pool:
        t.join()


_DONE = object()
