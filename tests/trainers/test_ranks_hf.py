"""A transformers model on trainer ranks (`trainer.name: hf`, `trainer.world_size: 2`); the
slower tier (`make test-ranks`)."""

from __future__ import annotations

import json
import os

import pytest
from test_grpo import group, row
from test_ranks import max_diff

from rollkeep.trainers import Batch, make_trainer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get("ROLLKEEP_TEST_RANKS"), reason="the slower tier: make test-ranks (ROLLKEEP_TEST_RANKS=1)")]


def test_a_transformers_model_on_two_ranks_takes_the_one_process_step(tmp_path) -> None:
    """`trainer.name: hf` on 2 ranks (GPT-2's decoder layers sharded, its tied head in
    the root): the step equals one process's, and its sharded checkpoint loads in one."""
    pytest.importorskip("transformers")
    from hf_fixture import make_tiny_hf_model

    from rollkeep.config import HFTrainerConfig

    path = make_tiny_hf_model(tmp_path / "model")
    conf = json.loads((path / "config.json").read_text())
    conf.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: one RNG per rank otherwise
    (path / "config.json").write_text(json.dumps(conf))

    def hf(world_size: int):
        cfg = HFTrainerConfig(model_path=str(path), world_size=world_size, micro_batch_size=2, lr=3e-4,
                              step_timeout_s=120)
        return make_trainer(cfg, temperature=1.0, seed=0, max_completion_length=8)

    one, two = hf(1), hf(2)
    try:
        _step_and_load(hf, one, two, tmp_path)
    finally:
        two.close()


def _step_and_load(hf, one, two, tmp_path) -> None:
    assert two.weights_sha256() == one.weights_sha256()
    batch = Batch(1, tuple(group(f"e0.{g}", [row([4, 5 + g], [6 + k, 7, 2], [-1.0, -2.0, -0.5], float(k % 2))
                                             for k in range(3)], (1.0, -1.0, 0.5)) for g in range(2)))
    m1, m2 = one.train_step(batch), two.train_step(batch)
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-6)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    assert max_diff(one, two) <= 1e-6
    (tmp_path / "ck").mkdir()
    two.snapshot().save(tmp_path / "ck")
    again = hf(1)
    again.load(tmp_path / "ck", step=1)
    assert again.weights_sha256() == two.weights_sha256()
