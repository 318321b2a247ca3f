"""One server as the pool drives it, against a fake server of each flavor (no sockets): the
fence, refit from a weight directory only when the server lacks it, streamed generation
with every token checked and stamped, continuation across a refit, and every hostile answer
an infra failure or a lost server, never accepted data and never a hang."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
from fake_server import FakeServer, token

from rollkeep.cluster.replicas import ReplicaLost
from rollkeep.config.sections import RemoteEngineConfig
from rollkeep.core.custody.keys import Key
from rollkeep.core.custody.trace_schema import ServerFenced
from rollkeep.core.rollout.generation import GenRequest, InfraError, Prefix
from rollkeep.core.rollout.source import Prompt
from rollkeep.remote.server import ServerHandle

PROMPT = [1, 7, 9]
PROMPT_REF = Prompt(key=Key(0, 1), group_id="e0.1", idx=1, task="t", row={}, row_fingerprint=0, prompt="p")


class StubTokenizer:
    vocab, context, eos, probe_id, episode = 64, None, 5, 1, None

    def encode_prompt(self, req: GenRequest) -> list[int]:
        return list(PROMPT)

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def section(flavor: str = "vllm", **kw) -> RemoteEngineConfig:
    return RemoteEngineConfig(**{"flavor": flavor, "servers": ["http://fake:1"], "tokenizer_path": "unused",
                                 "max_new_tokens": 6, **kw})


def weights(version: int) -> SimpleNamespace:
    return SimpleNamespace(path=f"/run/weights/v{version}", label=f"rollkeep:{version}:abcd")


def request(seed: int = 3, prefix: Prefix | None = None, pinned: int | None = None) -> GenRequest:
    return GenRequest(group_id="e0.1", generation=0, attempt=0, prompt=PROMPT_REF,
                      seed=seed, pinned_version=pinned, prefix=prefix)


def handle(fake: FakeServer, sec: RemoteEngineConfig | None = None, events: list | None = None,
           headers: dict | None = None) -> ServerHandle:
    return ServerHandle(0, "http://fake:1", sec or section(fake.flavor), StubTokenizer(), headers=headers or {},
                        emit=(events if events is not None else []).append, transport=fake.transport())


async def fenced(fake: FakeServer, version: int = 2, **kw) -> ServerHandle:
    h = handle(fake, **kw)
    await h.start()
    await h.refit(weights(version), version)
    return h


def expected(weights_path: str, seed: int, positions: range) -> list[int]:
    out = []
    for i in positions:
        t = token(weights_path, PROMPT, seed, i)
        out.append(t)
        if t == 5:
            break
    return out


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_the_fence_aborts_reads_the_version_and_reloads_only_what_the_server_lacks(flavor) -> None:
    async def main():
        fake, events = FakeServer(flavor=flavor), []
        fake.running["left-by-a-dead-controller"] = asyncio.Event()
        h = handle(fake, events=events)
        await h.start()
        assert not fake.paused and fake.running["left-by-a-dead-controller"].is_set()  # aborted, then resumed
        await h.refit(weights(2), 2)
        assert fake.label == "rollkeep:2:abcd" and fake.weights == "/run/weights/v2"
        [ev] = events
        assert isinstance(ev, ServerFenced) and (ev.found, ev.set, ev.aborted) == ("default", fake.label, 1)
        # A controller restart while the server holds the version: nothing is reloaded.
        reloads = sum(p in ("/collective_rpc", "/update_weights_from_disk") for _, p in fake.calls)
        again, events2 = handle(fake, events=[]), []
        again._emit = events2.append
        await again.start()
        await again.refit(weights(2), 2)
        assert sum(p in ("/collective_rpc", "/update_weights_from_disk") for _, p in fake.calls) == reloads
        assert events2[0].found == events2[0].set == "rollkeep:2:abcd"
        await h.close()
        await again.close()

    asyncio.run(main())


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_a_generation_is_streamed_checked_and_stamped(flavor) -> None:
    async def main():
        fake = FakeServer(flavor=flavor)
        h = await fenced(fake, 2)
        chunks = []
        c = await h.generate(request(seed=11), chunks.append)
        want = expected("/run/weights/v2", 11, range(6))
        assert c.completion_ids.tolist() == want and (c.versions == 2).all() and np.allclose(c.logprobs, -0.5)
        assert np.concatenate([ch.completion_ids for ch in chunks]).tolist() == want
        assert c.finish_reason == ("stop" if want[-1] == 5 else "length")
        await h.close()

    asyncio.run(main())


def test_vllm_token_in_token_out_is_used_where_the_server_has_it() -> None:
    async def main():
        for scale_out, route in ((True, "/inference/v1/generate"), (False, "/v1/completions")):
            fake = FakeServer(scale_out=scale_out)
            h = await fenced(fake, 2)
            c = await h.generate(request(seed=11))
            assert c.completion_ids.tolist() == expected("/run/weights/v2", 11, range(6))
            assert fake.calls[-1] == ("POST", route)
            await h.close()

    asyncio.run(main())


def test_a_refit_under_a_running_generation_continues_it_under_the_new_weights() -> None:
    async def main():
        fake = FakeServer()
        h = await fenced(fake, 2)
        fake.hold, first_out = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(h.generate(request(seed=4), lambda chunk: first_out.set()))
        await first_out.wait()  # the first token is out; the stream waits on `hold` (or an abort)
        fake.hold = None
        await h.refit(weights(3), 3)  # pauses (aborting the stream), reloads, resumes
        c = await task
        first = token("/run/weights/v2", PROMPT, 4, 0)
        assert c.completion_ids[0] == first and c.versions[0] == 2
        assert (c.versions[1:] == 3).all() and len(c.completion_ids) > 1
        # the continuation samples from the new weights (the fake's positions restart at 0
        # for a server that is not rollkeep serve: it knows nothing of the prefix)
        rest = c.completion_ids[1:].tolist()
        assert rest == [token("/run/weights/v3", [*PROMPT, first], 4, i) for i in range(len(rest))]
        await h.close()

    asyncio.run(main())


def test_only_rollkeep_serve_is_sent_the_sampling_position_extension() -> None:
    async def main():
        for version, sent in (("0.32.0", False), ("rollkeep-serve 0.1.0", True)):
            fake, bodies = FakeServer(), []
            inner = fake.handle

            async def spy(req, inner=inner, bodies=bodies, version=version):
                if req.url.path == "/v1/completions":
                    bodies.append(json.loads(req.content))
                if req.url.path == "/version":
                    import httpx
                    return httpx.Response(200, json={"version": version})
                return await inner(req)

            fake.handle = spy
            h = await fenced(fake, 1)
            prefix = Prefix(np.array([9, 9], np.int32), np.array([-1.0, -1.0], np.float32), np.array([1, 1], np.int32))
            c = await h.generate(request(seed=2**64 - 1, prefix=prefix))
            assert ("rollkeep" in bodies[-1]) == sent
            # real servers take an int64 seed; rollkeep serve the whole 64 bits
            assert bodies[-1]["seed"] == (2**64 - 1 if sent else (2**64 - 1) % 2**63)
            assert bodies[-1]["model"] == "/models/tiny"  # the served name, from /v1/models
            assert bodies[-1]["prompt"] == [*PROMPT, 9, 9] and bodies[-1]["max_tokens"] == 4
            assert c.completion_ids[:2].tolist() == [9, 9] and c.logprobs[0] == -1.0
            await h.close()

    asyncio.run(main())


@pytest.mark.parametrize("hostile", ["bad_id", "negative_id", "positive_lp", "nan_lp", "bool_id", "str_id",
                                     "too_many", "wrong_version", "no_finish", "garbage", "status_500", "redirect",
                                     "huge"])
@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_every_malformed_answer_fails_the_attempt_and_nothing_is_accepted(hostile, flavor) -> None:
    async def main():
        fake = FakeServer(flavor=flavor)
        h = await fenced(fake, 2, sec=section(flavor, max_response_bytes=50_000))
        fake.hostile = hostile
        chunks = []
        with pytest.raises(InfraError) as e:
            await h.generate(request(), chunks.append)
        assert "server http://fake:1" in str(e.value)
        if hostile in ("bad_id", "negative_id", "positive_lp", "nan_lp", "bool_id", "str_id", "too_many",
                       "wrong_version", "status_500", "redirect", "huge"):
            assert chunks == []  # the bad event itself is never reported
        await h.close()

    asyncio.run(main())


def test_a_server_that_never_answers_or_refuses_is_lost_not_a_hang() -> None:
    async def main():
        fake = FakeServer()
        h = await fenced(fake, 2, sec=section(request_timeout_s=0.2))
        fake.hostile = "hang"
        with pytest.raises(ReplicaLost, match="request_timeout_s"):
            await h.generate(request())
        fake.hostile, fake.down = None, True
        with pytest.raises(ReplicaLost, match="ConnectError"):
            await h.generate(request())
        await h.close()

    asyncio.run(main())


def test_a_refit_the_server_refuses_loses_the_server() -> None:
    async def main():
        fake = FakeServer(flavor="sglang")
        h = await fenced(fake, 2)
        fake.hostile = "reload_fails"
        with pytest.raises(ReplicaLost, match="refit to version 3 failed"):
            await h.refit(weights(3), 3)
        assert not fake.paused  # resumed even so
        with pytest.raises(ReplicaLost):  # it holds no weights of the run until fenced again
            await h.generate(request())
        await h.close()

    asyncio.run(main())


def test_the_bearer_token_is_sent_and_never_in_an_error() -> None:
    async def main():
        fake, seen = FakeServer(), []
        inner = fake.handle

        async def spy(req):
            seen.append(req.headers.get("authorization"))
            return await inner(req)

        fake.handle = spy
        h = await fenced(fake, 1, headers={"authorization": "Bearer s3cret-token"})
        fake.hostile = "status_500"
        with pytest.raises(InfraError) as e:
            await h.generate(request())
        assert set(seen) == {"Bearer s3cret-token"} and "s3cret" not in str(e.value)
        await h.close()

    asyncio.run(main())
