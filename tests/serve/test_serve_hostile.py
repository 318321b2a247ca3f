"""Hostile requests to `rollkeep serve` get a 4xx JSON error in the flavor's shape, never a
crash, a hang or a 5xx, and change nothing: the server answers the next request as before."""

from __future__ import annotations

import json

import pytest
from hf_fixture import CHARS, SPECIALS
from serve_harness import CONTEXT, Client

pytestmark = pytest.mark.slow

VOCAB = len(SPECIALS) + len(CHARS)  # the tiny model's
BIG = 8 << 20


def data_route(flavor: str) -> tuple[str, str, str, str | None]:
    """(path, ids field, budget field, the object holding the sampling fields or None: top level)."""
    if flavor == "sglang":
        return "/generate", "input_ids", "max_new_tokens", "sampling_params"
    return "/v1/completions", "prompt", "max_tokens", None


def body(flavor: str, ids=(5, 6, 7), **fields) -> dict:
    path, ids_key, budget, where = data_route(flavor)
    sampling = {budget: 4, **{k: v for k, v in fields.items() if k not in ("top", "rollkeep")}}
    top = fields.get("top", {})
    out = {ids_key: list(ids) if isinstance(ids, tuple) else ids, **top}
    if "rollkeep" in fields:
        out["rollkeep"] = fields["rollkeep"]
    if where is None:
        return out | sampling
    return out | {where: sampling}


def budget_key(flavor: str) -> str:
    return data_route(flavor)[2]


HOSTILE_JSON = {
    "id out of vocabulary": lambda f: body(f, ids=(5, VOCAB)),
    "negative id": lambda f: body(f, ids=(-1, 5)),
    "id not an int": lambda f: body(f, ids=[5, 1.5]),
    "id a bool": lambda f: body(f, ids=[5, True]),
    "empty prompt": lambda f: body(f, ids=[]),
    "prompt a string": lambda f: body(f, ids="12+34="),
    "prompt a batch": lambda f: body(f, ids=[[5, 6]]),
    "no prompt": lambda f: {k: v for k, v in body(f).items() if k not in ("prompt", "input_ids")},
    "past the context": lambda f: body(f, ids=(5,) * 10, **{budget_key(f): CONTEXT - 9}),
    "negative max_tokens": lambda f: body(f, **{budget_key(f): -1}),
    "max_tokens a string": lambda f: body(f, **{budget_key(f): "4"}),
    "temperature a string": lambda f: body(f, temperature="hot"),
    "temperature zero": lambda f: body(f, temperature=0),
    "top_p zero": lambda f: body(f, top_p=0),
    "top_p over one": lambda f: body(f, top_p=1.5),
    "seed a float": lambda f: body(f, **{("sampling_seed" if f == "sglang" else "seed"): 1.5}),
    "seed too large": lambda f: body(f, **{("sampling_seed" if f == "sglang" else "seed"): 1 << 70}),
    "stream a string": lambda f: body(f, top={"stream": "yes"}),
    "top_k set": lambda f: body(f, top_k=5),
    "stop strings": lambda f: body(f, stop=["\n"]),
    "n > 1": lambda f: body(f, n=2),
    "prompt_tokens zero": lambda f: body(f, rollkeep={"prompt_tokens": 0}),
    "prompt_tokens past the input": lambda f: body(f, rollkeep={"prompt_tokens": 4}),
    "prompt_tokens a string": lambda f: body(f, rollkeep={"prompt_tokens": "3"}),
    "rollkeep not an object": lambda f: body(f, rollkeep=3),
}

HOSTILE_RAW = {
    "not JSON": b"{not json",
    "not UTF-8": b'{"prompt": "\xff\xfe"}',
    "a JSON array": b"[1, 2, 3]",
    "a JSON string": b'"hello"',
    "empty": b"",
    "NaN temperature": None,  # built per flavor below
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
}


def check_refused(c: Client, r, status=400) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    message = err if c.flavor == "sglang" else err["message"]
    assert isinstance(message, str) and message


@pytest.fixture
def c(srv):
    client = Client(srv)
    yield client
    # Unharmed: the same request gives the same tokens as before.
    assert client.http.get("/health").status_code == 200
    client.close()


@pytest.mark.parametrize("case", HOSTILE_JSON)
def test_a_hostile_generation_request_is_refused(c, case):
    path = data_route(c.flavor)[0]
    before = c.generate([5, 6, 7], seed=1, max_tokens=4, temperature=1.0)
    check_refused(c, c.http.post(path, json=HOSTILE_JSON[case](c.flavor)))
    after = c.generate([5, 6, 7], seed=1, max_tokens=4, temperature=1.0)
    assert (after.ids, after.logprobs) == (before.ids, before.logprobs)


@pytest.mark.parametrize("case", HOSTILE_RAW)
def test_a_body_that_is_not_a_json_object_is_refused(c, case):
    path, ids_key, _, _ = data_route(c.flavor)
    raw = HOSTILE_RAW[case]
    if raw is None:
        raw = json.dumps(body(c.flavor, temperature=0.5)).replace("0.5", "NaN").encode()
    check_refused(c, c.http.post(path, content=raw, headers={"content-type": "application/json"}))


def test_a_body_over_the_bound_is_refused(c):
    path, ids_key, _, _ = data_route(c.flavor)
    huge = b'{"' + ids_key.encode() + b'": [' + b"5," * (BIG // 2) + b'5]}'
    check_refused(c, c.http.post(path, content=huge), status=413)

    def chunked():  # no Content-Length: counted as it arrives
        yield huge[: BIG // 2]
        yield huge[BIG // 2:]

    check_refused(c, c.http.post(path, content=chunked()), status=413)


def test_hostile_control_requests_are_refused(c, dirs):
    post = c.http.post
    if c.flavor == "vllm":
        cases = [post("/pause", params={"mode": "freeze"}),
                 post("/collective_rpc", json={"method": "execute_model", "kwargs": {}}),
                 post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": 3}}),
                 post("/collective_rpc", content=b"nope"),
                 post("/abort_requests", json={"request_ids": "all"}),
                 post("/abort_requests", json={"request_ids": [1, 2]}),
                 post("/update_weight_version", json={"new_version": 5}),
                 post("/update_weight_version", json={})]
    else:
        cases = [post("/pause_generation", json={"mode": "freeze"}),
                 post("/abort_request", json={}),
                 post("/abort_request", json={"rid": 5}),
                 post("/update_weight_version", json={"new_version": ["x"]}),
                 post("/generate", json={"text": "12+34=", "sampling_params": {}})]
    for r in cases:
        check_refused(c, r)
    if c.flavor == "sglang":
        for bad in ({"model_path": 5}, {"model_path": str(dirs["absent"])}):
            r = post("/update_weights_from_disk", json=bad)
            assert r.status_code == 400 and r.json()["success"] is False and r.json()["message"]
    assert c.version() == "default"
    assert c.counts() == (0, 0)
