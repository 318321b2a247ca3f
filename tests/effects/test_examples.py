"""The effect examples against live servers, without a run: the LLM judge reward
(`rollkeep.tasks.judge`) against a fake judge, the sandbox server
(`rollkeep.envs.sandbox_server`) end to end as a subprocess, the sandbox environment
(`rollkeep.envs.sandbox`) on it, and their configs. Outside a run `effects.call` calls `fn`
with key "unrecorded" (and the examples send no key); `RecordingScope` stands in for the
runner where a test needs keys and answers from the record."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from effect_servers import ROOT, FakeJudge, RecordingScope, SandboxServer, fake_verdict, read_port

from rollkeep import effects
from rollkeep.envs.sandbox import SandboxEnv, contains_answer, extract_code
from rollkeep.tasks import judge

ROW = {"prompt": "37+45=", "answer": "82", "task": "arith"}


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture
def fake_judge(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeJudge]:
    with FakeJudge() as j:
        monkeypatch.setenv(judge.URL_VAR, j.url)
        monkeypatch.setenv(judge.MODEL_VAR, "fake-judge")
        monkeypatch.setenv(judge.TIMEOUT_VAR, "10")  # a loaded machine's answer; the `hang` tests set less
        yield j


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxServer]:
    with SandboxServer(tmp_path_factory.mktemp("sandbox"), "--idle-timeout-s", "120") as s:
        yield s


@pytest.fixture
def scope_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop on a thread of its own: the run's loop, as `effects.call_sync` sees it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def post(url: str, route: str, body: dict, key: str | None = None) -> httpx.Response:
    return httpx.post(f"{url}/{route}", json=body, headers={"Idempotency-Key": key} if key else {}, timeout=10,
                      trust_env=False)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10, trust_env=False).json()


# ----------------------------------------------------------------------------- the judge


def test_verdict_reads_the_first_word() -> None:
    for text in ("1", " 1.", "Yes", "yes, it is", "\nCorrect!"):
        assert judge.verdict(text) == 1.0, text
    for text in ("0", "no", "Incorrect", "", "   ", "10", "correctly", "maybe 1", "I think yes"):
        assert judge.verdict(text) == 0.0, text


def test_prompt_has_the_reference_when_the_row_has_one() -> None:
    with_ref = judge.prompt("82", ROW)
    assert "Problem: 37+45=\n" in with_ref and "Reference answer: 82\n" in with_ref
    assert "Answer to grade: 82\n" in with_ref
    assert "Reference answer" not in judge.prompt("82", {"prompt": "37+45="})
    assert fake_verdict(with_ref) == "1" and fake_verdict(judge.prompt("182", ROW)) == "0"
    with pytest.raises(ValueError, match="no `prompt`"):
        judge.prompt("82", {"answer": "82"})


def test_judge_scores_correct_1_and_wrong_0(fake_judge: FakeJudge) -> None:
    assert asyncio.run(judge.score("82", ROW)) == 1.0
    assert asyncio.run(judge.score("the sum is 82", ROW)) == 1.0
    assert asyncio.run(judge.score("83", ROW)) == 0.0
    assert judge.score_sync("82", ROW) == 1.0
    assert judge.score_sync("820", ROW) == 0.0
    # Outside a run the key is "unrecorded", which is not sent: each call is its own.
    assert fake_judge.calls == {"": 5}
    assert fake_judge.bodies[0] == {"model": "fake-judge", "prompt": judge.prompt("82", ROW),
                                    "max_tokens": judge.MAX_TOKENS, "temperature": 0}


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize(("mode", "error", "match"), [
    ("garbage", ValueError, "not JSON"),
    ("not_object", ValueError, "expected a completions response"),
    ("no_choices", ValueError, "expected a completions response"),
    ("huge", ValueError, "over 1048576 bytes"),
    ("huge_stream", ValueError, "over 1048576 bytes"),
    ("error500", RuntimeError, "HTTP 500"),
    ("hang", TimeoutError, "no answer within 0.5 s"),
])
def test_a_misbehaving_judge_raises(fake_judge: FakeJudge, mode: str, error: type, match: str, sync: bool,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake_judge.mode = mode
    if mode == "hang":
        monkeypatch.setenv(judge.TIMEOUT_VAR, "0.5")  # what it waits; the others answer at once
    with pytest.raises(error, match=match):
        if sync:
            judge.score_sync("82", ROW)
        else:
            asyncio.run(judge.score("82", ROW))


def test_no_judge_is_a_connection_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(judge.URL_VAR, f"http://127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}/v1/completions"):
        asyncio.run(judge.score("82", ROW))
    with pytest.raises(ConnectionError):
        judge.score_sync("82", ROW)


def test_bad_settings_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(judge.TIMEOUT_VAR, "soon")
    with pytest.raises(ValueError, match="ROLLKEEP_JUDGE_TIMEOUT_S='soon'"):
        judge.score_sync("82", ROW)
    monkeypatch.setenv(judge.TIMEOUT_VAR, "1")
    monkeypatch.setenv(judge.URL_VAR, "localhost:8000")
    with pytest.raises(ValueError, match="not an http"):
        judge.score_sync("82", ROW)


def test_judge_in_a_run_sends_the_key_and_is_answered_from_the_record(fake_judge: FakeJudge) -> None:
    async def episode(scope: RecordingScope) -> list[float]:
        effects.bind(scope)
        return [await judge.score("82", ROW), await judge.score("83", ROW)]

    async def main() -> tuple[list[float], list[float], RecordingScope]:
        scope = RecordingScope(asyncio.get_running_loop())
        first = await asyncio.create_task(episode(scope))  # a task: its own context, so bind stays in it
        scope.replay()
        again = await asyncio.create_task(episode(scope))
        return first, again, scope

    first, again, scope = asyncio.run(main())
    assert first == again == [1.0, 0.0]
    assert fake_judge.calls == {"k-0": 1, "k-1": 1}  # the replay reached no judge
    assert (scope.made, scope.answered) == (2, 2)


def test_judge_sync_in_a_run(fake_judge: FakeJudge, scope_loop: asyncio.AbstractEventLoop) -> None:
    scope = RecordingScope(scope_loop, prefix="s")
    effects.bind(scope)
    try:
        assert judge.score_sync("82", ROW) == 1.0
        scope.replay()
        assert judge.score_sync("82", ROW) == 1.0
    finally:
        effects.bind(None)
    assert fake_judge.calls == {"s-0": 1}


# -------------------------------------------------------------------- the sandbox server


def test_sandbox_runs_code_with_state_carried_over(sandbox: SandboxServer) -> None:
    sid = post(sandbox.url, "open", {"seed": 1, "prompt": "p"}).json()["session"]
    run = lambda code: post(sandbox.url, "run", {"session": sid, "code": code}).json()  # noqa: E731
    assert run("x = 41\nprint('set')") == {"stdout": "set\n", "ok": True, "error": ""}
    assert run("print(x + 1)") == {"stdout": "42\n", "ok": True, "error": ""}  # only the new code's output
    failed = run("y = 1\n1 / 0")
    assert failed["ok"] is False and failed["stdout"] == "" and "ZeroDivisionError" in failed["error"]
    assert "NameError: name 'y'" in run("print(y)")["error"]  # a failed run's code joined nothing
    assert run("print(x)")["stdout"] == "41\n"
    # `random` is seeded with the session's seed: the same (seed, code), the same output
    other = post(sandbox.url, "open", {"seed": 1, "prompt": "p"}).json()["session"]
    draw = {"code": "import random\nprint(random.random())"}
    assert (post(sandbox.url, "run", {"session": other, **draw}).json()["stdout"]
            == post(sandbox.url, "run", {"session": post(sandbox.url, "open", {"seed": 1, "prompt": "q"})
                                         .json()["session"], **draw}).json()["stdout"])


def test_sandbox_deduplicates_by_key(sandbox: SandboxServer) -> None:
    opened = [post(sandbox.url, "open", {"seed": 3, "prompt": "p"}, key="dedup-open").json() for _ in range(2)]
    assert opened[0] == opened[1]
    sid = opened[0]["session"]
    body = {"session": sid, "code": "n = 1\nprint('ran')"}
    answers = [post(sandbox.url, "run", body, key="dedup-run").json() for _ in range(2)]
    assert answers[0] == answers[1] == {"stdout": "ran\n", "ok": True, "error": ""}
    # The same key with another body (a turn regenerated at the same place) is run.
    other = post(sandbox.url, "run", {"session": sid, "code": "print(n + 1)"}, key="dedup-run").json()
    assert other["stdout"] == "2\n"
    s = stats(sandbox.url)
    assert s["calls"]["dedup-open"] == 2 and s["executions"]["dedup-open"] == 1
    assert s["calls"]["dedup-run"] == 3 and s["executions"]["dedup-run"] == 2


def test_sandbox_bounds_time_and_output_and_refuses_unknown_sessions(tmp_path: Path) -> None:
    with SandboxServer(tmp_path, "--run-timeout-s", "1.5", "--max-output-bytes", "1000") as bounded:
        sid = post(bounded.url, "open", {"seed": 0, "prompt": "p"}).json()["session"]
        hung = post(bounded.url, "run", {"session": sid, "code": "while True:\n    pass"}).json()
        assert hung == {"stdout": "", "ok": False, "error": "timed out after 1.5 s"}
        loud = post(bounded.url, "run", {"session": sid, "code": "print('x' * 5000)"}).json()
        assert loud["ok"] is False and loud["error"] == "stdout over 1000 bytes" and len(loud["stdout"]) == 1000
        missing = post(bounded.url, "run", {"session": "nope", "code": "print(1)"})
        assert missing.status_code == 404 and "no session 'nope'" in missing.json()["error"]


def test_sandbox_server_stops_when_idle(tmp_path: Path) -> None:
    server = SandboxServer(tmp_path, "--idle-timeout-s", "0.3")
    try:
        assert server.proc.wait(15) == 0
        assert "stopped (idle for 0.3 s)" in server.output()
    finally:
        server.stop()


def test_sandbox_server_stops_when_its_parent_exits(no_hang: None) -> None:
    # A parent that starts the server, passes its port line on once it serves, and exits.
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys\n"
         "p = subprocess.Popen([sys.executable, '-m', 'rollkeep.envs.sandbox_server', '--port', '0'], "
         "stdout=subprocess.PIPE, stderr=sys.stderr)\n"
         "sys.stdout.buffer.write(p.stdout.readline())"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PYTHONPATH": str(ROOT / "src")})
    try:
        port = read_port(parent, 30, lambda: parent.stderr.read().decode() if parent.stderr else "")
        assert parent.wait(10) == 0
        # The orphaned server closes its end of the pipes when it stops: stderr then ends.
        assert b"stopped (the parent process exited)" in parent.stderr.read()  # type: ignore[union-attr]
        with pytest.raises(httpx.ConnectError):
            stats(f"http://127.0.0.1:{port}")
    finally:
        parent.kill()
        parent.wait()
        for pipe in (parent.stdout, parent.stderr):
            if pipe is not None:
                pipe.close()


# ---------------------------------------------------------------------- the sandbox env


def test_extract_code_and_contains_answer() -> None:
    assert extract_code("let me compute\n```python\nprint(6*7)\n```\ndone", max_chars=100) == "print(6*7)\n"
    assert extract_code("```\nx = 1\n```", max_chars=100) == "x = 1\n"
    assert extract_code("print(1)", max_chars=100) == "print(1)"
    assert extract_code("x" * 50, max_chars=10) == "x" * 10
    assert contains_answer("the answer is 82.", "82") and contains_answer("82\n", "82")
    assert not contains_answer("182", "82") and not contains_answer("820", "82") and not contains_answer("x", "")


def test_sandbox_env_episode(sandbox: SandboxServer) -> None:
    env = SandboxEnv(url=sandbox.url, max_turns=3)
    env.reset(ROW, seed=7)
    first = env.step("I will add.\n```python\ns = 37 + 45\n```")
    assert first == (("", False, 0.0))
    second = env.step("```python\nprint(t)\n```")
    assert second.done is False and second.response == "error: NameError: name 't' is not defined\n"
    last = env.step("```python\nprint(s)\n```")
    assert last == ("82\n", True, 1.0)  # the state of the first turn, the answer in the stdout


def test_sandbox_env_ends_after_its_turns(sandbox: SandboxServer) -> None:
    env = SandboxEnv(url=sandbox.url, max_turns=2)
    env.reset(ROW, seed=0)
    assert env.step("print(1)") == ("1\n", False, 0.0)
    assert env.step("print(2)") == ("2\n", True, 0.0)
    env.reset(ROW, seed=0)  # the answer in the model's text ends it too
    assert env.step("82") == ("", True, 1.0)


def test_sandbox_env_refuses_what_it_cannot_use(sandbox: SandboxServer) -> None:
    with pytest.raises(ValueError, match="max_turns must be positive"):
        SandboxEnv(url=sandbox.url, max_turns=0)
    with pytest.raises(ValueError, match="not an http"):
        SandboxEnv(url="127.0.0.1:8765")
    with pytest.raises(ValueError, match="no answer"):
        SandboxEnv(url=sandbox.url).reset({"prompt": "p"}, 0)
    with pytest.raises(RuntimeError, match="before reset"):
        SandboxEnv(url=sandbox.url).step("print(1)")


def test_sandbox_env_replay_is_answered_from_the_record(sandbox: SandboxServer,
                                                        scope_loop: asyncio.AbstractEventLoop) -> None:
    scope = RecordingScope(scope_loop, prefix="replay")
    effects.bind(scope)
    try:
        env = SandboxEnv(url=sandbox.url, max_turns=4)
        env.reset(ROW, seed=5)
        turns = ["```python\ns = 37\n```", "```python\nprint(s)\n```"]
        steps = [env.step(t) for t in turns]
        before = stats(sandbox.url)
        assert before["executions"]["replay-0"] == 1 and before["executions"]["replay-2"] == 1
        # A restore: a fresh environment, reset and given the recorded turns again.
        scope.replay()
        fresh = SandboxEnv(url=sandbox.url, max_turns=4)
        fresh.reset(ROW, seed=5)
        assert [fresh.step(t) for t in turns] == steps
        assert stats(sandbox.url) == before  # the server saw nothing of the replay
        # The episode's next, new turn runs on the server's session, the state intact.
        assert fresh.step("```python\nprint(s + 45)\n```") == ("82\n", True, 1.0)
        assert stats(sandbox.url)["executions"]["replay-3"] == 1
        assert (scope.made, scope.answered) == (4, 3)
    finally:
        effects.bind(None)


# ------------------------------------------------------------------------------ configs


@pytest.mark.parametrize("name", ["judge", "sandbox"])
def test_configs_load_and_resolve(name: str) -> None:
    from rollkeep.config.loading import load_config
    from rollkeep.envs import resolve as resolve_env
    from rollkeep.tasks.custom import resolve as resolve_reward

    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    if name == "judge":
        assert cfg.reward.fn == "rollkeep.tasks.judge:score"
        assert resolve_reward(cfg.reward.fn).__name__ == "score"
        assert cfg.env.name is None and cfg.env.factory is None
    else:
        assert cfg.env.factory == "rollkeep.envs.sandbox:SandboxEnv"
        assert cfg.env.kwargs == {"url": "http://127.0.0.1:8765"}
        spec = resolve_env(cfg.env)  # builds a sample environment: contacts no server
        assert spec is not None and spec.recovery == "replay"


def test_effect_servers_script_announces_its_port() -> None:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("effect_servers.py"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        port = read_port(proc, 30, lambda: "")
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", trust_env=False, timeout=10,
                           json={"model": "m", "prompt": judge.prompt("82", ROW)}).json()
        assert reply["choices"][0]["text"] == "1"
        assert json.loads(httpx.get(f"http://127.0.0.1:{port}/stats", trust_env=False).text) == {"calls": {"": 1}}
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
