"""Moved to :mod:`ckptkit.run.environment`; this path stays because docs/api.md documents it."""

from .run.environment import *  # noqa: F403
from .run.environment import __all__ as __all__
