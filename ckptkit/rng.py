"""Moved to :mod:`ckptkit.run.rng`; this path stays because docs/api.md documents it."""

from .run.rng import *  # noqa: F403
from .run.rng import __all__ as __all__
