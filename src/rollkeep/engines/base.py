"""The engine interface: what the rollout pump asks of a generation backend.

An engine generates one sibling per `generate` call; backends batch concurrent calls
themselves. Cancelling the awaiting task aborts the request. Sampling randomness must be
a pure function of `GenRequest.seed` (and the weights), never of timing or batch
composition, so a regenerated rollout can reproduce the lost one (docs/design.md §2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.rollout.generation import (
    Chunk,
    Completion,
    DataError,
    GenRequest,
    InfraError,
    Prefix,
    sampling_seed,
)

__all__ = ["Capabilities", "Chunk", "Completion", "CompletionLimit", "DataError", "Engine", "EpisodeTokenizer", "GenRequest",
           "InfraError", "Prefix", "Progress", "capabilities_of", "sampling_seed"]

#: Called by a streaming engine with each chunk of new tokens, on the event loop's thread.
Progress = Callable[[Chunk], None]


class Engine(Protocol):
    """Optional capabilities, as one value: `capabilities`, a `Capabilities` (`streams`:
    reports chunks to `progress`; `continues`: continues `request.prefix`, multi-turn
    episodes need it; for episodes `episode_tokenizer`, `encode(text, bos=False) -> ids`
    and `decode(ids) -> text`, and `completion_limit(prompt_tokens)`, the longest
    completion after such a prompt). Every built-in engine has it. An engine without it
    may give the same four as attributes of those names, as engines did before
    `capabilities`; read them with `capabilities_of(engine)`, which accepts both."""

    name: str

    @property
    def version(self) -> int:
        """The weight version generation currently runs under."""
        ...

    async def generate(self, request: GenRequest, progress: Progress | None = None) -> Completion:
        """One sibling. Raises InfraError or DataError; cancel the task to abort.

        Streaming (an engine whose `streams` attribute is true): `progress(chunk)` is
        called on the event loop's thread with every new token, in order, as it is
        generated (never for the prefix's tokens). With `request.prefix`, the engine
        continues from it: the returned completion is the prefix's tokens, log-probs and
        versions exactly as given, then the new ones; the token at completion position i
        is sampled from (seed, i), so a continued prefix under the same weights gives the
        completion an uninterrupted generation would. A prefix that already ends the
        completion (its last token is EOS, or it is `max_new_tokens` long, or
        `request.max_tokens`, a turn's cap) is returned as is; no completion outgrows
        `request.max_tokens`. An engine that does not stream ignores `progress` and reports only at the
        end; one that cannot continue from a prefix is not given one."""
        ...

    async def update_weights(self, weights: Any, version: int) -> None:
        """Load new weights. In fast mode engines may apply them between decoding steps."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class CompletionLimit:
    """An engine's `completion_limit`: the longest completion (prefix included) after a
    prompt of `prompt_tokens`, its `max_new_tokens` within the model's context. A value,
    not a method, so an engine pool can hold its replicas' without asking them per call."""

    max_new_tokens: int
    context: int | None  # the model's context length, prompt included; None = unbounded

    def __call__(self, prompt_tokens: int) -> int:
        room = self.max_new_tokens if self.context is None else self.context - prompt_tokens
        return max(0, min(self.max_new_tokens, room))


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond `generate` (see `Engine`). The defaults are an engine
    that reports only at the end, is never given a prefix, and runs no episodes."""

    streams: bool = False  # `generate` reports each new token to `progress`
    continues: bool = False  # `generate` continues `request.prefix`
    episode_tokenizer: Any = None  # `encode(text, bos=False) -> ids`, `decode(ids) -> text`
    completion_limit: Callable[[int], int] | None = None  # a `CompletionLimit`; None: no budget


def capabilities_of(engine: Any) -> Capabilities:
    """`engine.capabilities` if it is a `Capabilities`; else, for an engine written before
    it, one built from its attributes `streams`, `continues`, `episode_tokenizer` and
    `completion_limit` (each absent one takes the default)."""
    caps = getattr(engine, "capabilities", None)
    if isinstance(caps, Capabilities):
        return caps
    return Capabilities(
        streams=bool(getattr(engine, "streams", False)),
        continues=bool(getattr(engine, "continues", False)),
        episode_tokenizer=getattr(engine, "episode_tokenizer", None),
        completion_limit=getattr(engine, "completion_limit", None),
    )


class EpisodeTokenizer:
    """A transformers tokenizer as multi-turn episodes use it: an environment's response is
    encoded without special tokens, a turn decoded without them. (`data.chat_template`
    renders responses as chat turns instead: `models.chat.chat_episodes(this)`.)"""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    @property
    def tok(self) -> Any:
        """The transformers tokenizer."""
        return self._tok

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=bos))

    def decode(self, ids: Any) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
