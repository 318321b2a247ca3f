"""Multi-turn episodes across real kills (issue 12, docs/design.md §5.4): a sibling cut off
mid-episode continues after its last durable finished turn (replayed, or restored from the
environment's snapshot), the run still trains on exactly the prompts of a run never killed,
and in deterministic mode it ends with exactly its weights."""

from __future__ import annotations

from pathlib import Path

import episode_envs
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

from rollkeep.cli import main
from rollkeep.core.checkpoint.rowindex import ROWS_INDEX, decode_index
from rollkeep.core.checkpoint.store import CheckpointStore

# Three-turn episodes of streamed 6-token turns: generation is the slow part, so episodes are
# in flight, between their turns, at every stop.
EPISODES = ["env.factory=episode_envs:CountEnv", "env.max_turns=3", "env.kwargs={turns: 3}",
            "engine.completion_tokens=6", "engine.token_ms=1", "recovery.progress_ms=1",
            "data.generated.n_rows=100", "train.total_steps=24"]
SNAPSHOT = [*EPISODES[1:], "env.factory=episode_envs:SnapCountEnv"]
DET = ["deterministic=true", "rollout.on_dropped_prompt=shrink", "sampler.name=in_order"]


def assert_episodes_whole(cfg, turns: int = 3) -> None:
    """Every trained sibling's row is a whole episode: `turns` model turns, the environment's
    answers between them, as the trace's turn_sealed events of its attempt counted them."""
    # Keyed by process too: a process that resumed an older checkpoint (a stop's restore
    # abandons the newer ones it cannot vouch for) runs the same attempt numbers again. An
    # attempt sealed with nothing resumed ran all its turns in the process that sealed it.
    seals = {(x["run_id"], x["group_id"], x["generation"], x["attempt"]): x for x in events(cfg, "sealed")}
    last_turn = {}
    for x in events(cfg, "turn_sealed"):
        last_turn[(x["run_id"], x["group_id"], x["generation"], x["attempt"])] = x
    for key, seal in seals.items():
        turn = last_turn.get(key)
        if seal["resumed_from"] == 0:
            assert turn is not None and turn["turn"] == turns - 2, f"{key}: all finished turns recorded"
        if turn is not None:
            assert turn["tokens"] < seal["tokens"], f"{key}: the last turn comes after the others"


@pytest.mark.parametrize("env", ["replay", "snapshot"])
def test_kills_mid_episode_continue_after_the_last_finished_turn(tmp_path, env) -> None:
    over = EPISODES if env == "replay" else SNAPSHOT
    cfg = config(tmp_path / "run", *over)
    assert run_child(cfg, "ledger.turn_sealed:150", crash_signal="TERM") == STOPPED
    assert killed(run_child(cfg, "ledger.turn_sealed:90"))
    assert run_child(cfg, "ledger.turn_sealed:70", crash_signal="TERM") == STOPPED
    assert killed(run_child(cfg, "ledger.sealed:10"))
    run_to_end(cfg)
    check(cfg)
    assert_episodes_whole(cfg)
    reused = [x["turns_reused"] for x in events(cfg, "restored")]
    assert sum(reused) > 0, f"stops between turns keep the finished ones: {reused}"
    continued = [x for x in events(cfg, "sealed") if x["resumed_from"]]
    assert continued and all(0 < x["resumed_from"] <= x["tokens"] for x in continued)


@pytest.mark.parametrize("env", ["replay", "snapshot"])
def test_deterministic_kills_mid_episode_end_byte_identical(tmp_path, env) -> None:
    over = [*(EPISODES if env == "replay" else SNAPSHOT), *DET]
    ref = config(tmp_path / "reference", *over)
    run_to_end(ref)
    cfg = config(tmp_path / "run", *over)
    assert run_child(cfg, "ledger.turn_sealed:120", crash_signal="TERM") == STOPPED
    assert killed(run_child(cfg, "ledger.turn_sealed:60"))
    assert run_child(cfg, "ledger.turn_sealed:40", crash_signal="TERM") == STOPPED
    run_to_end(cfg)
    check(cfg, final_sha(ref))
    assert sum(x["turns_reused"] for x in events(cfg, "restored")) > 0


def test_the_final_checkpoint_names_the_finished_turns_and_their_snapshots(tmp_path) -> None:
    cfg = config(tmp_path / "run", *SNAPSHOT)
    assert run_child(cfg, "ledger.turn_sealed:150", crash_signal="TERM") == STOPPED
    ck = CheckpointStore(Path(cfg.run_dir) / "checkpoints").open()
    chains = decode_index(ck.read(ROWS_INDEX)).chains
    turns = [link for chain in chains.values() for link in chain if link.turn >= 0]
    assert turns and all(link.snapshot and b'"n"' in link.snapshot for link in turns)
    run_to_end(cfg)
    (restored,) = events(cfg, "restored")
    assert restored["turns_reused"] == len(turns)
    check(cfg)


def test_a_replay_checkpoint_resumed_by_a_snapshot_environment_is_refused(tmp_path, capsys) -> None:
    """Its finished turns have no snapshot: the episode cannot be continued (exit 3)."""
    cfg = config(tmp_path / "run", *EPISODES)
    assert run_child(cfg, "ledger.turn_sealed:150", crash_signal="TERM") == STOPPED
    before = sorted(p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir())
    code = main(["train", DEFAULTS, *FAST, *SNAPSHOT, f"run_dir={cfg.run_dir}",
                 "--allow-config-change", "env.factory"])
    err = capsys.readouterr().err
    assert code == 3 and "has no usable environment snapshot" in err and "Traceback" not in err
    assert sorted(p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir()) == before


def test_a_damaged_snapshot_is_refused(tmp_path, capsys) -> None:
    cfg = config(tmp_path / "run", *SNAPSHOT)
    assert run_child(cfg, "ledger.turn_sealed:150", crash_signal="TERM") == STOPPED
    ck = CheckpointStore(Path(cfg.run_dir) / "checkpoints").open()
    index = ck.path / ROWS_INDEX
    data = index.read_bytes()
    at = data.index(b'{"n":')
    index.write_bytes(data[:at] + b'{"m":' + data[at + 5:])  # same length, another state
    code = main(["train", DEFAULTS, *FAST, *SNAPSHOT, f"run_dir={cfg.run_dir}"])
    err = capsys.readouterr().err
    assert code == 3 and "rows.index" in err and "Traceback" not in err


def test_environment_failures_are_data_failures(tmp_path) -> None:
    cfg = config(tmp_path / "run", *EPISODES, "env.factory=episode_envs:FlakyEnv",
                 "rollout.on_dropped_prompt=shrink")
    run_to_end(cfg)
    failed = events(cfg, "failed")
    assert failed and all(x["kind"] == "data" and "flaky environment" in x["error"] for x in failed)
    assert events(cfg, "dropped"), "an episode that fails every attempt spends its data budget"
    check(cfg)


def test_a_replay_environment_that_answers_differently_fails_the_attempt(tmp_path) -> None:
    """Declared `replay` but not deterministic: the resumed attempt's replay differs from the
    recorded responses, which is a data failure of that attempt, never a silent guess."""
    cfg = config(tmp_path / "run", *EPISODES, "env.factory=episode_envs:DriftingEnv")
    assert run_child(cfg, "ledger.turn_sealed:150", crash_signal="TERM") == STOPPED
    run_to_end(cfg)
    check(cfg)
    replays = [x for x in events(cfg, "failed") if "replayed turn" in x["error"]]
    assert replays and all(x["kind"] == "data" for x in replays)


@pytest.mark.parametrize("over, message", [
    (["env.factory=no_such_module:Env"], "cannot be imported"),
    (["env.factory=episode_envs:NoSuchEnv"], "has no attribute"),
    (["env.factory=episode_envs:CountEnv", "env.kwargs={colour: red}"], "cannot be called with env.kwargs"),
    (["env.factory=episode_envs:CountEnv", "env.name=calc"], "not both"),
    (["env.name=chess"], "built-in environment"),
    (["env.factory=json:JSONDecoder"], "does not build an environment"),
])
def test_environment_config_errors_are_start_up_errors(tmp_path, capsys, over, message) -> None:
    code = main(["train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}", *over])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_envs_are_importable_as_the_tests_use_them() -> None:
    assert episode_envs.CountEnv(turns=2).recovery == "replay"
