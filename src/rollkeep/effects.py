"""Exactly-once effects outside the process (docs/effects.md, docs/design.md §13).

A reward function, an environment or a tool that calls out of the run (an LLM judge over
HTTP, a code sandbox, a tool with a side effect) makes the call through rollkeep:

    result = await rollkeep.effects.call("judge", request, fn, on_unknown="retry")
    result = rollkeep.effects.call_sync("sandbox", request, fn)     # from synchronous code

`request` is JSON-serialisable; `fn(request, key)` makes the call (sync or async) and returns
a JSON-serialisable result; `key` is the call's idempotency key, deterministic in (run,
group, sibling, attempt, turn, call index), for the service to de-duplicate on. Before
`fn` runs, an *intent* is made durable in the run's journal; after it, the *outcome* (the
result, or the error `fn` raised). A recorded outcome is authoritative: after a kill, the
resumed run's call at the same place (same sibling's work, same turn and call index, same
kind and request) is answered from the record and `fn` is not called again. An intent whose
outcome was lost with the process is resolved by `on_unknown`:

    retry   `fn` is called again with the same key (services that de-duplicate by key, pure calls)
    fail    the attempt fails as data (`effect_unknown`): nothing is trained on it, and the
            sibling's next attempt makes new calls with new keys

The caller gets the result as JSON decodes it (a tuple comes back a list), the same whether
it was called or answered from the record; an outcome that was an error raises
`EffectFailed` (from the record too). A result whose JSON is over `effects.max_result_bytes`
is recorded as an error. Outside a rollkeep attempt (a unit test of the reward function)
`fn` is simply called, with key "unrecorded", and nothing is recorded.

Exactly once needs the journal (`journal.enabled`, the default): without it an intent is
durable only at the next checkpoint, and a kill before it may call again (at least once).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from .core.rollout.effects import FAIL, MAX_KIND, POLICIES, RETRY

__all__ = ["FAIL", "POLICIES", "RETRY", "EffectFailed", "call", "call_sync", "canonical"]

UNRECORDED = "unrecorded"


class EffectFailed(Exception):
    """The call's recorded outcome is an error (`fn` raised, or its result was refused)."""

    def __init__(self, kind: str, key: str, error: str) -> None:
        super().__init__(f"{kind} call {key}: {error}")
        self.kind, self.key, self.error = kind, key, error


class Scope(Protocol):
    """Where the calls of the running attempt are recorded (`controller.effects.AttemptEffects`)."""

    loop: asyncio.AbstractEventLoop

    async def call(self, kind: str, request: Any, body: bytes, fn: Callable[..., Any], policy: str) -> Any: ...


_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("rollkeep_effects_scope", default=None)
_json = msgspec.json.Encoder(order="sorted")


def canonical(request: Any) -> bytes:
    """The request's canonical JSON (keys sorted): what its digest is of."""
    try:
        return _json.encode(request)
    except (TypeError, msgspec.EncodeError) as e:
        raise TypeError(f"an effect's request must be JSON-serialisable: {e}") from None


def _checked(kind: str, on_unknown: str) -> None:
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        raise ValueError(f"an effect's kind must be a name of 1 to {MAX_KIND} characters, not {kind!r}")
    if on_unknown not in POLICIES:
        raise ValueError(f"on_unknown must be one of {', '.join(POLICIES)}, not {on_unknown!r}")


async def call(kind: str, request: Any, fn: Callable[[Any, str], Any | Awaitable[Any]], *,
               on_unknown: str = RETRY) -> Any:
    """Make (or answer from the record) one call to the outside; see the module docstring."""
    _checked(kind, on_unknown)
    body = canonical(request)
    scope = _scope.get()
    if scope is None:
        out = fn(request, UNRECORDED)
        return await out if inspect.isawaitable(out) else out
    return await scope.call(kind, request, body, fn, on_unknown)


def call_sync(kind: str, request: Any, fn: Callable[[Any, str], Any], *, on_unknown: str = RETRY) -> Any:
    """`call` from synchronous code (an environment's `step`, a synchronous reward
    function), which rollkeep runs on its worker threads: blocks until the call is done.
    `fn` should then be synchronous too (it runs on a worker thread of its own)."""
    _checked(kind, on_unknown)
    body = canonical(request)
    scope = _scope.get()
    if scope is None:
        return fn(request, UNRECORDED)
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is scope.loop:
        raise RuntimeError("effects.call_sync was called on the run's event loop: use `await effects.call(...)`")
    return asyncio.run_coroutine_threadsafe(scope.call(kind, request, body, fn, on_unknown), scope.loop).result()


def bind(scope: Scope | None) -> contextvars.Token:
    """Make `scope` the current one (the runner, around an attempt's user code)."""
    return _scope.set(scope)
