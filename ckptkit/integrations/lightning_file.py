"""What a Lightning plug-in file says about its run, read torch-free (spec/lightning.md R-L05).

The plug-in (:mod:`ckptkit.integrations.lightning`) stores Lightning's bookkeeping in the
monitor section under :data:`LAYOUT`. The hyper-parameters there are the run's config as
Lightning knows it, so ``ckptkit diff`` compares two plug-in files by them. This module
reads only the section index (no tensor, no digest, no Lightning, no torch): the file's
bytes are checked by ``ckptkit verify`` or by a load.
"""

from __future__ import annotations

import os
from typing import Any

from ..format._container import Source, read_layout

__all__ = ["LAYOUT", "hyper_parameters"]

#: The monitor section's ``layout`` value of a plug-in file; another value is refused on load.
LAYOUT = "ckptkit.integrations.lightning/1"


def hyper_parameters(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``hyper_parameters`` a plug-in file holds (``{}`` when the module saved none), as decoded
    trees (tensors as references); None when ``path`` is not a file the plug-in wrote.

    Raises:
        FormatError: the file is not a ckptkit container, or its header or indexes are malformed.
    """
    with Source(os.fspath(path)) as src:
        layout = read_layout(src)
    monitor = layout.sections.get("monitor")
    tree = monitor.tree if monitor is not None else None
    if not isinstance(tree, dict) or tree.get("layout") != LAYOUT or not isinstance(tree.get("checkpoint"), dict):
        return None
    hparams = tree["checkpoint"].get("hyper_parameters")
    return dict(hparams) if isinstance(hparams, dict) else {}
