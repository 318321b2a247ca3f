"""What a generation is asked for and what it returns, as the scheduler sees them.

A `GenRequest` names one attempt of one sibling; a `Completion` is its finished rollout.
Sampling randomness is a pure function of `GenRequest.seed` (and the weights), never of
timing or batch composition, so a regenerated rollout can reproduce the lost one. The two
exception classes are an engine's *declared* failures: only they (and the deadline, and a
lost connection) are retried; any other exception from an engine is a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import xxhash

from .source import Prompt


class InfraError(Exception):
    """The engine failed to produce a result (crash, timeout, OOM): an infra failure.
    `replica`: the engine replica it happened on (an engine pool sets it)."""

    def __init__(self, *args: object, replica: int = 0) -> None:
        super().__init__(*args)
        self.replica = replica


class DataError(Exception):
    """The environment or the reward rejected this rollout: a data failure."""

    def __init__(self, *args: object, replica: int = 0) -> None:
        super().__init__(*args)
        self.replica = replica


def sampling_seed(run_seed: int, group_id: str, generation: int, data_retries: int) -> int:
    """docs/design.md §2: a function of (run seed, group id, generation index, data-retry count).

    An infra retry reuses the seed (it should reproduce the lost rollout); a data retry
    changes it (the same sample would fail the same way)."""
    return xxhash.xxh3_64_intdigest(f"{run_seed}/{group_id}/{generation}/{data_retries}".encode())


@dataclass(frozen=True)
class Tokens:
    """Generated tokens, in order: their ids, behaviour log-probabilities and the weight
    version each was generated under. A `Chunk` is the tokens a streaming engine reports as
    it goes; a `Prefix` the tokens an attempt resumes from (docs/design.md §5.3)."""

    completion_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    versions: np.ndarray  # int32 [n]

    def __len__(self) -> int:
        return len(self.completion_ids)

    @staticmethod
    def joined(parts: Sequence[Tokens]) -> Tokens:
        """The parts' tokens one after the other (a single part is returned as it is)."""
        if len(parts) == 1:
            return parts[0]
        return Tokens(*(np.concatenate([getattr(p, f) for p in parts]) for f in TOKEN_FIELDS))


TOKEN_FIELDS = ("completion_ids", "logprobs", "versions")
Chunk = Tokens
Prefix = Tokens


class GenRequest(msgspec.Struct, frozen=True):
    """What an engine is asked for one attempt of one sibling. Immutable; a msgspec Struct
    rather than a frozen dataclass because one is built per dispatched sibling on the
    scheduler's hot path (≈ 0.3 µs against ≈ 3 µs); `msgspec.structs.replace` copies one
    with fields changed."""

    group_id: str
    generation: int
    attempt: int
    prompt: Prompt
    seed: int
    pinned_version: int | None  # deterministic mode: generate under exactly this weight version
    infra_retries: int = 0  # failures so far of this sibling, for engines that inject them
    data_retries: int = 0
    # The tokens an earlier attempt of this sibling generated before it was cut off (a
    # restart, a graceful stop, an infra failure), to continue from rather than start over:
    # the engine feeds them as token ids after the prompt and samples the next token at
    # position len(prefix) (`recovery.partial: resume`, docs/design.md §5.3).
    prefix: Prefix | None = None
    # A multi-turn episode continued after its finished turns (docs/design.md §5.4): the
    # offsets of `prefix` where each finished turn ends (its environment response included),
    # and the environment's snapshot after the last one (environments recovering by
    # snapshot). The attempt generates turn len(turns).
    turns: tuple[int, ...] = ()
    snapshot: bytes | None = None
    # This call stops once the completion (prefix included) is this long, if that comes
    # before the engine's own limit: an episode's cap on one turn (`env.max_turn_tokens`).
    max_tokens: int | None = None


@dataclass(frozen=True)
class Completion:
    prompt_ids: np.ndarray  # int32 [P]
    completion_ids: np.ndarray  # int32 [C]
    logprobs: np.ndarray  # float32 [C]: behaviour log-probabilities
    versions: np.ndarray  # int32 [C]: weight version of each token
    finish_reason: str  # "stop" | "length"
    text: str  # decoded completion, for the reward function
    replica: int = 0  # the engine replica that generated it (an engine pool sets it)
