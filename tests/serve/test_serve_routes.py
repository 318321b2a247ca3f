"""`rollkeep serve` as a real process, in both flavors, against the hf engine in this
process: the same tokens and float32 log-probs for the same weights, ids, seed and
positions (whole, streamed, continued with the `rollkeep.prompt_tokens` extension, and
after a weight reload), aborts and pause that end a running generation with "abort" and
the tokens so far, version labels, identity routes.

One server per flavor for the session (conftest.py). Nothing here sleeps to synchronise:
servers are waited on through their port file, running and waiting requests through
/metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid

import numpy as np
import pytest
from serve_harness import CONTEXT, Client, InThread, until

from rollkeep.core.custody.keys import Key
from rollkeep.core.rollout.generation import Tokens
from rollkeep.core.rollout.source import Prompt
from rollkeep.engines import GenRequest
from rollkeep.engines.hf import HFEngine

pytestmark = pytest.mark.slow

T, TOP_P, M = 0.8, 0.95, 20
LONG = CONTEXT - 16  # new tokens of a generation that a test aborts long before it ends
TEXTS = ["12+34=", "7*8=?", "hello there", "9"]


@pytest.fixture(params=["completions", "generate"])
def route(request, srv):
    if srv.flavor == "sglang" and request.param == "generate":
        pytest.skip("SGLang has one data-plane route")
    return request.param


@pytest.fixture
def client(srv, route):
    c = Client(srv, route)
    yield c
    c.close()


@pytest.fixture
def ctl(srv):
    c = Client(srv)
    yield c
    c.close()


def _engine(model_dir) -> HFEngine:
    return HFEngine(model_path=str(model_dir), temperature=T, top_p=TOP_P, max_new_tokens=M, chat_template=False,
                    max_batch_size=8)


@pytest.fixture(scope="module")
def ref(dirs):
    """The hf engine in this process, on the same model (and device choice) as the server."""
    engines = {"base": _engine(dirs["base"]), "other": _engine(dirs["other"])}
    yield engines
    for e in engines.values():
        asyncio.run(e.close())


def request(text: str, seed: int, prefix: Tokens | None = None) -> GenRequest:
    prompt = Prompt(key=Key(0, 0), group_id="g", idx=0, task="default", row={}, row_fingerprint=0, prompt=text)
    return GenRequest(group_id="g", generation=0, attempt=0, prompt=prompt, seed=seed, pinned_version=None,
                      prefix=prefix)


def generated(eng: HFEngine, reqs: list[GenRequest]):
    async def body():
        return await asyncio.gather(*[eng.generate(r) for r in reqs])

    return asyncio.run(body())


@pytest.fixture(scope="module")
def cases(ref):
    """Per prompt, the first seed whose completion ends with EOS and the first that runs to
    the limit (both endings, whatever the random weights make of them)."""
    out = []
    for text in TEXTS:
        completions = generated(ref["base"], [request(text, seed) for seed in range(24)])
        for reason in ("stop", "length"):
            seed, c = next((s, c) for s, c in enumerate(completions) if c.finish_reason == reason)
            out.append((seed, c))
    return out


def same(g, ids, logprobs, finish=None) -> None:
    assert g.ids == list(ids)
    np.testing.assert_array_equal(np.asarray(g.logprobs, np.float32), np.asarray(logprobs, np.float32))
    if finish is not None:
        assert g.finish == finish


# ---------------------------------------------------------------- the same tokens

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tokens_and_logprobs_are_the_in_process_hf_engines(client, cases, stream):
    for seed, c in cases:
        g = client.generate(c.prompt_ids.tolist(), seed=seed, max_tokens=M, temperature=T, top_p=TOP_P,
                            stream=stream)
        same(g, c.completion_ids, c.logprobs, c.finish_reason)  # (streams: tokens as they come, see the abort tests)


def test_concurrent_requests_with_different_settings_each_get_their_own_tokens(client, ref):
    ids = ref["base"].tokenizer.encode("12+34=")
    settings = [(s, t, p) for s in (11, 12) for t, p in ((0.7, 1.0), (1.3, 0.8))]
    calls = [InThread(lambda s=s, t=t, p=p: client.generate(ids, seed=s, max_tokens=M, temperature=t, top_p=p))
             for s, t, p in settings]
    for call, (s, t, p) in zip(calls, settings, strict=True):
        r = ref["base"].submit_ids(ids, seed=s, max_new_tokens=M, temperature=t, top_p=p).result(timeout=60)
        same(call.join(), r.token_ids, r.logprobs, r.finish_reason)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_continuation_with_prompt_tokens_equals_the_uninterrupted_generation(client, ref, stream):
    (c,) = generated(ref["base"], [request("hello there", 8)])
    prompt, done = c.prompt_ids.tolist(), c.completion_ids.tolist()
    assert len(done) >= 4
    k = len(done) // 2
    g = client.generate(prompt + done[:k], prompt_tokens=len(prompt), seed=8, max_tokens=M - k, temperature=T,
                        top_p=TOP_P, stream=stream)
    (cont,) = generated(ref["base"], [request("hello there", 8, Tokens(c.completion_ids[:k], c.logprobs[:k],
                                                                       c.versions[:k]))])
    same(g, cont.completion_ids[k:], cont.logprobs[k:], cont.finish_reason)  # exactly the hf engine's continuation
    assert g.ids == done[k:] and g.finish == c.finish_reason  # = the uninterrupted one: its tokens,
    np.testing.assert_allclose(g.logprobs, c.logprobs[k:], atol=1e-5)  # log-probs to float32 rounding (prefill)
    # Without the extension the prefix is prompt: positions start at 0, another completion.
    other = client.generate(prompt + done[:k], seed=8, max_tokens=M - k, temperature=T, top_p=TOP_P)
    assert other.ids != g.ids


# ---------------------------------------------------------------- weights and versions

def test_reload_serves_the_new_weights_and_a_bad_directory_changes_nothing(ctl, ref, dirs):
    ids = ref["base"].tokenizer.encode("7*8=?")

    def now():
        return ctl.generate(ids, seed=21, max_tokens=M, temperature=T, top_p=TOP_P)

    base = ref["base"].submit_ids(ids, seed=21, max_new_tokens=M).result(timeout=60)
    other = ref["other"].submit_ids(ids, seed=21, max_new_tokens=M).result(timeout=60)
    assert (base.token_ids, base.logprobs[0]) != (other.token_ids, other.logprobs[0])
    same(now(), base.token_ids, base.logprobs)
    label = f"rollkeep:1:{uuid.uuid4().hex[:16]}"
    try:
        r = ctl.reload(dirs["other"], label)
        assert r.status_code == 200, r.text
        assert r.json() == ({"results": [None]} if ctl.flavor == "vllm" else
                            {"success": True, "message": r.json()["message"], "num_paused_requests": 0})
        g = now()
        same(g, other.token_ids, other.logprobs)
        assert g.version == ctl.version() == label
        for bad in ("absent", "empty", "wider", "missing", "torn"):
            r = ctl.reload(dirs[bad], "rollkeep:2:bad")
            assert r.status_code == 400, (bad, r.text)
            body = r.json()
            message = body["message"] if ctl.flavor == "sglang" else body["error"]["message"]
            assert str(dirs[bad]) in message or bad in ("torn",), message
            if ctl.flavor == "sglang":
                assert body["success"] is False
            g = now()
            same(g, other.token_ids, other.logprobs)  # still the weights that loaded
            assert ctl.version() == g.version == label
    finally:
        assert ctl.reload(dirs["base"], "default").status_code == 200
    same(now(), base.token_ids, base.logprobs)


def test_version_routes(ctl, ref):
    assert ctl.version()
    ctl.set_version("rollkeep:7:0123456789abcdef")
    assert ctl.version() == "rollkeep:7:0123456789abcdef"
    g = ctl.generate([5, 6, 7], seed=1, max_tokens=2, temperature=T)
    assert g.version == "rollkeep:7:0123456789abcdef"
    if ctl.flavor == "sglang":
        info = ctl.http.get("/get_model_info").json()
        assert info["weight_version"] == "rollkeep:7:0123456789abcdef"
    ctl.set_version("default")
    assert ctl.version() == "default"


# ---------------------------------------------------------------- abort and pause

def _prefix_is_the_reference(ref, ids, seed, g) -> None:
    r = ref["base"].submit_ids(ids, seed=seed, max_new_tokens=max(1, len(g.ids)), ignore_eos=True,
                               temperature=T, top_p=TOP_P).result(timeout=60)
    same(g, r.token_ids[: len(g.ids)], r.logprobs[: len(g.ids)])


@pytest.mark.parametrize("how", ["by_id", "pause"])
def test_abort_and_pause_end_a_running_stream_with_the_tokens_so_far(client, ctl, ref, how):
    rid = f"abort-{uuid.uuid4().hex}"
    ids = [5, 6, 7, 8]
    try:
        with client.stream_chunks(ids, seed=31, max_tokens=LONG, temperature=T, top_p=TOP_P, ignore_eos=True,
                                  rid=rid) as chunks:
            first = next(chunks)
            assert first.ids and first.finish is None  # it runs
            if how == "by_id":
                ctl.abort(rid)
            else:
                ctl.pause_abort()
            *_, last = [first, *chunks]
        assert last.finish == "abort" and len(first.ids) <= len(last.ids) < LONG
        _prefix_is_the_reference(ref, ids, 31, last)
        if how == "pause":
            # Paused: a new request waits (it is not refused) until resume, then runs normally.
            waiting = InThread(lambda: client.generate(ids, seed=32, max_tokens=M, temperature=T, top_p=TOP_P))
            until(lambda: ctl.counts() == (0, 1), "the request to wait")
            assert not waiting.done
            if ctl.flavor == "vllm":
                assert ctl.http.get("/is_paused").json() == {"is_paused": True}
            ctl.resume()
            r = ref["base"].submit_ids(ids, seed=32, max_new_tokens=M).result(timeout=60)
            same(waiting.join(), r.token_ids, r.logprobs, r.finish_reason)
    finally:
        ctl.resume()
    assert ctl.counts() == (0, 0)


def test_abort_all_ends_a_running_whole_request(ctl, ref):
    ids = [9, 10, 11]
    call = InThread(lambda: ctl.generate(ids, seed=41, max_tokens=LONG, temperature=T, top_p=TOP_P,
                                         ignore_eos=True))
    until(lambda: ctl.counts()[0] == 1, "the request to run")
    ctl.abort()
    g = call.join()
    assert g.finish == "abort" and len(g.ids) < LONG
    _prefix_is_the_reference(ref, ids, 41, g)


def test_a_client_that_hangs_up_aborts_its_stream(client, ctl):
    aborted = ctl.metrics()["finished_total:abort"]
    with client.stream_chunks([5, 6], seed=51, max_tokens=LONG, temperature=T, ignore_eos=True) as chunks:
        assert next(chunks).ids
    until(lambda: ctl.counts() == (0, 0), "the abandoned stream to end")
    assert ctl.metrics()["finished_total:abort"] == aborted + 1  # aborted, not run to its end


def test_a_client_that_hangs_up_aborts_its_whole_request(srv, ctl):
    path, body = ctl.request([5, 6], seed=52, max_tokens=LONG, temperature=T, ignore_eos=True)
    raw = json.dumps(body).encode()
    aborted = ctl.metrics()["finished_total:abort"]
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        until(lambda: ctl.counts()[0] == 1, "the request to run")
    until(lambda: ctl.counts() == (0, 0), "the abandoned request to end")
    assert ctl.metrics()["finished_total:abort"] == aborted + 1


# ---------------------------------------------------------------- identity

def test_identity_and_health_routes(ctl):
    get = ctl.http.get
    assert get("/health").status_code == 200
    if ctl.flavor == "vllm":
        assert get("/version").json()["version"].startswith("rollkeep-serve ")
        models = get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["max_model_len"] == CONTEXT
        assert get("/weight_info").json()["weight_version"]
        assert ctl.http.post("/reset_prefix_cache").status_code == 200
        assert ctl.http.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
        assert ctl.http.post("/resume").json() == {"status": "resumed"}
        assert get("/is_paused").json() == {"is_paused": False}
    else:
        info = get("/get_server_info").json()
        assert info["version"].startswith("rollkeep-serve ") and info["context_length"] == CONTEXT
        model = get("/get_model_info").json()
        assert model["is_generation"] is True and model["context_length"] == CONTEXT
        assert model["weight_version"] and model["model_path"]
        assert get("/health_generate").status_code == 200
        assert ctl.http.post("/flush_cache").status_code == 200
    assert "/health" in get("/openapi.json").json()["paths"]
