"""The engine pool: one `Engine` for the runner over several replicas (docs/design.md §10).

The runner drives it like any engine; the decisions are the `ReplicaSet`'s, this module
only waits. An attempt goes to the READY replica with the fewest outstanding attempts
(waiting while none is READY; the scheduler's deadline still runs). New weights are
published once per version (`publish`: `ray.put`) and every READY replica refits from
that one copy. A replica whose process dies fails the attempts it ran as infra failures
(`InfraError`: the scheduler retries them, on the others, within their budgets) and is
brought back in the background: Ray restarts its process, the pool refits it to the
current weights, and only then does it get work again. While no replica is READY for
`replica_timeout_s`, `on_unavailable` is called once (the runner stops the run with a
final checkpoint, exit 5).

Custody never depends on a replica: the scheduler knows attempts, not workers, so a run
resumes on any number of replicas (elastic restore).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..core.custody.trace_schema import EngineReplicaDied, EngineReplicaStarted, RunEvent
from ..core.rollout.generation import Completion, DataError, GenRequest, InfraError
from ..engines.base import Capabilities
from .replicas import ReplicaGone, ReplicaHandle, ReplicaInfo, ReplicaLost, ReplicaSet


class ReplicaEvents:
    """What the pool traces when a replica is up or dies (`engine_replica_started` /
    `engine_replica_died`; server mode traces its servers' own events instead)."""

    def started(self, i: int, info: ReplicaInfo, restarts: int, down: float | None) -> RunEvent | None:
        return EngineReplicaStarted(replica=i, pid=info.pid, node=info.node, restart=restarts, down_seconds=down)

    def died(self, i: int, reason: str, attempts_failed: int, gone: bool) -> RunEvent:
        return EngineReplicaDied(replica=i, reason=reason, attempts_failed=attempts_failed, gone=gone)

    def not_started(self, timeout: float, alive: bool) -> str:
        """Why the pool does not open: no replica came up within `timeout` seconds."""
        return (f"no engine replica started within cluster.replica_timeout_s={timeout:g} s" if alive
                else "every engine replica failed to start")

    def unavailable(self, timeout: float, alive: bool) -> str:
        """Why the run stops when no replica was READY for `timeout` seconds."""
        return (f"no engine replica was alive for cluster.replica_timeout_s={timeout:g} s" if alive
                else "every engine replica is gone (cluster.max_restarts spent)")


class EnginePool:
    name = "pool"

    def __init__(self, handles: Sequence[ReplicaHandle], *, publish: Callable[[Any, int], Any], max_restarts: int,
                 replica_timeout_s: float, on_close: Callable[[], None] | None = None,
                 events: ReplicaEvents | None = None) -> None:
        self._handles = list(handles)
        self._publish = publish  # (weights, version) -> what every replica refits from
        self._events = events or ReplicaEvents()
        self.servers: tuple[str, ...] | None = None  # server mode: each replica's URL
        self._timeout = replica_timeout_s
        self._on_close = on_close  # e.g. disconnect from Ray
        self.replicas = ReplicaSet(len(self._handles), max_restarts=max_restarts)
        self._info: list[ReplicaInfo | None] = [None] * len(self._handles)
        self._weights: tuple[Any, int] | None = None  # (published handle, version)
        self._version = 0
        self._change = asyncio.Event()  # set when a replica changes state (waiters re-check)
        self._tasks: set[asyncio.Task] = set()
        self._watch: asyncio.Task | None = None
        self._emit: Callable[[RunEvent], None] | None = None
        self._held: list[RunEvent] = []  # events before `attach`
        self._on_unavailable: Callable[[str], None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ Engine capabilities

    def _first(self) -> ReplicaInfo:
        info = next((i for i in self._info if i is not None), None)
        if info is None:
            raise RuntimeError("engine pool: used before open()")
        return info

    @property
    def capabilities(self) -> Capabilities:
        """The replicas' engines' (all built from one recipe: the first started one's)."""
        return self._first().capabilities

    # The same, one attribute each, for readers not yet on `capabilities`.

    @property
    def streams(self) -> bool:
        return self.capabilities.streams

    @property
    def continues(self) -> bool:
        return self.capabilities.continues

    @property
    def episode_tokenizer(self) -> Any:
        return self.capabilities.episode_tokenizer

    @property
    def completion_limit(self) -> Any:
        return self.capabilities.completion_limit

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ start

    async def open(self) -> None:
        """Start every replica; return once all answered, or after `replica_timeout_s`
        once one has (the others join when they are up). Raises ReplicaGone if none can."""
        for i in range(len(self._handles)):
            self._spawn(self._bring_up(i))
        with contextlib.suppress(TimeoutError):
            await self._until(lambda: not self.replicas.pending(), self._timeout)
        if not self.replicas.live():
            raise ReplicaGone(self._events.not_started(self._timeout, self.replicas.alive()))

    def attach(self, emit: Callable[[RunEvent], None], on_unavailable: Callable[[str], None],
               trace: Any = None) -> None:
        """Where the pool's trace events go (the run's trace, once it is open), and whom to
        tell when no replica is left. Server mode: `trace`'s `sealed`/`failed` lines then
        name the server (`Trace.servers`)."""
        self._emit, self._on_unavailable = emit, on_unavailable
        if trace is not None and self.servers is not None:
            trace.servers = tuple(json.dumps(u).encode() for u in self.servers)
        for ev in self._held:
            emit(ev)
        self._held.clear()

    def _trace(self, ev: RunEvent) -> None:
        if self._emit is None:
            self._held.append(ev)
        else:
            self._emit(ev)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _bring_up(self, i: int) -> None:
        """Start (or wait for Ray to restart) replica i, refit it to the current weights
        (again if newer ones were published meanwhile), then let it take work."""
        handle = self._handles[i]
        try:
            info = await handle.start()
        except ReplicaGone as e:
            self.replicas.gone(i)
            self._trace(self._events.died(i, f"cannot start: {e}"[:500], 0, True))
            self._changed()
            return
        self._info[i] = info
        incarnation = self.replicas.started(i)
        try:
            while self._weights is not None and self.replicas.version(i) != self._weights[1]:
                published, version = self._weights
                await handle.refit(published, version)
                self.replicas.refitted(i, version)
        except ReplicaLost as e:
            self._lost(i, incarnation, str(e))
            return
        self.replicas.refitted(i, None if self._weights is None else self._weights[1])
        restarts, down = self.replicas.back(i, time.monotonic())
        ev = self._events.started(i, info, restarts, down)
        if ev is not None:
            self._trace(ev)
        self._changed()

    # ------------------------------------------------------------------ Engine

    async def generate(self, request: GenRequest, progress: Any = None) -> Completion:
        key = (request.group_id, request.generation, request.attempt)
        while (i := self.replicas.choose()) is None:
            # Wait, even with every replica gone: failing now would spend the attempt's
            # budget on nothing; the run is stopping (`on_unavailable`) and cancels it.
            await self._until(self.replicas.live)
        incarnation = self.replicas.begin(i, key)
        tokens = None
        try:
            completion = await self._handles[i].generate(request, progress)
            tokens = len(completion.completion_ids) - (0 if request.prefix is None else len(request.prefix))
        except ReplicaLost as e:
            self._lost(i, incarnation, str(e))
            raise InfraError(f"engine replica {i} died under the attempt: {e}", replica=i) from None
        except (InfraError, DataError) as e:
            e.replica = i
            tokens = -1
            raise
        finally:
            self.replicas.end(i, key, tokens)
        return dataclasses.replace(completion, replica=i)

    async def update_weights(self, weights: Any, version: int) -> None:
        """Publish `weights` once and refit every READY replica from it; a replica coming
        back meanwhile refits to them before it takes work (`_bring_up`)."""
        published = self._publish(weights, version)
        if inspect.isawaitable(published):  # (server mode writes a weight directory, off the loop)
            published = await published
        self._weights = (published, version)

        async def refit(i: int, incarnation: int) -> None:
            try:
                await self._handles[i].refit(published, version)
                self.replicas.refitted(i, version)
            except ReplicaLost as e:
                self._lost(i, incarnation, str(e))

        await asyncio.gather(*(refit(i, self.replicas.incarnation(i)) for i in self.replicas.ready()))
        self._version = version

    # ------------------------------------------------------------------ deaths

    def _lost(self, i: int, incarnation: int, reason: str) -> None:
        death = self.replicas.died(i, incarnation, time.monotonic())
        if death is None:
            return  # reported by another of its attempts
        self._trace(self._events.died(i, reason[:500], death.attempts_failed, death.gone))
        if not death.gone and not self._closed:
            self._spawn(self._bring_up(i))
        self._changed()

    def _changed(self) -> None:
        """Wake whoever waits on the replicas; watch the pool while none is READY."""
        self._change.set()
        if not self.replicas.live() and self._watch is None and not self._closed:
            self._watch = asyncio.get_running_loop().create_task(self._watchdog())

    async def _until(self, done: Callable[[], Any], timeout: float | None = None) -> None:
        """Wait until `done()` (re-checked at every change), at most `timeout` seconds."""
        async with asyncio.timeout(timeout):
            while not done():
                self._change.clear()
                await self._change.wait()

    async def _watchdog(self) -> None:
        try:
            with contextlib.suppress(TimeoutError):
                await self._until(lambda: self.replicas.live() or not self.replicas.alive(), self._timeout)
            if not self.replicas.live() and self._on_unavailable is not None:
                self._on_unavailable(self._events.unavailable(self._timeout, self.replicas.alive()))
        finally:
            self._watch = None

    # ------------------------------------------------------------------ metrics, close

    def stats(self) -> dict[str, Any]:
        """Live replicas and, per replica, the attempts it finished and the tokens it
        generated (cumulative; the runner turns them into rates)."""
        return {"live": self.replicas.live(), "replicas": len(self._handles), "per_replica": self.replicas.stats(),
                "failures": self.replicas.failures(), "servers": self.servers}

    async def close(self) -> None:
        self._closed = True
        tasks = [*self._tasks, *([self._watch] if self._watch is not None else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await asyncio.gather(*(h.close() for h in self._handles), return_exceptions=True)
        finally:
            if self._on_close is not None:
                self._on_close()
