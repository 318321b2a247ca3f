"""Moved to `rollkeep.core.rollout.advantages` (the scheduler computes advantages at finalize);
this name stays importable."""

from .core.rollout.advantages import *  # noqa: F403
from .core.rollout.advantages import __all__  # noqa: F401
