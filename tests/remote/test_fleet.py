"""A fleet of fake servers behind the engine pool, as server mode builds it: attempts spread
over the live servers, a lost server's attempts fail as infra and it is fenced again before
it gets work (`server_lost`, `server_fenced`, `server_back`), and a fleet with no live server
for engine.unavailable_timeout_s tells the run to stop."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fake_server import FakeServer
from test_server_handle import StubTokenizer, request, section

from rollkeep.cluster.pool import EnginePool
from rollkeep.core.custody.trace_schema import ServerBack, ServerFenced, ServerLost
from rollkeep.core.rollout.generation import InfraError
from rollkeep.remote import ServerEvents
from rollkeep.remote.server import ServerHandle

URLS = ["http://a:1", "http://b:1"]


def fleet(fakes: list[FakeServer], **kw):
    sec = section(**kw).model_copy(update={"servers": URLS})
    events: list = []
    seen = asyncio.Event()
    pool: EnginePool

    def emit(ev) -> None:
        pool._trace(ev)

    handles = [ServerHandle(i, u, sec, StubTokenizer(), headers={}, emit=emit, transport=f.transport())
               for i, (u, f) in enumerate(zip(URLS, fakes, strict=True))]
    pool = EnginePool(handles, publish=lambda w, v: SimpleNamespace(path=f"/w/v{v}", label=f"rollkeep:{v}:x"),
                      max_restarts=2**62, replica_timeout_s=sec.unavailable_timeout_s, events=ServerEvents(URLS))
    unavailable: list[str] = []

    def record(ev) -> None:
        events.append(ev)
        seen.set()

    pool.attach(record, unavailable.append)
    return pool, events, seen, unavailable


async def until(seen: asyncio.Event, events: list, pred, timeout: float = 20.0):
    async with asyncio.timeout(timeout):
        while not any(pred(e) for e in events):
            seen.clear()
            await seen.wait()


def test_a_lost_server_is_fenced_again_before_it_gets_work() -> None:
    async def main():
        fakes = [FakeServer(), FakeServer()]
        pool, events, seen, _ = fleet(fakes)
        await pool.open()
        await pool.update_weights({}, 1)
        assert sorted(e.server for e in events if isinstance(e, ServerFenced)) == URLS
        fakes[0].down = True
        results = await asyncio.gather(*(pool.generate(request(seed=i)) for i in range(4)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, InfraError)]
        assert failed and all(r.replica == 0 for r in failed)
        assert all(r.replica == 1 for r in results if not isinstance(r, BaseException))
        await until(seen, events, lambda e: isinstance(e, ServerLost))
        after = len(fakes[1].calls)
        again = await asyncio.gather(*(pool.generate(request(seed=i)) for i in range(3)))
        assert {c.replica for c in again} == {1} and len(fakes[1].calls) > after  # all on the live one
        await pool.update_weights({}, 2)  # refit while it is down: it catches up when back
        fakes[0].down = False
        await until(seen, events, lambda e: isinstance(e, ServerBack))
        fences = [e for e in events if isinstance(e, ServerFenced) and e.server == URLS[0]]
        assert len(fences) == 2 and fences[1].set == "rollkeep:2:x" and fakes[0].label == "rollkeep:2:x"
        c = await pool.generate(request(seed=9))
        assert (c.versions == 2).all()
        await pool.close()

    asyncio.run(main())


def test_no_live_server_for_the_timeout_stops_the_run() -> None:
    async def main():
        fakes = [FakeServer(), FakeServer()]
        pool, events, seen, unavailable = fleet(fakes, unavailable_timeout_s=0.3)
        await pool.open()
        await pool.update_weights({}, 1)
        for f in fakes:
            f.down = True
        results = await asyncio.gather(*(pool.generate(request(seed=i)) for i in range(2)), return_exceptions=True)
        assert all(isinstance(r, InfraError) for r in results)
        async with asyncio.timeout(20):
            while not unavailable:
                seen.clear()
                await asyncio.sleep(0.05)
        assert "engine.unavailable_timeout_s=0.3" in unavailable[0]
        await pool.close()

    asyncio.run(main())


def test_a_fleet_that_never_answers_does_not_open() -> None:
    from rollkeep.cluster.replicas import ReplicaGone

    async def main():
        fakes = [FakeServer(down=True), FakeServer(down=True)]
        pool, *_ = fleet(fakes, unavailable_timeout_s=0.3)
        with pytest.raises(ReplicaGone):
            await pool.open()
        await pool.close()

    asyncio.run(main())


def test_a_multi_turn_episode_runs_through_the_servers(tmp_path) -> None:
    """The same calls carry episodes: each turn continues the trajectory (prompt + turns so
    far as token ids), the environment's answers are encoded with the servers' tokenizer."""
    import episode_envs
    from hf_fixture import make_tiny_hf_model

    from rollkeep.controller.episodes import run_episode
    from rollkeep.controller.usercode import UserCode
    from rollkeep.core.custody.keys import Key
    from rollkeep.core.rollout.generation import GenRequest
    from rollkeep.core.rollout.source import Prompt
    from rollkeep.envs import ENV_VERSION, EnvSpec
    from rollkeep.remote.tokenizer import RemoteTokenizer

    tok = RemoteTokenizer(str(make_tiny_hf_model(tmp_path / "m")), chat_template=False)
    fake = FakeServer(eos=-1)  # every turn runs to its cap
    sec = section(max_new_tokens=24).model_copy(update={"servers": URLS[:1]})
    pool: EnginePool

    def emit(ev) -> None:
        pool._trace(ev)

    turns, bodies = [], []
    inner = fake.handle

    async def spy(r):
        if r.url.path == "/v1/completions":
            bodies.append(json.loads(r.content))
        return await inner(r)

    fake.handle = spy
    handle = ServerHandle(0, URLS[0], sec, tok, headers={}, emit=emit, transport=fake.transport())
    pool = EnginePool([handle], publish=lambda w, v: SimpleNamespace(path=f"/w/v{v}", label=f"rollkeep:{v}:x"),
                      max_restarts=2**62, replica_timeout_s=5.0, events=ServerEvents(URLS[:1]))
    env = EnvSpec(episode_envs.CountEnv, "replay", 3, 5.0, 1024, "test", max_turn_tokens=3)
    prompt = Prompt(key=Key(0, 0), group_id="e0.0", idx=0, task="t", row={}, row_fingerprint=0, prompt="37*48=")
    req = GenRequest(group_id="e0.0", generation=0, attempt=0, prompt=prompt, seed=5, pinned_version=None)

    async def main():
        await pool.open()
        await pool.update_weights({}, 1)
        code = UserCode()
        try:
            return await run_episode(pool, env, req, None, lambda t, k, s: turns.append((t, k)), code=code)
        finally:
            code.close()
            await pool.close()

    c, _ = asyncio.run(main())
    on_env = c.versions == ENV_VERSION
    assert [k for _, k in turns] == [0, 1] and on_env.any() and (c.versions[~on_env] == 1).all()
    assert tok.decode(c.completion_ids[on_env].tolist()) == "=1=2"  # ("=1;=2;": no ";" in its vocabulary)
    # the second turn's request is the prompt, then the whole trajectory so far, as ids
    prompt_ids = tok.encode_prompt(req)
    assert bodies[-1]["prompt"][: len(prompt_ids)] == prompt_ids
    assert bodies[-1]["prompt"][len(prompt_ids):] == turns[-1][0].completion_ids.tolist()
