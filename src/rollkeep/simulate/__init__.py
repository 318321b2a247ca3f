"""`rollkeep simulate`: deterministic simulation of whole runs (docs/design.md §10).

    memfs       an in-memory disk that fails, tears and forgets what was never fsynced
    world       one simulated run: the real scheduler, ledger, store and restore chain on a
                fake clock, a scripted engine, the toy trainer, crashes and restarts
    schedules   random schedules, their checks, and shrinking a violation
"""

from .schedules import Summary, check, plan, report, simulate
from .world import Crash, Outcome, Plan, World

__all__ = ["Crash", "Outcome", "Plan", "Summary", "World", "check", "plan", "report", "simulate"]
