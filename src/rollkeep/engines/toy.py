"""The toy engine: deterministic fake generation for testing and benchmarking the
control plane. Completions, latencies and injected failures are pure functions of the
request's seed, so kills land while many groups are in every state and a regenerated
rollout reproduces the lost one exactly.

A multi-turn episode's trajectory (its turns and the environment's responses) has a budget
like a real engine's `max_new_tokens`: `TRAJECTORY_TOKENS` (or `engine.completion_tokens`
if that is more, so a single-turn completion is never cut), as `completion_limit`."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import xxhash

from .base import (
    Capabilities,
    Chunk,
    Completion,
    CompletionLimit,
    DataError,
    GenRequest,
    InfraError,
    Progress,
)

VOCAB = 10  # digits: a completion's text is its token ids, so rewards can parse numbers
# Token ids past the digits, for multi-turn episodes: the tool protocol of the built-in
# `calc` environment (`CALC(<digits>)`, answered "=<value>;").
_SYMBOLS = "CAL()+-*=;?"
# The trajectory budget of an episode, environment tokens included (one token a character):
# far more than any toy episode of the tests and configs, so only an environment that
# answers at length reaches it.
TRAJECTORY_TOKENS = 4096


class ToyTokenizer:
    """Token id = digit for 0-9 (a single-turn completion's text is its ids), then the
    symbols; any other character encodes as "?". No BOS or EOS: the toy engine ends a
    turn by length."""

    chars = "0123456789" + _SYMBOLS

    def __init__(self) -> None:
        self._to_id = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        unknown = self._to_id["?"]
        return [self._to_id.get(c, unknown) for c in text]

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[int(i)] for i in ids if 0 <= int(i) < len(self.chars))


TOKENIZER = ToyTokenizer()
_CALL_OPEN, _CALL_CLOSE = np.array(TOKENIZER.encode("CALC("), np.int32), np.array(TOKENIZER.encode(")"), np.int32)


def _unit(*parts: object) -> float:
    """A uniform number in [0, 1) from the parts, stable across processes."""
    return xxhash.xxh3_64_intdigest("/".join(map(str, parts)).encode()) / 2.0**64


def _sample(seed: int, max_tokens: int) -> tuple[int, np.ndarray, np.ndarray]:
    """A completion as a pure function of the seed: length, digit tokens, log-probs.
    (xxhash rather than a numpy Generator: seeding one costs more than the whole sample.)"""
    need = 1 + 2 * max_tokens
    raw = b"".join(xxhash.xxh3_128_digest(f"{seed}/{i}".encode()) for i in range(-(-need // 16)))
    n = 1 + raw[0] % max_tokens
    ids = (np.frombuffer(raw, np.uint8, n, 1) % VOCAB).astype(np.int32)
    logprobs = (np.frombuffer(raw, np.uint8, n, 1 + max_tokens) / -256.0).astype(np.float32)
    return n, ids, logprobs


class ToyEngine:
    """In a multi-turn episode (`GenRequest.turns`), each of the first `tool_turns` turns is
    a tool call `CALC(<digits>)` and the next one the answer, every turn a pure function
    of (seed, turn) continued token by token like a single-turn completion."""

    name = "toy"
    streams = True  # one chunk per token, each `token_ms` after the previous (none if token_ms is 0)
    continues = True
    episode_tokenizer = TOKENIZER

    def __init__(
        self,
        *,
        latency_ms: float = 0.0,
        latency_jitter_ms: float = 0.0,
        infra_fail_rate: float = 0.0,
        data_fail_rate: float = 0.0,
        completion_tokens: int = 8,
        hang_rate: float = 0.0,
        token_ms: float = 0.0,
        tool_turns: int = 0,
        max_concurrent: int = 0,
    ) -> None:
        self.latency_ms = latency_ms
        self.latency_jitter_ms = latency_jitter_ms
        self.infra_fail_rate = infra_fail_rate
        self.data_fail_rate = data_fail_rate
        self.completion_tokens = completion_tokens
        self.hang_rate = hang_rate
        self.token_ms = token_ms
        self.tool_turns = tool_turns
        # A batch capacity: attempts past it wait their turn (made on first use, in the loop).
        self.max_concurrent = max_concurrent
        self._slots: asyncio.Semaphore | None = None
        self._version = 0
        # The trajectory's budget (no context: the toy has no model); episodes read it.
        self.completion_limit = CompletionLimit(max(TRAJECTORY_TOKENS, completion_tokens), None)
        self.capabilities = Capabilities(streams=self.streams, continues=self.continues,
                                         episode_tokenizer=self.episode_tokenizer,
                                         completion_limit=self.completion_limit)

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, req: GenRequest, progress: Progress | None = None) -> Completion:
        if not self.max_concurrent:
            return await self._generate(req, progress)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent)
        async with self._slots:
            return await self._generate(req, progress)

    async def _generate(self, req: GenRequest, progress: Progress | None) -> Completion:
        # (Each draw is made only when its rate can matter: the control-plane benchmark runs
        # this engine at zero latency and without failures.)
        delay = self.latency_ms
        if self.latency_jitter_ms:
            delay += self.latency_jitter_ms * _unit(req.seed, "latency", req.attempt)
        if delay > 0:
            await asyncio.sleep(delay / 1000.0)
        # Infra failures and hangs are keyed by the sibling's infra-retry count, not the
        # attempt number (restarts add attempts), so the same ones happen in every lineage.
        if self.hang_rate and _unit(req.seed, "hang", req.infra_retries) < self.hang_rate:
            await asyncio.Event().wait()  # never returns; the caller's deadline cancels it
        if self.infra_fail_rate and _unit(req.seed, "infra", req.infra_retries) < self.infra_fail_rate:
            raise InfraError(f"toy engine: injected infra failure ({req.group_id}/{req.generation})")
        if self.data_fail_rate and _unit(req.seed, "data") < self.data_fail_rate:
            raise DataError(f"toy engine: injected data failure ({req.group_id}/{req.generation})")
        # The completion is a function of the seed alone (of seed and turn in an episode): a
        # prefix (an earlier attempt's first k tokens, as given) is continued with tokens
        # k..n-1 of the same sample.
        turn = len(req.turns)
        start = req.turns[-1] if req.turns else 0  # where this turn begins in the prefix
        seed = req.seed if not turn else xxhash.xxh3_64_intdigest(f"{req.seed}/turn/{turn}".encode())
        n, ids, logprobs = _sample(seed, self.completion_tokens)
        if req.max_tokens is not None:  # a turn's cap (its tool call's brackets on top)
            n = max(1, min(n, req.max_tokens - start - (len(_CALL_OPEN) + 1 if turn < self.tool_turns else 0)))
            ids, logprobs = ids[:n], logprobs[:n]
        if turn < self.tool_turns:  # a tool call around the sampled digits
            ids = np.concatenate([_CALL_OPEN, ids, _CALL_CLOSE])
            logprobs = np.concatenate([np.full(len(_CALL_OPEN), -0.01, np.float32), logprobs,
                                       np.full(1, -0.01, np.float32)])
            n = len(ids)
        room = max(0, self.completion_limit.max_new_tokens - start)
        cut = n > room  # the trajectory's budget: the turn ends there (nothing is left: it generates nothing)
        if cut:
            ids, logprobs, n = ids[:room], logprobs[:room], room
        versions = np.full(n, self._version if req.pinned_version is None else req.pinned_version, np.int32)
        prefix = req.prefix
        before = 0 if prefix is None else len(prefix)
        k = min(before - start, n)
        if start or k:
            ids, logprobs, versions = (np.concatenate([p[:start + k], a[k:]]) for p, a in (
                (prefix.completion_ids, ids), (prefix.logprobs, logprobs), (prefix.versions, versions)))
        # Tokens take time only with `token_ms`; without it a generation is instant and has no
        # partial state to report (the control-plane benchmark runs it so).
        if self.token_ms > 0:
            for i in range(start + k, start + n):
                await asyncio.sleep(self.token_ms / 1000.0)
                if progress is not None:
                    progress(Chunk(ids[i : i + 1], logprobs[i : i + 1], versions[i : i + 1]))
        prompt_ids = np.frombuffer(req.prompt.prompt.encode(), dtype=np.uint8).astype(np.int32)
        return Completion(
            prompt_ids=prompt_ids,
            completion_ids=ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason="stop" if n < self.completion_tokens and not cut else "length",
            text=TOKENIZER.decode(ids),
        )

    async def update_weights(self, weights: Any, version: int) -> None:
        self._version = version

    async def close(self) -> None:
        pass
