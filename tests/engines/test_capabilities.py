"""`Capabilities`: one value for what an engine can do, and `capabilities_of` for engines
written before it (their `streams` / `continues` / ... attributes keep working)."""

from __future__ import annotations

import dataclasses

import pytest

from rollkeep.cluster.pool import EnginePool
from rollkeep.cluster.replicas import ReplicaInfo
from rollkeep.engines.base import Capabilities, CompletionLimit, capabilities_of
from rollkeep.engines.toy import ToyEngine


def test_defaults_are_the_plainest_engine_and_the_value_is_frozen():
    caps = Capabilities()
    assert (caps.streams, caps.continues, caps.episode_tokenizer, caps.completion_limit) == (False, False, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.streams = True  # type: ignore[misc]


def test_the_toy_engine_gives_its_capabilities_as_one_value():
    engine = ToyEngine()
    caps = capabilities_of(engine)
    assert caps is engine.capabilities
    assert caps.streams and caps.continues
    assert caps.episode_tokenizer is engine.episode_tokenizer
    assert caps.completion_limit == engine.completion_limit
    assert isinstance(caps.completion_limit, CompletionLimit)


def test_an_engine_without_capabilities_is_read_from_its_old_attributes():
    class Old:  # a user's engine from before `capabilities`
        name = "old"
        streams = 1  # truthy, not a bool: read as one
        continues = True
        episode_tokenizer = object()

        def completion_limit(self, prompt_tokens: int) -> int:
            return 10 - prompt_tokens

    old = Old()
    caps = capabilities_of(old)
    assert caps.streams is True and caps.continues is True
    assert caps.episode_tokenizer is Old.episode_tokenizer
    assert caps.completion_limit(3) == 7

    class Bare:  # nothing optional at all
        name = "bare"

    assert capabilities_of(Bare()) == Capabilities()


def test_a_capabilities_attribute_of_another_type_is_not_trusted():
    class Odd:
        capabilities = ("streams",)  # not a Capabilities: fall back to the attributes
        continues = True

    assert capabilities_of(Odd()) == Capabilities(continues=True)


def test_the_engine_pool_gives_its_replicas_capabilities():
    limit = CompletionLimit(8, None)
    info = ReplicaInfo(pid=1, node="n", streams=True, continues=True, completion_limit=limit)
    assert info.capabilities == Capabilities(streams=True, continues=True, completion_limit=limit)
    pool = EnginePool([], publish=lambda w, v: w, max_restarts=0, replica_timeout_s=1.0)
    pool._info = [None, info]  # as after open(): the first started replica speaks for all
    assert capabilities_of(pool) == info.capabilities
    assert (pool.streams, pool.continues, pool.completion_limit) == (True, True, limit)  # the old attributes
