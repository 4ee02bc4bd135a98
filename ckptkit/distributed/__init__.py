"""ckptkit as the storage backend of PyTorch Distributed Checkpoint (``spec/distributed.md``).

Under ``torchrun``::

    import ckptkit.distributed as ckd
    ckd.save({"model": model.state_dict(), "optim": optim.state_dict()}, "ckpt/step-100")
    ckd.load(state, "ckpt/step-100")          # any world size: DCP reshards

or DCP directly: ``dcp.save(state, storage_writer=ckd.Writer(path))``,
``dcp.load(state, storage_reader=ckd.Reader(path))``.

Importing this package does not import torch: ``format`` (the files, verify) is
torch-free and the rest is loaded on first use, so ``ckptkit verify DIR`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AsyncSaver", "LoadPlanner", "Reader", "Writer", "load", "save", "verify_directory"]

_LAZY = {
    "AsyncSaver": "_save_load",
    "load": "_save_load",
    "save": "_save_load",
    "LoadPlanner": "_storage",
    "Reader": "_storage",
    "Writer": "_storage",
    "verify_directory": "_format",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
