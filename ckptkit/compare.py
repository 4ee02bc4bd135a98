"""Moved to :mod:`ckptkit.audit.compare`; this path stays because docs/api.md documents it."""

from .audit.compare import *  # noqa: F403
from .audit.compare import __all__ as __all__
