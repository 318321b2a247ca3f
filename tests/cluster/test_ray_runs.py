"""Runs whose engine replicas are Ray actors (`cluster.backend: ray`), on the session's
local Ray: the same custody guarantees as one local engine, a replica killed with
SIGKILL mid-run, elastic resume (2 replicas -> local -> 3), and deterministic runs that
end byte-identical to a local one whichever replica ran what."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from run_harness import (
    DEFAULTS,
    FAST,
    STOPPED,
    check,
    config,
    events,
    final_sha,
    killed,
    run_child,
    run_to_end,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]
# The longest two (about a minute of Ray runs together) run in `make test-ranks`; the
# replica kill, the byte-identical torch replicas and the elastic resume stay in `make test`.
SLOWER_TIER = pytest.mark.skipif(not os.environ.get("ROLLKEEP_TEST_RANKS"),
                                 reason="the slower tier: make test-ranks (ROLLKEEP_TEST_RANKS=1)")
CALC_TOY = str(Path(__file__).resolve().parents[2] / "configs" / "calc_toy.yaml")

TORCH = [
    "engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=4",
    "trainer.model.n_layer=1", "trainer.model.n_head=2", "trainer.model.n_embd=32",
    "trainer.model.block_size=16", "trainer.micro_batch_size=8",
    "rollout.group_size=4", "train.num_prompts_per_step=4", "train.total_steps=6",
    "checkpoint.every_steps=2", "warmup.sft_steps=0", "data.generated.n_rows=64", "data.epochs=null",
    "deterministic=true", "rollout.on_dropped_prompt=shrink",
]
TOY_DET = ["deterministic=true", "rollout.on_dropped_prompt=shrink", "engine.latency_ms=2"]


def on_ray(address: str, replicas: int) -> list[str]:
    return ["cluster.backend=ray", f"cluster.address={address}", f"engine.replicas={replicas}",
            "cluster.replica_cpus=0.25"]


def replicas_that_sealed(cfg) -> Counter:
    return Counter(x["replica"] for x in events(cfg, "sealed"))


def test_two_toy_replicas_keep_custody_exactly_once(tmp_path, ray_address) -> None:
    cfg = config(tmp_path / "run", *on_ray(ray_address, 2), "engine.latency_ms=5", "engine.infra_fail_rate=0.05")
    run_to_end(cfg)
    check(cfg)
    started = events(cfg, "engine_replica_started")
    assert sorted(x["replica"] for x in started) == [0, 1]
    assert all(x["pid"] > 0 and x["node"] and x["restart"] == 0 for x in started)
    assert set(replicas_that_sealed(cfg)) == {0, 1}  # the pool used both
    record = json.loads((Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["engine/replicas_live"] == 2 and "replica/1/attempts" in record


def test_two_torch_replicas_end_byte_identical_to_one_local_engine(tmp_path, ray_address) -> None:
    """Sampling is a function of (seed, position, weights): not of the replica or the batch."""
    local = config(tmp_path / "local", *TORCH)
    run_to_end(local)
    cfg = config(tmp_path / "ray", *TORCH, *on_ray(ray_address, 2))
    run_to_end(cfg)
    check(cfg, final_sha(local))
    assert set(replicas_that_sealed(cfg)) == {0, 1}


def _follow(cfg, alive, on_event) -> None:
    """Follow the run's trace as its process writes it, passing each event to `on_event`
    until it returns True. Fails if the run ends first."""
    trace = Path(cfg.run_dir) / "trace.jsonl"
    seen = 0
    while True:
        ended = not alive()  # (read after this: a run that ended has written all its lines)
        lines = trace.read_text().splitlines() if trace.exists() else []
        for line in lines[seen:]:
            try:
                x = json.loads(line)
            except ValueError:
                break  # a line still being written: read it again next time
            seen += 1
            if on_event(x):
                return
        if ended:
            raise AssertionError("the run ended before the event the test waits for")
        threading.Event().wait(0.005)  # polling a file another process writes


def _kill_replica_when_it_seals(cfg, replica: int, alive) -> int:
    """Once `replica` sealed an attempt, SIGKILL its process. Returns the pid killed."""
    pid: list[int] = []

    def on_event(x: dict) -> bool:
        if x["event"] == "engine_replica_started" and x["replica"] == replica:
            pid[:] = [x["pid"]]
        elif x["event"] == "sealed" and x["replica"] == replica and pid:
            os.kill(pid[0], signal.SIGKILL)
            return True
        return False

    _follow(cfg, alive, on_event)
    return pid[0]


def _child(cfg) -> tuple[threading.Thread, list[int]]:
    """`run_child(cfg)` in a thread; the list gets its exit code."""
    code: list[int] = []
    child = threading.Thread(target=lambda: code.append(run_child(cfg)))
    child.start()
    return child, code


def test_a_replica_killed_mid_run_fails_its_attempts_as_infra_and_comes_back_refit(tmp_path, ray_address) -> None:
    # The run cannot end before the killed replica is back: its 1000 steps of 100 ms take
    # longer than a run child may live (120 s). The test waits for the restart in the
    # trace, then stops the run with SIGTERM and finishes it on the local backend a few
    # steps later, to compare with a run nobody touched. (A restarted actor needs seconds,
    # more on a loaded machine: Ray runs it at nice 15.)
    base = ["engine.latency_ms=20", "data.generated.n_rows=300", "data.epochs=null", *TOY_DET[:2]]
    cfg = config(tmp_path / "run", *on_ray(ray_address, 2), *base, "train.total_steps=1000",
                 "trainer.step_sleep_ms=100")
    child, code = _child(cfg)
    try:
        pid = _kill_replica_when_it_seals(cfg, 0, child.is_alive)
        _follow(cfg, child.is_alive, lambda x: x["event"] == "engine_replica_started" and x["replica"] == 0
                and x["restart"] == 1)
        os.kill(events(cfg, "run_started")[0]["pid"], signal.SIGTERM)  # (still ours: not yet waited for)
    finally:
        child.join()
    assert code == [STOPPED]
    died = events(cfg, "engine_replica_died")
    assert [x["replica"] for x in died] == [0] and not died[0]["gone"]
    back = [x for x in events(cfg, "engine_replica_started") if x["replica"] == 0]
    assert [x["restart"] for x in back] == [0, 1] and back[0]["pid"] == pid != back[1]["pid"]
    assert back[1]["down_seconds"] is not None and back[1]["down_seconds"] >= 0
    failed = [x for x in events(cfg, "failed") if "engine replica 0 died" in x["error"]]
    assert len(failed) == died[0]["attempts_failed"] and all(x["kind"] == "infra" for x in failed)
    # (`train.total_steps` and `cluster.*` are not semantic: the run resumes with others.)
    total = f"train.total_steps={events(cfg, 'run_finished')[-1]['step'] + 2}"
    finished = config(tmp_path / "run", *base, total)
    run_to_end(finished)
    reference = config(tmp_path / "reference", *base, total)
    run_to_end(reference)
    check(finished, final_sha(reference))  # exactly once, and the weights of a run nobody touched


def test_elastic_resume_two_replicas_then_local_then_three(tmp_path, ray_address) -> None:
    """Custody is per attempt, never per worker: a run checkpointed with 2 replicas resumes
    on the local backend and then on 3, with no --allow-config-change, exactly once."""
    base = ["train.total_steps=16", "data.generated.n_rows=120", *TOY_DET]
    reference = config(tmp_path / "reference", *base)
    run_to_end(reference)
    run_dir = tmp_path / "run"
    assert killed(run_child(config(run_dir, *base, *on_ray(ray_address, 2)), "ledger.sealed:60"))
    assert killed(run_child(config(run_dir, *base), "ledger.sealed:40"))  # (of the 130 or more left)
    cfg = config(run_dir, *base, *on_ray(ray_address, 3))
    run_to_end(cfg)
    report = check(cfg, final_sha(reference))
    assert report.restarts == 2
    assert set(replicas_that_sealed(cfg)) == {0, 1, 2}


def test_with_every_replica_gone_the_run_stops_with_a_final_checkpoint_and_exit_5(tmp_path, ray_address) -> None:
    base = ["engine.latency_ms=20", "train.total_steps=20", "trainer.step_sleep_ms=100", "data.generated.n_rows=200"]
    cfg = config(tmp_path / "run", *base, *on_ray(ray_address, 1), "cluster.max_restarts=0")
    child, code = _child(cfg)
    try:
        _kill_replica_when_it_seals(cfg, 0, child.is_alive)
    finally:
        child.join()
    assert code == [5]
    assert [x["gone"] for x in events(cfg, "engine_replica_died")] == [True]
    finished = events(cfg, "run_finished")[-1]
    assert finished["reason"] == "no engine replica" and finished["step"] < 20
    assert not [x for x in events(cfg, "dropped")]  # nothing spent its budget on the dead pool
    # The final checkpoint is good: the run resumes, here on the local backend, exactly once.
    resumed = config(tmp_path / "run", *base)
    run_to_end(resumed)
    check(resumed)


def test_replicas_that_cannot_be_placed_are_exit_5_and_nothing_is_written(tmp_path, ray_address) -> None:
    # (`rollkeep train` in a process of its own: a test process that was a Ray driver forks
    # broken children, and every other run here is forked.)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rollkeep", "train", DEFAULTS, *FAST, f"run_dir={run_dir}",
                           *on_ray(ray_address, 2), "cluster.replica_cpus=64", "cluster.replica_timeout_s=1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 5, done.stderr[-2000:]
    assert "the engine replicas did not start" in done.stderr and "Traceback" not in done.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())


@SLOWER_TIER
def test_chaos_with_controller_and_replica_kills_mixed(tmp_path, ray_address) -> None:
    from rollkeep.chaos import run_chaos

    overrides = [*FAST, f"run_dir={tmp_path}", *on_ray(ray_address, 2), "train.total_steps=16",
                 "data.generated.n_rows=120", "engine.latency_ms=5", "trainer.step_sleep_ms=20", *TOY_DET[:2]]
    report = run_chaos(DEFAULTS, overrides, kills=3, replica_kills=3, seed=1, log=lambda *_: None)
    assert report.passed, "\n".join(report.lines())
    assert report.replica_kills >= 1 and sum(k.killed for k in report.kills) >= 1
    assert report.weights_sha256 == report.reference_sha256


def test_multi_turn_episodes_on_two_replicas_continue_across_a_kill(tmp_path, ray_address) -> None:
    """An episode's turns may run on different replicas; the pool gives episodes its
    replicas' tokenizer and limits; a killed controller's finished turns are continued."""
    from rollkeep.config import load_config

    calc = ["deterministic=true", "rollout.on_dropped_prompt=shrink", "engine.infra_fail_rate=0",
            "engine.data_fail_rate=0", "logger.progress=none", "train.total_steps=10", "checkpoint.every_steps=3"]
    reference = load_config(CALC_TOY, [*calc, f"run_dir={tmp_path / 'reference'}"])
    run_to_end(reference)
    cfg = load_config(CALC_TOY, [*calc, f"run_dir={tmp_path / 'run'}", *on_ray(ray_address, 2)])
    assert killed(run_child(cfg, "ledger.turn_sealed:60"))
    run_to_end(cfg)
    check(cfg, final_sha(reference))
    assert events(cfg, "restored")[-1]["turns_reused"] > 0
    assert set(replicas_that_sealed(cfg)) == {0, 1}


@SLOWER_TIER
def test_the_hf_engine_runs_on_two_replicas(tmp_path, ray_address) -> None:
    pytest.importorskip("transformers")
    from hf_fixture import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path / "tiny")
    rows = tmp_path / "data.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7), "task": "arith"}) + "\n"
                            for i in range(24)))
    cfg = config(tmp_path / "run", "engine.name=hf", f"engine.model_path={model}", "engine.max_new_tokens=4",
                 "trainer.name=hf", f"trainer.model_path={model}", f"data.path={rows}", "train.total_steps=4",
                 *on_ray(ray_address, 2))
    assert killed(run_child(cfg, "ledger.step_committed:2"))
    run_to_end(cfg)
    report = check(cfg)
    assert report.steps == 4 and report.trained == 16
    assert set(replicas_that_sealed(cfg)) == {0, 1}
