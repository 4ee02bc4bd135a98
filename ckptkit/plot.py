"""Moved to :mod:`ckptkit.audit.plot`; this path stays because docs/api.md documents it."""

from .audit.plot import *  # noqa: F403
from .audit.plot import __all__ as __all__
