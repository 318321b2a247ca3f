"""What a server holds beyond its routes: the engine, the live requests, pause, aborts and
the weight version labels. Both flavors drive one `Service`; every method runs on the
event loop's thread (plain `def`s change state atomically; `async` ones are named for
what they wait on).

A request's life (`Live`):

    open -> waiting (while paused) -> running (in the engine) -> done
                                  \\-> done (aborted while waiting)

`done` is a loop-side future resolved exactly once: by the engine's result, by its
failure (InfraError), or by an abort, which resolves it at once with the tokens the loop
has seen so far and finish reason "abort", then cancels the engine's future (a queued
request never runs, a running one stops being decoded; tokens the worker produces after
that are dropped). `close(live)` in the route's `finally` aborts whatever is not done, so
a client that goes away leaves no work behind.

Weight versions: the engine counts refits (0, 1, ...); the label a client sees is
`labels[engine version]` ("default" at start). `set_label` relabels the current weights
(vLLM `/update_weight_version`); a reload makes a new engine version labelled with the
given label, or with the current one until the client sets it (vLLM reloads, then labels).
Every response carries the label of the weights that sampled its tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .body import GenParams


@dataclass(frozen=True)
class Outcome:
    """A finished request: its new tokens and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str


@dataclass(frozen=True)
class Arrival:
    """New tokens of a request, as the loop saw them arrive (a stream's chunk)."""

    token_ids: list[int]
    logprobs: list[float]
    weight_version: str  # the label of the weights that sampled them
    outcome: Outcome | None  # set on the last arrival only


@dataclass(eq=False)
class Live:
    params: GenParams
    done: asyncio.Future  # of Outcome; resolved once
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # new tokens, done, or unpaused
    tokens: list[int] = field(default_factory=list)  # seen by the loop so far
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None  # the engine version its tokens were sampled under
    engine_future: Future | None = None  # None while waiting

    @property
    def running(self) -> bool:
        return self.engine_future is not None and not self.done.done()


class Service:
    def __init__(self, engine: Any) -> None:
        self.engine = engine  # an HFEngine: submit_ids, load_weights, version, close
        self.paused = False
        self._live: set[Live] = set()
        self._labels: dict[int, str] = {engine.version: "default"}
        self._no_running = asyncio.Event()
        self._no_running.set()
        self._reloading = asyncio.Lock()
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}  # requests, by ending

    # ------------------------------------------------------------ requests

    def open(self, params: GenParams) -> Live:
        live = Live(params, asyncio.get_running_loop().create_future())
        self._live.add(live)
        return live

    async def tokens(self, live: Live) -> AsyncIterator[Arrival]:
        """The request's tokens as they arrive; the last arrival carries its outcome.
        Raises InfraError if the engine failed the request."""
        await self._until_admitted(live)
        sent = 0
        while True:
            await live.wake.wait()
            live.wake.clear()
            if live.done.done():
                out = live.done.result()
                yield Arrival(out.token_ids[sent:], out.logprobs[sent:], out.weight_version, out)
                return
            if len(live.tokens) > sent:
                n = len(live.tokens)
                yield Arrival(live.tokens[sent:n], live.logprobs[sent:n], self.label(live.version), None)
                sent = n

    async def outcome(self, live: Live) -> Outcome:
        async with contextlib.aclosing(self.tokens(live)) as arrivals:
            async for arrival in arrivals:
                if arrival.outcome is not None:
                    return arrival.outcome
        raise AssertionError("unreachable: tokens() ends with an outcome")

    def close(self, live: Live) -> None:
        """The route is done with `live` (answered, failed or gone): abort what still runs."""
        self.abort(live)
        if live in self._live:
            self._live.discard(live)
            failed = live.done.exception() is not None  # retrieved: a failure nobody read is not logged
            self.finished["error" if failed else live.done.result().finish_reason] += 1

    async def _until_admitted(self, live: Live) -> None:
        while self.paused and not live.done.done():
            live.wake.clear()
            await live.wake.wait()
        if live.done.done():
            live.wake.set()  # aborted while waiting: `tokens` reads the outcome at once
            return
        p = live.params
        loop = asyncio.get_running_loop()

        def on_token(token: int, logprob: float, version: int) -> None:  # worker thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
                loop.call_soon_threadsafe(self._push, live, token, logprob, version)

        def on_done(f: Future) -> None:  # worker thread, or here if it is done already
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._finished, live, f)

        live.engine_future = self.engine.submit_ids(
            p.ids, seed=p.seed, max_new_tokens=p.max_tokens, prompt_tokens=p.prompt_tokens,
            temperature=p.temperature, top_p=p.top_p, ignore_eos=p.ignore_eos, on_token=on_token)
        self._no_running.clear()
        live.engine_future.add_done_callback(on_done)

    def _push(self, live: Live, token: int, logprob: float, version: int) -> None:
        if live.done.done():
            return  # after an abort: not part of the answer
        live.tokens.append(token)
        live.logprobs.append(logprob)
        live.version = version
        live.wake.set()

    def _finished(self, live: Live, f: Future) -> None:
        if not live.done.done() and not f.cancelled():
            if f.exception() is not None:
                live.done.set_exception(f.exception())
            else:
                r = f.result()
                live.done.set_result(Outcome(list(r.token_ids), r.logprobs.tolist(), r.finish_reason,
                                             self.label(r.version)))
            live.wake.set()
        self._settle_running()

    def _settle_running(self) -> None:
        if not any(live.running for live in self._live):
            self._no_running.set()

    # ------------------------------------------------------------ aborts and pause

    def abort(self, live: Live) -> bool:
        """End `live` now with the tokens so far; False if it had ended already."""
        if live.done.done():
            return False
        version = live.version if live.version is not None else self.engine.version
        live.done.set_result(Outcome(list(live.tokens), list(live.logprobs), "abort", self.label(version)))
        live.wake.set()
        if live.engine_future is not None:
            live.engine_future.cancel()
        self._settle_running()
        return True

    def abort_where(self, request_ids: set[str] | None) -> int:
        """Abort the live requests with these ids (None: all); how many were aborted."""
        return sum(self.abort(live) for live in list(self._live)
                   if request_ids is None or live.params.request_id in request_ids)

    def pause(self) -> None:
        """New requests wait from now on (until `resume`)."""
        self.paused = True

    async def until_no_running(self) -> None:
        """Pause `wait`: the requests in the engine finish; the waiting ones keep waiting."""
        await self._no_running.wait()

    def resume(self) -> None:
        self.paused = False
        for live in self._live:
            live.wake.set()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        running = sum(live.running for live in self._live)
        waiting = sum(live.engine_future is None and not live.done.done() for live in self._live)
        return running, waiting

    # ------------------------------------------------------------ weights

    def label(self, version: int | None = None) -> str:
        """The label of engine version `version` (default: the current weights)."""
        v = self.engine.version if version is None else version
        return self._labels.get(v, self._labels[self.engine.version])

    def set_label(self, label: str) -> None:
        self._labels[self.engine.version] = label

    async def reloaded(self, path: str, label: str | None = None) -> None:
        """Load the HF directory `path` into the served model between batches; a reload at a
        time. Raises UserInputError (the served weights unchanged) if it does not fit."""
        async with self._reloading:
            version = self.engine.version + 1
            self._labels[version] = self.label() if label is None else label
            try:
                await self.engine.load_weights(path, version)
            except BaseException:
                del self._labels[version]
                raise

    async def generated_one(self) -> None:
        """One token from the engine, bypassing pause (SGLang `/health_generate`)."""
        await asyncio.wrap_future(self.engine.submit_ids([0], seed=0, max_new_tokens=1))

    async def close_engine(self) -> None:
        self.abort_where(None)
        await self.engine.close()
