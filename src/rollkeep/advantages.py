"""Moved to `rollkeep.core.advantages` (the scheduler computes advantages at finalize);
this name stays importable."""

from .core.advantages import *  # noqa: F403
from .core.advantages import __all__  # noqa: F401
