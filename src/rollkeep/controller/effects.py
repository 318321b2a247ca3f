"""Calls to the outside, the runner's part (docs/design.md §13): it only waits.

`rollkeep.effects.call` inside an attempt's user code (its reward function, its
environment) lands in that attempt's `AttemptEffects`, which asks the scheduler what the
call does (`Scheduler.on_effect`: every decision is the core's), and carries it out:

    Answer    the recorded outcome is returned (or raised, for an error): nothing is called
    Call      a new call: its `effect_intent` was applied; the trace is flushed (which
              releases the record to the journal) and the journal's next fsync awaited, then
              `fn(request, key)` runs (awaited if async, else on a worker thread), within the
              deadline of the user code around it; its outcome is applied as `effect_done`
              and the journal's next cycle kicked (not awaited: a kill before that fsync
              leaves the intent without outcome, which `on_unknown` resolves)
    Call again  the same, without a new intent: the recorded key is sent again (`retry`)
    Unknown   the attempt fails as data (`effect_unknown`); the attempt is marked, so user
              code that catches the error cannot turn the failure into a reward
    None      the attempt is no longer in flight (cancelled, abandoned): marked likewise,
              nothing recorded or called

`Effects` is the run's: the scopes, and the latency each record adds (the wait for the
intent's fsync) against the call's own, for the metrics.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from ..core.custody.trace_schema import EffectAnswered
from ..core.rollout.effects import REWARD_TURN, Answer, Call, Unknown
from ..core.rollout.generation import DataError
from ..core.schedule.commands import AttemptKey
from ..effects import EffectFailed
from .usercode import Overdue, UserCode

__all__ = ["AttemptEffects", "Effects", "run_key"]

_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode
_MAX_ERROR = 2000  # characters of an error kept in its record


def run_key(run_dir: Path, seed: int) -> str:
    """What tells this run's idempotency keys from another's: the same in every process of
    the run (its directory and seed), so a resumed run's keys are its own."""
    return xxhash.xxh3_64_hexdigest(f"{Path(run_dir).resolve()}\0{seed}".encode())[:12]


class Effects:
    """The run's calls to the outside: `scope(key)` for each attempt's user code."""

    def __init__(self, sched: Any, *, run: str, code: UserCode, max_result_bytes: int, journal: Any = None,
                 flush: Callable[[], None] = lambda: None, emit: Callable[[Any], None] = lambda ev: None) -> None:
        self.sched, self.run, self.code, self.journal, self.emit = sched, run, code, journal, emit
        self.max_result_bytes = max_result_bytes
        self.flush = flush  # the trace's flush, which releases staged journal records
        self.record_seconds: deque[float] = deque(maxlen=1 << 14)  # intent durable: what a record adds
        self.call_seconds: deque[float] = deque(maxlen=1 << 14)  # the call itself
        self.made = self.answered = self.resent = 0

    def scope(self, key: AttemptKey, *, timeout: float) -> AttemptEffects:
        return AttemptEffects(self, key, timeout)

    def stats(self) -> dict[str, float]:
        """Metrics: calls made, answered from the record and sent again; the p50 / p99
        seconds a record adds to a call and of the calls themselves."""
        if not (self.made or self.answered or self.resent):
            return {}
        out: dict[str, float] = {"effects/made": self.made, "effects/answered": self.answered,
                                 "effects/resent": self.resent}
        for name, xs in (("record", self.record_seconds), ("call", self.call_seconds)):
            s = sorted(xs)
            if s:
                out[f"effects/{name}_p50_s"] = s[len(s) // 2]
                out[f"effects/{name}_p99_s"] = s[min(len(s) - 1, int(0.99 * len(s)))]
        return out


class AttemptEffects:
    """The calls of one attempt (the `rollkeep.effects.Scope` its user code runs under).
    `at(turn)` says which turn the calls that follow belong to (the reward stage: -1)."""

    def __init__(self, run: Effects, key: AttemptKey, timeout: float) -> None:
        self.run, self.key, self.timeout = run, key, timeout
        self.loop = asyncio.get_running_loop()
        self.failed: str | None = None  # set: the attempt fails as data whatever its code returns
        self._turn, self._next = REWARD_TURN, 0

    def at(self, turn: int, timeout: float | None = None) -> None:
        """The calls that follow are of `turn`, each within `timeout` (that of the user code
        making them: `reward.timeout_s`, `env.timeout_s`)."""
        if turn != self._turn:
            self._turn, self._next = turn, 0
        if timeout is not None:
            self.timeout = timeout

    async def call(self, kind: str, request: Any, body: bytes, fn: Callable[..., Any], policy: str) -> Any:
        run, index = self.run, self._next
        self._next += 1
        decision = run.sched.on_effect(self.key, turn=self._turn, index=index, kind=kind,
                                       digest=xxhash.xxh3_64_intdigest(body), policy=policy, run=run.run)
        if decision is None or isinstance(decision, Unknown):
            self.failed = ("the attempt is no longer in flight" if decision is None else
                           f"effect_unknown: the outcome of {decision.kind} call {decision.key} was lost with a "
                           "process (on_unknown=fail)")
            raise DataError(self.failed)
        gid, g, attempt = self.key
        if isinstance(decision, Answer):
            run.answered += 1
            run.emit(EffectAnswered(group_id=gid, generation=g, attempt=attempt, kind=kind, key=decision.key))
            return _outcome(kind, decision.key, decision.ok, decision.result)
        assert isinstance(decision, Call)
        t0 = time.perf_counter()
        if run.journal is not None and not decision.again:
            run.flush()  # the trace first (the journal is never ahead of it): releases the intent
            await run.journal.durable()
        t1 = time.perf_counter()
        ok, result = await self._make(kind, request, fn, decision.key)
        run.record_seconds.append(t1 - t0)
        run.call_seconds.append(time.perf_counter() - t1)
        if decision.again:
            run.resent += 1
            run.emit(EffectAnswered(group_id=gid, generation=g, attempt=attempt, kind=kind, key=decision.key,
                                    resent=True))
        else:
            run.made += 1
        if not run.sched.on_effect_done(self.key, decision.key, ok, result):
            self.failed = "the attempt is no longer in flight"
            raise DataError(self.failed)
        if run.journal is not None:  # the outcome durable soon (not waited for): a kill before it means a resend
            run.flush()
            run.journal.kick()
        return _outcome(kind, decision.key, ok, result)

    async def _make(self, kind: str, request: Any, fn: Callable[..., Any], key: str) -> tuple[bool, bytes]:
        """(ok, the result's JSON or the error's text): `fn(request, key)` within the deadline."""
        try:
            if inspect.iscoroutinefunction(fn):
                async with asyncio.timeout(self.timeout):
                    value = await fn(request, key)
            else:
                value = await self.run.code.call(f"{kind} call", self.timeout, fn, request, key)
                if inspect.isawaitable(value):
                    async with asyncio.timeout(self.timeout):
                        value = await value
        except (TimeoutError, Overdue):
            return False, f"{kind} call took longer than {self.timeout:g} s".encode()
        except Exception as e:  # the call's failure is its outcome
            return False, f"{type(e).__name__}: {e}"[:_MAX_ERROR].encode()
        try:
            data = _encode(value)
        except (TypeError, msgspec.EncodeError) as e:
            return False, f"the result is not JSON-serialisable: {e}"[:_MAX_ERROR].encode()
        if len(data) > self.run.max_result_bytes:
            return False, (f"a result of {len(data)} bytes, over effects.max_result_bytes="
                           f"{self.run.max_result_bytes}").encode()
        return True, data


def _outcome(kind: str, key: str, ok: bool, result: bytes) -> Any:
    if not ok:
        raise EffectFailed(kind, key, result.decode("utf-8", "replace"))
    return _decode(result)
