"""Moved to :mod:`ckptkit.guard.rollback_record`; this path stays because docs/api.md documents it."""

from .guard.rollback_record import *  # noqa: F403
from .guard.rollback_record import __all__ as __all__
