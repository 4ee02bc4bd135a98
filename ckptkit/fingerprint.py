"""Moved to :mod:`ckptkit.run.fingerprint`; this path stays because docs/api.md documents it."""

from .run.fingerprint import *  # noqa: F403
from .run.fingerprint import __all__ as __all__
