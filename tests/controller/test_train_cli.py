"""`rollkeep train` end to end, through the real command line in subprocesses: the trace
it writes, graceful shutdown, and refusals that leave the run directory untouched."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from run_harness import DEFAULTS, FAST, ROOT

from rollkeep.trace import read_trace

pytestmark = pytest.mark.slow


def rollkeep(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("ROLLKEEP_CRASH_AT", None) if env is None or "ROLLKEEP_CRASH_AT" not in env else None
    return subprocess.run([sys.executable, "-m", "rollkeep", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def events(run_dir: Path) -> list[dict]:
    return read_trace(run_dir / "trace.jsonl")[0]


def test_train_writes_the_trace_and_resume_of_a_finished_run_is_a_no_op(tmp_path) -> None:
    run = tmp_path / "run"
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}")
    assert out.returncode == 0, out.stderr
    ev = events(run)
    started = [e for e in ev if e["event"] == "run_started"]
    assert started[0]["resumed_from_step"] is None and started[0]["checkpoint"] is None
    assert {"pid", "config_fingerprint", "run_id", "t"} <= started[0].keys()
    commits = [e for e in ev if e["event"] == "step_committed"]
    assert [c["step"] for c in commits] == list(range(1, 13))
    assert all(len(c["prompts"]) == 4 and all(len(p) == 2 for p in c["prompts"]) for c in commits)
    assert all(c["weight_version"] == c["step"] for c in commits)
    published = [e for e in ev if e["event"] == "checkpoint_published"]
    assert [p["step"] for p in published] == [2, 4, 6, 8, 10, 12]
    assert all(p["cut_hold_seconds"] >= 0 and p["write_seconds"] > 0 and p["bytes"] > 0 for p in published)
    finished = [e for e in ev if e["event"] == "run_finished"]
    assert finished[0]["step"] == 12 and len(finished[0]["weights_sha256"]) == 64
    for kind in ("taken", "admitted", "dispatched", "sealed", "finalizing", "ready", "claimed"):
        assert any(e["event"] == kind for e in ev), kind
    sealed = next(e for e in ev if e["event"] == "sealed")
    assert {"group_id", "generation", "attempt", "version"} <= sealed.keys()

    again = rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}")  # finished: nothing starts, nothing is traced
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"already finished at step 12; nothing to do (weights_sha256 "
                                   f"{finished[0]['weights_sha256']})"), again.stdout
    assert events(run) == ev


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_exits_143(tmp_path) -> None:
    run = tmp_path / "run"
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}", "checkpoint.every_steps=100", "engine.latency_ms=2",
                   env={"ROLLKEEP_CRASH_AT": "ledger.step_committed:5", "ROLLKEEP_CRASH_SIGNAL": "TERM"})
    # 128 + SIGTERM: a scheduler requeues the job instead of calling it finished.
    assert out.returncode == 143, out.stderr
    ev = events(run)
    finished = [e for e in ev if e["event"] == "run_finished"]
    # The signal lands at step 5's commit; the handler runs within a loop iteration or two.
    stopped = finished[-1]["step"]
    assert finished[-1]["reason"] == "signal" and 5 <= stopped < 12
    assert (f"stopped at step {stopped} by SIGTERM; a rerun resumes from checkpoint step_{stopped:06d}; "
            "run the same command to resume") in out.stdout
    assert [e["step"] for e in ev if e["event"] == "checkpoint_published"] == [stopped]
    # Work still generating at the stop was abandoned before the final cut: the checkpoint
    # holds no attempt in flight, and each abandonment is in the trace.
    ck = run / "checkpoints" / f"step_{stopped:06d}"
    groups = msgspec.msgpack.decode((ck / "ledger.msgpack").read_bytes())["groups"]
    assert all(1 not in bytes(g[10]) for g in groups)  # status 1 = DISPATCHED
    shutdown = [e for e in ev if e["event"] == "abandoned" and e["reason"] == "shutdown"]
    assert all(e["run_id"] == finished[-1]["run_id"] for e in shutdown)
    assert (run / "checkpoints" / "LATEST").read_text().strip() == f"step_{stopped:06d}"
    resumed = rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}", "checkpoint.every_steps=100")
    assert resumed.returncode == 0, resumed.stderr
    commits = [e for e in events(run) if e["event"] == "step_committed"]
    prompts = [tuple(p) for c in commits for p in c["prompts"]]
    assert [c["step"] for c in commits] == list(range(1, 13))
    assert len(prompts) == len(set(prompts)) == 48


@pytest.fixture
def finished_run(tmp_path) -> Path:
    run = tmp_path / "run"
    # Stop mid-run (SIGKILL at a step commit) so the checkpoint holds in-flight work.
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}", env={"ROLLKEEP_CRASH_AT": "ledger.step_committed:7"})
    assert out.returncode == -9
    return run


def test_corrupt_checkpoint_is_refused_and_nothing_changes(finished_run) -> None:
    ck = finished_run / "checkpoints" / (finished_run / "checkpoints" / "LATEST").read_text().strip()
    data = bytearray((ck / "ledger.msgpack").read_bytes())
    data[len(data) // 2] ^= 0x01
    (ck / "ledger.msgpack").write_bytes(bytes(data))
    before = tree_digest(finished_run)
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={finished_run}")
    assert out.returncode == 3
    assert out.stderr.startswith("error: ") and "ledger.msgpack" in out.stderr
    assert "Traceback" not in out.stderr
    assert tree_digest(finished_run) == before


def test_semantic_config_change_is_refused_with_a_dotted_diff(finished_run) -> None:
    before = tree_digest(finished_run)
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={finished_run}", "rollout.group_size=5")
    assert out.returncode == 3
    assert "rollout.group_size: 3 -> 5" in out.stderr
    assert "--allow-config-change rollout.group_size" in out.stderr
    assert tree_digest(finished_run) == before
    # A non-semantic change is fine, and naming the change lets it through.
    ok = rollkeep("train", DEFAULTS, *FAST, f"run_dir={finished_run}", "train.total_steps=13")
    assert ok.returncode == 0, ok.stderr


def test_edited_row_of_an_inflight_group_is_detected(tmp_path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "task": "arith"}) + "\n"
                            for i in range(40)))
    run = tmp_path / "run"
    over = [DEFAULTS, *FAST, f"run_dir={run}", f"data.path={data}"]
    out = rollkeep("train", *over, env={"ROLLKEEP_CRASH_AT": "ledger.step_committed:7"})
    assert out.returncode == -9
    ck = run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip()
    ledger = msgspec.msgpack.decode((ck / "ledger.msgpack").read_bytes())
    assert ledger["groups"], "the checkpoint should hold in-flight groups"
    epoch, ordinal, idx = ledger["groups"][0][:3]
    lines = data.read_text().splitlines()
    row = json.loads(lines[idx])
    row["answer"] = "wrong"
    lines[idx] = json.dumps(row)
    data.write_text("\n".join(lines) + "\n")
    before = tree_digest(run)
    refused = rollkeep("train", *over)
    assert refused.returncode == 3
    assert f"e{epoch}.{ordinal}" in refused.stderr and "row" in refused.stderr
    assert tree_digest(run) == before


def test_unknown_config_key_is_refused_before_anything_runs(tmp_path) -> None:
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}", "train.num_prompt_per_step=3")
    assert out.returncode == 2
    assert "did you mean `train.num_prompts_per_step`" in out.stderr
    assert not (tmp_path / "run").exists()


def test_chaos_random_sigkills_pass(tmp_path) -> None:
    """`rollkeep chaos` in CI: real SIGKILLs at random instants and crash points."""
    out = rollkeep("chaos", DEFAULTS, *FAST, "deterministic=true", "rollout.on_dropped_prompt=shrink",
                   "engine.latency_ms=3", "engine.latency_jitter_ms=3", "engine.infra_fail_rate=0.05",
                   "train.total_steps=10", "data.epochs=2", "data.generated.n_rows=20",
                   "--kills", "6", "--seed", "1", "--workdir", str(tmp_path / "chaos"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "duplicates: 0   lost: 0" in out.stdout
    assert "(== uninterrupted run)" in out.stdout
    # Every kill attempted lands (each is sized short of the run's end), the restarts are
    # the kills, and both epochs were checked prompt by prompt.
    landed, attempted = re.search(r"kills: (\d+) landed of (\d+) attempted", out.stdout).groups()
    assert landed == attempted and int(landed) >= 5
    assert f"{landed} restarts" in out.stdout
    assert "completed epochs checked: [0, 1]" in out.stdout


def test_a_second_writer_on_the_same_run_dir_is_refused(tmp_path) -> None:
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `rollkeep train` holds it
    try:
        out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}")
    finally:
        os.close(fd)
    assert out.returncode == 2 and "another process is running in" in out.stderr
    assert list(run.iterdir()) == []
    assert rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}").returncode == 0


def test_chaos_random_sigkills_in_long_generations_pass(tmp_path) -> None:
    """`rollkeep chaos` on streamed generations (issue 11): random SIGKILLs and crash points,
    among them `progressed` events, cut generations off mid-way; the resumed runs continue
    them from their tokens and the weights still end as a run never killed."""
    out = rollkeep("chaos", DEFAULTS, *FAST, "deterministic=true", "rollout.on_dropped_prompt=shrink",
                   "engine.completion_tokens=24", "engine.token_ms=0.3", "recovery.progress_ms=1",
                   "engine.infra_fail_rate=0.05",
                   "train.total_steps=10", "data.epochs=2", "data.generated.n_rows=20",
                   "--kills", "6", "--seed", "3", "--workdir", str(tmp_path / "chaos"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "duplicates: 0   lost: 0" in out.stdout
    assert "(== uninterrupted run)" in out.stdout


def test_chaos_random_sigkills_mid_episode_pass(tmp_path) -> None:
    """`rollkeep chaos` on the multi-turn calc environment (issue 12, configs/calc_toy.yaml):
    random SIGKILLs and crash points, among them `turn_sealed` events, land mid-episode; the
    resumed runs continue after the finished turns and the weights end as a run never killed."""
    out = rollkeep("chaos", str(ROOT / "configs" / "calc_toy.yaml"), "deterministic=true",
                   "rollout.on_dropped_prompt=shrink", "train.total_steps=10", "logger.progress=none",
                   f"run_dir={tmp_path / 'run'}",
                   "--kills", "5", "--seed", "4", "--workdir", str(tmp_path / "chaos"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "duplicates: 0   lost: 0" in out.stdout
    assert "(== uninterrupted run)" in out.stdout
