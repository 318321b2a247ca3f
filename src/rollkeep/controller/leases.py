"""Environments that recover by lease, the runner's part (docs/design.md §13): it only waits.

    Leases.gate(key)        an episode's side of the cut's environment phase: a step starts
                            once the scheduler lets it (`Scheduler.env_step_begin`); its end
                            wakes the loop, which may then cut
    Leases.after_poll()     the gate opened or closed by the poll; the leases of chains the
                            scheduler dropped (`PrefixStore.take_released`) released
    Leases.ended(...)       after an attempt's result: release the live environment's lease
                            if the episode is over for good (sealed, or failed as data)

A lease is released once what ended it is durable (the journal's next fsync): a kill before
then resumes the episode from its handle, which must still hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..core.custody.events import DATA
from ..core.custody.trace_schema import LeaseReleased
from ..core.schedule import Generated, Outcome
from ..envs import EnvSpec
from .episodes import release
from .usercode import UserCode

__all__ = ["Leases"]


class Leases:
    def __init__(self, env: EnvSpec, *, sched: Any, code: UserCode, trace: Any, journal: Any,
                 spawn: Callable[[Any], Any], wake: asyncio.Event) -> None:
        self.env, self.sched, self.code, self.trace, self.journal = env, sched, code, trace, journal
        self.spawn, self.wake = spawn, wake
        self.open = asyncio.Event()  # the cut's environment phase lets environment steps start
        self.open.set()

    def gate(self, key: tuple[str, int, int]) -> _Gate:
        return _Gate(self, key)

    def after_poll(self) -> None:
        if self.sched.env_gate_open:  # (closed by the poll that began a cut's environment phase)
            self.open.set()
        else:
            self.open.clear()
        for sibling, handle in self.sched.prefixes.take_released():  # episodes whose turns go unused
            self.spawn(self._release(sibling, handle=handle))

    def ended(self, key: tuple[str, int, int], built: list, outcome: Outcome, current: bool) -> None:
        """`current`: the attempt was current when its result came (else it was abandoned, and
        its chain's lease, if it is dropped, is the scheduler's to hand back)."""
        if built and current and (isinstance(outcome, Generated) or outcome.kind == DATA):
            self.spawn(self._release(key[:2], env=built[0]))  # the episode is over for good

    async def _release(self, sibling: tuple[str, int], env: Any = None, handle: bytes | None = None) -> None:
        if self.journal is not None:
            self.trace.flush()
            await self.journal.durable()
        error = await release(self.env, self.code, env, handle)
        self.trace.emit(LeaseReleased(group_id=sibling[0], generation=sibling[1], live=env is not None, error=error))


class _Gate:
    def __init__(self, leases: Leases, key: tuple[str, int, int]) -> None:
        self.leases, self.key = leases, key

    async def begin(self) -> None:
        while not self.leases.sched.env_step_begin(self.key):
            await self.leases.open.wait()

    def end(self) -> None:
        self.leases.sched.env_step_end(self.key)
        self.leases.wake.set()
