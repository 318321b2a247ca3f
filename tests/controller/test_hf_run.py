"""The hf engine and trainer run the same GRPO job through the same controller, ledger and
checkpoints, on a tiny random transformers model built offline."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_fixture import make_tiny_hf_model  # noqa: E402
from run_harness import check, config, final_sha, killed, run_child, run_to_end, trace_lines  # noqa: E402
from trainer_files import as_dir, files_of

from rollkeep.config import load_config  # noqa: E402
from rollkeep.trainers.hf import HFTrainer  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"))


def data(tmp_path) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(
        json.dumps({"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7), "task": "arith"}) + "\n"
        for i in range(24)
    ))
    return str(path)


def hf_overrides(model_dir, tmp_path) -> list[str]:
    return [
        "engine.name=hf", f"engine.model_path={model_dir}", "engine.max_new_tokens=4",
        "trainer.name=hf", f"trainer.model_path={model_dir}", "trainer.lr=1e-3",
        f"data.path={data(tmp_path)}", "data.epochs=1", "train.total_steps=5",
        "warmup.sft_steps=3", "warmup.sft_batch_size=8",
    ]


def test_hf_job_survives_a_kill_and_trains_each_prompt_once(model_dir, tmp_path) -> None:
    over = hf_overrides(model_dir, tmp_path)
    cfg = config(tmp_path / "run", *over)
    assert killed(run_child(cfg, "ledger.step_committed:3"))
    run_to_end(cfg)
    report = check(cfg)
    assert report.steps == 5 and report.restarts == 1 and report.trained == 20


def test_hf_trainer_checkpoint_round_trip_is_bit_exact(model_dir, tmp_path) -> None:
    cfg = load_config(None, hf_overrides(model_dir, tmp_path))
    a = HFTrainer(cfg.trainer, temperature=1.0, seed=0)
    seqs = [(a.tokenizer.encode("1+2="), a.tokenizer.encode("3", bos=False) + [a.tokenizer.eos_id])] * 4
    a.sft_step(seqs, lr=1e-3)
    files = files_of(a.snapshot())
    b = HFTrainer(cfg.trainer, temperature=1.0, seed=1)
    assert b.weights_sha256() != a.weights_sha256()  # a trained and b did not
    b.load(as_dir(files))  # also sets the process's RNG (dropout) to a's state at the snapshot
    assert b.weights_sha256() == a.weights_sha256()
    rng = torch.get_rng_state()
    b.sft_step(seqs, lr=1e-3)
    torch.set_rng_state(rng)  # both trainers share this process's RNG: give a the same draw
    a.sft_step(seqs, lr=1e-3)
    assert b.weights_sha256() == a.weights_sha256()


def test_deterministic_hf_run_is_byte_identical_after_a_kill(model_dir, tmp_path) -> None:
    over = [*hf_overrides(model_dir, tmp_path), "deterministic=true", "rollout.on_dropped_prompt=shrink"]
    reference = config(tmp_path / "reference", *over)
    run_to_end(reference)
    cfg = config(tmp_path / "killed", *over)
    assert killed(run_child(cfg, "ledger.sealed:30"))
    run_to_end(cfg)
    check(cfg, final_sha(reference))


def test_deterministic_hf_episodes_are_byte_identical_after_kills_between_turns(model_dir, tmp_path) -> None:
    """The hf engine runs multi-turn episodes (issue 12): each turn continues the
    trajectory so far as a prefix; a kill between turns resumes after the finished ones.
    (The random model never writes EOS: env.max_turn_tokens ends its turns.)"""
    over = [*hf_overrides(model_dir, tmp_path), "engine.max_new_tokens=16", "warmup.sft_steps=0",
            "env.factory=episode_envs:CountEnv", "env.max_turns=3", "env.kwargs={turns: 3}",
            "env.max_turn_tokens=3", "deterministic=true", "rollout.on_dropped_prompt=shrink"]
    reference = config(tmp_path / "reference", *over)
    run_to_end(reference)
    cfg = config(tmp_path / "killed", *over)
    assert killed(run_child(cfg, "ledger.turn_sealed:50"))
    assert killed(run_child(cfg, "ledger.turn_sealed:25"))
    run_to_end(cfg)
    check(cfg, final_sha(reference))
    lines = [x for x in trace_lines(cfg) if x["event"] in ("turn_sealed", "restored")]
    assert any(x["event"] == "turn_sealed" and x["turn"] == 1 for x in lines)
