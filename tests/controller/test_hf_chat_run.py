"""`rollkeep train` with `data.chat_template: true` (issue 27): the hf engine and trainer on
the tiny offline model, whose tokenizer is built with a chat template; multi-turn episodes
rendered with it, a warm start on demonstrations rendered alike, a kill between turns, and
still every prompt trained exactly once."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from hf_fixture import make_tiny_hf_model  # noqa: E402
from run_harness import check, config, events, killed, run_child, run_to_end  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a context of 256: room for three turns and the template's tokens around two responses
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-chat-run"), n_positions=256)


def test_a_chat_template_run_with_episodes_survives_a_kill_and_trains_each_prompt_once(model_dir, tmp_path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7),
                                        "turns": ["1", "2", str(i + i % 7)]}) + "\n" for i in range(16)))
    cfg = config(tmp_path / "run", "engine.name=hf", f"engine.model_path={model_dir}", "engine.max_new_tokens=64",
                 "trainer.name=hf", f"trainer.model_path={model_dir}", "trainer.lr=1e-3", f"data.path={data}",
                 "data.chat_template=true", "train.total_steps=4", "warmup.sft_steps=2", "warmup.sft_batch_size=4",
                 "env.factory=episode_envs:CountEnv", "env.max_turns=3", "env.kwargs={turns: 3}",
                 "env.max_turn_tokens=3")
    assert killed(run_child(cfg, "ledger.turn_sealed:30"))
    run_to_end(cfg)
    report = check(cfg)
    assert report.steps == 4 and report.restarts == 1
    sealed = events(cfg, "turn_sealed")
    assert any(x["turn"] == 1 for x in sealed)  # two responses in an episode
    # a turn's tokens: at most 3 of the model's, then "[<eos>]\nUser: =1;\nAssistant:" (not "=1;" alone)
    assert all(x["tokens"] >= 20 for x in sealed if x["turn"] == 0)
    assert sum(x["turns_reused"] for x in events(cfg, "restored")) > 0  # replayed through the template
