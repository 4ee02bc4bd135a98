"""The one-line error of an integration whose optional extra is not installed."""

from __future__ import annotations


def missing_extra(e: ModuleNotFoundError, module: str, package: str, what: str) -> ModuleNotFoundError:
    """The error to raise for ``e`` on importing ``module``: naming the extra when ``package`` is
    what is missing, ``e`` itself when something else is (a broken install is not a missing extra)."""
    if (e.name or "").partition(".")[0] != package:
        return e
    return ModuleNotFoundError(f"{module} needs {what}: pip install 'ckptkit[{package}]'", name=e.name)
