"""Moved to :mod:`ckptkit.run.history`; this path stays because docs/api.md documents it."""

from .run.history import *  # noqa: F403
from .run.history import __all__ as __all__
