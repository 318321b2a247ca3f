"""The runner's episode loop (controller/episodes.py) on its own: the trajectory it builds,
the turns it reports, and an episode continued after its finished turns ending exactly as
one never interrupted (replay and snapshot environments)."""

from __future__ import annotations

import asyncio
import dataclasses

import episode_envs
import numpy as np
import pytest

from rollkeep.controller.episodes import run_episode
from rollkeep.controller.usercode import UserCode
from rollkeep.core.rollout.generation import DataError, GenRequest, Tokens
from rollkeep.core.rollout.source import Prompt
from rollkeep.engines.base import CompletionLimit
from rollkeep.engines.toy import TOKENIZER, ToyEngine
from rollkeep.envs import ENV_VERSION, EnvSpec
from rollkeep.envs.calc import CalcEnv

ROW = {"prompt": "37*48=", "answer": "1776", "task": "calc"}


def spec(factory, recovery="replay", turns=3, **kw) -> EnvSpec:
    return EnvSpec(factory, recovery, turns, kw.get("timeout_s", 5.0), kw.get("max_snapshot_bytes", 1024), "test")


def request(**kw) -> GenRequest:
    prompt = Prompt(key=(0, 0), group_id="e0.0", idx=0, task="calc", row=ROW, row_fingerprint=0, prompt=ROW["prompt"])
    return GenRequest(group_id="e0.0", generation=1, attempt=0, prompt=prompt, seed=1234, pinned_version=None, **kw)


def episode(env: EnvSpec, req: GenRequest, engine=None):
    turns: list[tuple[Tokens, int, bytes | None]] = []
    engine = engine or ToyEngine(tool_turns=env.max_turns - 1)
    code = UserCode()
    try:
        completion, reward = asyncio.run(run_episode(engine, env, req, None, lambda t, k, s: turns.append((t, k, s)),
                                                     code=code))
    finally:
        code.close()
    return completion, reward, turns


def test_a_tool_use_episode_is_model_turns_and_masked_environment_answers() -> None:
    c, reward, turns = episode(spec(CalcEnv), request())
    assert [k for _, k, _ in turns] == [0, 1]
    text = TOKENIZER.decode(c.completion_ids)
    assert text.count("CALC(") == 2 and text.count(";") == 2, text  # two calls, two answers, the answer
    env = c.versions == ENV_VERSION
    assert TOKENIZER.decode(c.completion_ids[env]).startswith("=") and (c.logprobs[env] == 0).all()
    assert (c.versions[~env] >= 0).all() and c.finish_reason == "stop"  # the answer turn ends it
    # Each reported turn is the trajectory so far, ending with the environment's answer.
    for traj, _, _ in turns:
        assert traj.versions[-1] == ENV_VERSION
        assert np.array_equal(traj.completion_ids, c.completion_ids[: len(traj)])
    assert reward == 0.0  # the toy's answer is digits of its seed, not the product


@pytest.mark.parametrize("factory, recovery", [(episode_envs.CountEnv, "replay"),
                                               (episode_envs.SnapCountEnv, "snapshot")])
def test_an_episode_continued_after_its_finished_turns_ends_as_one_never_interrupted(factory, recovery) -> None:
    env = spec(factory, recovery)
    whole, reward, turns = episode(env, request())
    for cut in range(len(turns)):
        traj, _, snap = turns[cut]
        ends = tuple(len(t) for t, _, _ in turns[: cut + 1])
        restores = episode_envs.SnapCountEnv.restores
        c, r, rest = episode(env, request(prefix=traj, turns=ends, snapshot=snap))
        assert np.array_equal(c.completion_ids, whole.completion_ids) and r == reward
        assert np.array_equal(c.versions, whole.versions) and np.array_equal(c.logprobs, whole.logprobs)
        assert [k for _, k, _ in rest] == [k for _, k, _ in turns[cut + 1:]]
        assert episode_envs.SnapCountEnv.restores == restores + (recovery == "snapshot")


def test_a_turn_in_flight_is_continued_from_its_tokens() -> None:
    env = spec(episode_envs.CountEnv)
    whole, _, turns = episode(env, request())
    first = len(turns[0][0])
    partial = Tokens(*(getattr(whole, f)[: first + 2] for f in ("completion_ids", "logprobs", "versions")))
    c, _, _ = episode(env, request(prefix=partial, turns=(first,)))
    assert np.array_equal(c.completion_ids, whole.completion_ids)


def test_a_snapshot_environment_without_its_snapshot_or_over_its_bound_is_a_data_failure() -> None:
    env = spec(episode_envs.SnapCountEnv, "snapshot")
    _, _, turns = episode(env, request())
    traj = turns[0][0]
    with pytest.raises(DataError, match="no snapshot"):
        episode(env, request(prefix=traj, turns=(len(traj),), snapshot=None))
    with pytest.raises(DataError, match="max_snapshot_bytes"):
        episode(dataclasses.replace(env, max_snapshot_bytes=2), request())


@pytest.mark.parametrize("bad, message", [
    (lambda self, text: "not a step", "must return Step"),
    (lambda self, text: episode_envs.Step(reward=float("nan"), done=True), "finite"),
    (lambda self, text: 1 / 0, "ZeroDivisionError"),
])
def test_a_broken_step_is_a_data_failure(bad, message) -> None:
    broken = type("Broken", (episode_envs.CountEnv,), {"step": bad})
    with pytest.raises(DataError, match=message):
        episode(spec(broken), request())


def test_a_slow_environment_misses_its_deadline() -> None:
    import threading

    gate = threading.Event()
    slow = type("Slow", (episode_envs.CountEnv,), {"step": lambda self, text: gate.wait(5) and None})
    try:
        with pytest.raises(DataError, match="env.timeout_s"):
            episode(spec(slow, timeout_s=0.05), request())
    finally:
        gate.set()


def test_an_environment_response_past_the_engines_budget_ends_the_episode() -> None:
    """The trajectory never outgrows what the engine may generate after the prompt (the
    built-in GPT's block_size): a response that would reach it cuts the episode there."""
    bounded = ToyEngine(tool_turns=2)
    bounded.completion_limit = CompletionLimit(20, None)  # what the toy generates within
    bounded.capabilities = dataclasses.replace(bounded.capabilities, completion_limit=bounded.completion_limit)
    talkative = type("Talkative", (episode_envs.CountEnv,),
                     {"step": lambda self, text: episode_envs.Step(response="=" * 30)})
    c, _, turns = episode(spec(talkative), request(), engine=bounded)
    assert not turns and c.finish_reason == "length" and len(c.completion_ids) < 20
    assert (c.versions != ENV_VERSION).all()


def test_env_max_turn_tokens_caps_every_model_turn() -> None:
    env = dataclasses.replace(spec(episode_envs.CountEnv), max_turn_tokens=2)
    c, _, turns = episode(env, request(), engine=ToyEngine(completion_tokens=8))
    model = c.versions != ENV_VERSION
    runs = np.split(model, np.flatnonzero(np.diff(model.astype(int))) + 1)
    assert len(turns) == 2 and [len(r) for r in runs if r[0]] == [2, 2, 2]
