"""Server mode end to end: the GRPO job on a tiny transformers model, generating on two
`rollkeep serve` processes over loopback HTTP. The controller is SIGKILLed while the servers
keep running, a server is SIGKILLed mid-run, every server goes away: each time the resumed
run trains every prompt exactly once, and the servers are fenced before they get work."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from hf_fixture import make_tiny_hf_model  # noqa: E402
from run_harness import check, config, final_sha, killed, run_child, run_to_end, trace_lines  # noqa: E402
from servers import Server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("remote")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def fleet(request, model_dir, tmp_path):
    flavor = getattr(request, "param", "vllm")
    servers = [Server(model_dir, tmp_path, flavor=flavor) for _ in range(2)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def overrides(model_dir, tmp_path, servers: list[Server], *extra: str) -> list[str]:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7), "task": "arith"}) + "\n"
                            for i in range(24)))
    return [
        "engine.name=remote", f"engine.flavor={servers[0].flavor}",
        "engine.servers=[" + ",".join(f'"{s.url}"' for s in servers) + "]",
        f"engine.tokenizer_path={model_dir}", "engine.max_new_tokens=4", "engine.request_timeout_s=30",
        "trainer.name=hf", f"trainer.model_path={model_dir}", "trainer.lr=1e-3",
        f"data.path={path}", "data.epochs=1", "train.total_steps=5", "warmup.sft_steps=0", *extra,
    ]


def fences(cfg) -> list[dict]:
    return [x for x in trace_lines(cfg) if x["event"] == "server_fenced"]


@pytest.mark.parametrize("fleet", ["vllm", "sglang"], indirect=True)
def test_a_controller_killed_mid_run_resumes_exactly_once_on_the_running_servers(fleet, model_dir, tmp_path) -> None:
    cfg = config(tmp_path / "run", *overrides(model_dir, tmp_path, fleet))
    assert killed(run_child(cfg, "ledger.step_committed:3"))
    assert all(s.proc.poll() is None for s in fleet)  # the fleet outlives the controller
    first = fences(cfg)
    assert sorted(f["server"] for f in first) == sorted(s.url for s in fleet)
    run_to_end(cfg)
    report = check(cfg)
    assert report.steps == 5 and report.restarts == 1 and report.trained == 20
    lines = trace_lines(cfg)
    second = [f for f in fences(cfg) if f["run_id"] != first[0]["run_id"]]
    assert sorted(f["server"] for f in second) == sorted(s.url for s in fleet)
    restored = [x for x in lines if x["event"] == "restored"][-1]
    # every server was set back to the restored checkpoint's weights before it got work
    assert all(f["set"].startswith(f"rollkeep:{restored['step']}:") for f in second)
    seals = [x for x in lines if x["event"] == "sealed"]
    assert seals and {x["server"] for x in seals} <= {s.url for s in fleet}
    assert (tmp_path / "run" / "weights" / f"v{report.steps}" / "WEIGHTS.json").is_file()


def test_a_graceful_restart_reloads_nothing(fleet, model_dir, tmp_path) -> None:
    cfg = config(tmp_path / "run", *overrides(model_dir, tmp_path, fleet))
    assert run_child(cfg, "ledger.step_committed:3", crash_signal="TERM") == 128 + 15  # a final checkpoint
    run_to_end(cfg)
    runs = {}
    for f in fences(cfg):
        runs.setdefault(f["run_id"], []).append(f)
    assert len(runs) == 2
    _, again = runs.values()
    assert all(f["found"] == f["set"] for f in again)  # the servers held the checkpoint's weights already
    assert check(cfg).trained == 20


def test_a_server_killed_mid_run_loses_nothing(fleet, model_dir, tmp_path) -> None:
    cfg = config(tmp_path / "run", *overrides(model_dir, tmp_path, fleet, "train.total_steps=5"))
    # kill server 0 from inside the run, at its 20th seal: its attempts fail as infra and are
    # retried on server 1, which finishes the run
    import os
    import signal

    from rollkeep.core import crashpoints

    seals = {"n": 0}

    def handler(name: str) -> None:  # (in the run's process: it is forked with the handler set)
        if name == "ledger.sealed":
            seals["n"] += 1
            if seals["n"] == 20:
                os.killpg(fleet[0].proc.pid, signal.SIGKILL)

    crashpoints.set_handler(handler)
    try:
        run_to_end(cfg)
    finally:
        crashpoints.set_handler(None)
    lines = trace_lines(cfg)
    assert check(cfg).trained == 20
    lost = [x for x in lines if x["event"] == "server_lost"]
    assert lost and lost[0]["server"] == fleet[0].url


def test_no_server_left_stops_with_exit_5_and_resumes_exactly_once(fleet, model_dir, tmp_path) -> None:
    over = overrides(model_dir, tmp_path, fleet, "engine.unavailable_timeout_s=2", "engine.request_timeout_s=5")
    cfg = config(tmp_path / "run", *over)
    assert killed(run_child(cfg, "ledger.step_committed:2"))
    urls = [s.url for s in fleet]
    for s in fleet:
        s.stop()
    def tree() -> dict:
        return {str(p): p.stat().st_size for p in (tmp_path / "run").rglob("*") if p.is_file()}

    before = tree()
    from rollkeep.cli import exit_code
    from rollkeep.controller import train
    from rollkeep.core.errors import ExternalError

    with pytest.raises(ExternalError, match="engine.unavailable_timeout_s=2") as e:  # no server answers
        train(cfg)
    assert exit_code(e.value) == 5
    assert tree() == before  # nothing changed
    fleet[:] = [Server(model_dir, tmp_path, flavor=fleet[0].flavor, port=int(u.rsplit(":", 1)[1])) for u in urls]
    run_to_end(cfg)
    assert check(cfg).trained == 20


def test_deterministic_remote_run_is_byte_identical_after_a_kill(fleet, model_dir, tmp_path) -> None:
    extra = ("deterministic=true", "rollout.on_dropped_prompt=shrink")
    reference = config(tmp_path / "reference", *overrides(model_dir, tmp_path, fleet, *extra))
    run_to_end(reference)
    cfg = config(tmp_path / "killed", *overrides(model_dir, tmp_path, fleet, *extra))
    assert killed(run_child(cfg, "ledger.sealed:30"))
    run_to_end(cfg)
    check(cfg, final_sha(reference))


def test_server_and_controller_kills_mixed_lose_nothing(fleet, model_dir, tmp_path) -> None:
    """One lineage: server 0 SIGKILLed mid-run, then the controller, then server 1 while
    the restarted controller runs with server 0 back on its port."""
    import os
    import signal

    from rollkeep.core import crashpoints

    cfg = config(tmp_path / "run", *overrides(model_dir, tmp_path, fleet))
    counts = {"ledger.sealed": 0, "ledger.step_committed": 0}

    def first(name: str) -> None:  # (runs in the forked controller)
        if name in counts:
            counts[name] += 1
            if name == "ledger.sealed" and counts[name] == 15:
                os.killpg(fleet[0].proc.pid, signal.SIGKILL)
            if name == "ledger.step_committed" and counts[name] == 3:
                os.kill(os.getpid(), signal.SIGKILL)

    crashpoints.set_handler(first)
    try:
        assert killed(run_child(cfg))
    finally:
        crashpoints.set_handler(None)
    port = int(fleet[0].url.rsplit(":", 1)[1])
    fleet[0].stop()
    fleet[0] = Server(model_dir, tmp_path, flavor=fleet[1].flavor, port=port)
    counts["ledger.sealed"] = 0

    def second(name: str) -> None:
        if name == "ledger.sealed":
            counts[name] += 1
            if counts[name] == 10:
                os.killpg(fleet[1].proc.pid, signal.SIGKILL)

    crashpoints.set_handler(second)
    try:
        run_to_end(cfg)
    finally:
        crashpoints.set_handler(None)
    report = check(cfg)
    assert report.trained == 20 and report.restarts == 1
    lost = [x["server"] for x in trace_lines(cfg) if x["event"] == "server_lost"]
    assert fleet[0].url in lost and fleet[1].url in lost
