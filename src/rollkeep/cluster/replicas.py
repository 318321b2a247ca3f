"""Engine replicas: which can take work, and which one gets the next attempt (sans-IO).

A replica's life is an explicit state machine; `_NEXT` gives the next state, and a
transition it lacks is a bug (RuntimeError):

    STARTING  --started-->   REFITTING   its process answers (first start, or Ray restarted it)
    REFITTING --refitted-->  READY       it holds the current weights: it gets work
    READY / REFITTING / STARTING --died--> STARTING   Ray restarts it (cluster.max_restarts)
                                 --gone--> GONE       its restarts are spent, or it cannot start

Only READY replicas get attempts: the one with the fewest outstanding, the lowest index
on a tie. A replica restarted by Ray comes back with its engine's initial weights, so it
is refit before it is READY (a restarted worker generating with stale weights is a known
bug of other systems). Each start of a replica is an incarnation: the several attempts of
one that fail together report its death once.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.rollout.generation import Completion, GenRequest
from ..engines.base import Capabilities


class ReplicaLost(Exception):
    """The replica's process died under a call (killed, crashed, its node lost)."""


class ReplicaGone(Exception):
    """The replica cannot be (re)started: its restarts are spent or its engine fails to build."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica says of itself (`ReplicaHandle.start`)."""

    pid: int
    node: str
    streams: bool = False
    continues: bool = False
    episode_tokenizer: Any = None
    completion_limit: Any = None  # `engines.base.CompletionLimit`, or None

    @property
    def capabilities(self) -> Capabilities:
        """The replica's engine's `Capabilities`."""
        return Capabilities(streams=self.streams, continues=self.continues,
                            episode_tokenizer=self.episode_tokenizer, completion_limit=self.completion_limit)


class ReplicaHandle(Protocol):
    """One replica as the pool drives it; a backend (Ray) implements it."""

    async def start(self) -> ReplicaInfo:
        """Wait until the replica answers (created or restarted). Raises ReplicaGone."""
        ...

    async def generate(self, request: GenRequest, progress: Any) -> Completion:
        """As `Engine.generate`; raises ReplicaLost when the process dies under it."""
        ...

    async def refit(self, weights: Any, version: int) -> None:
        """Load the published `weights` (the pool's handle of them) as `version`."""
        ...

    async def close(self) -> None: ...


class State(enum.StrEnum):
    STARTING = "starting"
    REFITTING = "refitting"
    READY = "ready"
    GONE = "gone"


_NEXT: dict[tuple[State, str], State] = {
    (State.STARTING, "started"): State.REFITTING,
    (State.REFITTING, "refitted"): State.READY,
    (State.STARTING, "died"): State.STARTING,
    (State.REFITTING, "died"): State.STARTING,
    (State.READY, "died"): State.STARTING,
    (State.STARTING, "gone"): State.GONE,
    (State.REFITTING, "gone"): State.GONE,
    (State.READY, "gone"): State.GONE,
}


@dataclass
class _Replica:
    state: State = State.STARTING
    incarnation: int = 0  # starts so far: an attempt remembers the one it ran on
    deaths: int = 0
    died_at: float | None = None
    version: int | None = None  # the weights it holds (None: its engine's initial ones)
    outstanding: set[Hashable] = field(default_factory=set)
    attempts: int = 0  # attempts it finished (sealed or failed by the engine)
    tokens: int = 0  # tokens it generated
    failures: int = 0  # attempts that failed on it (its engine's errors, its deaths)


@dataclass(frozen=True)
class Death:
    """What a replica's death failed: reported once per incarnation."""

    replica: int
    attempts_failed: int
    gone: bool  # its restarts are spent: it does not come back


class ReplicaSet:
    def __init__(self, n: int, *, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self._r = [_Replica() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._r)

    def state(self, i: int) -> State:
        return self._r[i].state

    def _go(self, i: int, event: str) -> None:
        r = self._r[i]
        nxt = _NEXT.get((r.state, event))
        if nxt is None:
            raise RuntimeError(f"engine replica {i}: no transition {event!r} from {r.state.value}")
        r.state = nxt

    # ------------------------------------------------------------------ lifecycle

    def started(self, i: int) -> int:
        """Replica i answers, holding its engine's initial weights (which are not the
        trainer's of any version: after a warm start not even of version 0); returns its
        incarnation."""
        self._go(i, "started")
        r = self._r[i]
        r.incarnation += 1
        r.version = None
        return r.incarnation

    def refitted(self, i: int, version: int | None) -> None:
        """Replica i loaded `version` (None: nothing was published yet); the first refit
        after a start makes it READY."""
        r = self._r[i]
        r.version = version
        if r.state is State.REFITTING:
            self._go(i, "refitted")

    def version(self, i: int) -> int | None:
        return self._r[i].version

    def died(self, i: int, incarnation: int, now: float) -> Death | None:
        """Replica i's process died under a call made on `incarnation`; None if that death
        was reported already (its other attempts fail with it) or it is gone."""
        r = self._r[i]
        if r.incarnation != incarnation or r.state not in (State.READY, State.REFITTING):
            return None  # (STARTING: this incarnation's death is recorded, or it never started)
        r.deaths += 1
        if r.died_at is None:  # (a death while coming back keeps the first one's time)
            r.died_at = now
        failed = len(r.outstanding)
        gone = r.deaths > self.max_restarts
        self._go(i, "gone" if gone else "died")
        return Death(i, failed, gone)

    def gone(self, i: int) -> None:
        """Replica i cannot be started (again)."""
        if self._r[i].state is not State.GONE:
            self._go(i, "gone")

    def back(self, i: int, now: float) -> tuple[int, float | None]:
        """Replica i is READY again: (restarts so far, seconds since its death or None)."""
        r = self._r[i]
        down = None if r.died_at is None else now - r.died_at
        r.died_at = None
        return r.deaths, down

    # ------------------------------------------------------------------ routing

    def choose(self) -> int | None:
        """The READY replica with the fewest outstanding attempts (lowest index on a tie)."""
        best = None
        for i, r in enumerate(self._r):
            if r.state is State.READY and (best is None or len(r.outstanding) < len(self._r[best].outstanding)):
                best = i
        return best

    def begin(self, i: int, key: Hashable) -> int:
        """An attempt goes to replica i; returns the incarnation it runs on."""
        self._r[i].outstanding.add(key)
        return self._r[i].incarnation

    def end(self, i: int, key: Hashable, tokens: int | None) -> None:
        """The attempt left replica i; `tokens` it generated, None if it died there, -1 if
        its engine failed it."""
        r = self._r[i]
        r.outstanding.discard(key)
        if tokens is None or tokens < 0:
            r.failures += 1
        if tokens is not None and tokens >= 0:
            r.attempts += 1
            r.tokens += tokens

    def incarnation(self, i: int) -> int:
        return self._r[i].incarnation

    def live(self) -> int:
        return sum(r.state is State.READY for r in self._r)

    def pending(self) -> int:
        """Replicas on their way up: starting, restarting or being refit."""
        return sum(r.state in (State.STARTING, State.REFITTING) for r in self._r)

    def alive(self) -> bool:
        """Some replica is not gone (it may still come back)."""
        return any(r.state is not State.GONE for r in self._r)

    def ready(self) -> list[int]:
        return [i for i, r in enumerate(self._r) if r.state is State.READY]

    def stats(self) -> list[tuple[int, int]]:
        """(attempts, tokens) per replica, cumulative."""
        return [(r.attempts, r.tokens) for r in self._r]

    def failures(self) -> list[int]:
        """Attempts that failed per replica, cumulative."""
        return [r.failures for r in self._r]
