"""`trainer.off_policy` through the trainer (`GRPOTrainer.update`): on-policy every mode takes
the same step; off-policy, tis bounds each token's weight and takes the PPO ratio against
the step's starting weights; mis drops what is past the cap and nothing else; the
`off_policy/*` metrics are per version lag. (The formulas against TRL's and verl's are in
test_ports.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_grpo import PROMPT, TOK, group, grpo, mixed_batch, row, seq_logprobs, tiny_gpt

from rollkeep.models.tokenizer import EOS
from rollkeep.trainers import Batch


def max_diff(a, b) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def on_policy_batch(model) -> Batch:
    rows = []
    for k, text in enumerate(["2", "31", "4"]):
        completion = TOK.encode(text, bos=False) + [EOS]
        rows.append(row(PROMPT, completion, seq_logprobs(model, PROMPT, completion), reward=float(k == 0)))
    return Batch(1, (group("e0.0", rows, (1.0, -0.5, -0.5)),))


@pytest.mark.parametrize(("mode", "level"), [("tis", "token"), ("mis", "sequence")])
def test_on_policy_every_mode_takes_the_same_step(mode, level) -> None:
    """Behaviour = the trainer's weights: every weight is 1 and the proximal log-probs are
    the behaviour's, so tis and mis update exactly as none does (to float32 round-off)."""
    a, b = tiny_gpt(1), tiny_gpt(1)
    batch = on_policy_batch(a)
    ma = grpo(a, lr=1e-3).train_step(batch)
    mb = grpo(b, lr=1e-3, off_policy=mode, is_level=level, is_cap=1.5).train_step(batch)
    assert max_diff(a, b) <= 1e-6
    assert max_diff(a, tiny_gpt(1)) > 1e-4  # (it moved)
    assert ma["off_policy/mismatch_kl"] < 1e-9 and mb["off_policy/capped_share"] == 0.0
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-6)


def test_tis_takes_the_ratio_against_the_steps_own_weights() -> None:
    """A stale batch: under none the ratio is against the behaviour and the clip bites;
    under tis the first epoch's ratio is 1 (nothing clipped) and the weights carry the
    correction, a share of them at the cap."""
    model = tiny_gpt(2)
    batch = mixed_batch(model)
    none = grpo(tiny_gpt(2), lr=1e-3).train_step(batch)
    tis = grpo(tiny_gpt(2), lr=1e-3, off_policy="tis", is_cap=1.2).train_step(batch)
    assert none["clip_frac"] > 0 and tis["clip_frac"] == 0.0
    assert tis["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert 0 < tis["off_policy/capped_share"] < 1
    assert tis["off_policy/mismatch_kl"] == pytest.approx(none["off_policy/mismatch_kl"], rel=1e-6)
    assert tis["off_policy/ratio_max"] > 1.2  # reported before truncation


def test_mis_drops_exactly_the_sequences_past_the_cap() -> None:
    """Sequence-level mis with one sequence far off-policy (its behaviour log-probs 3 nats
    too low: w = e^(3 x tokens) > cap): the step equals the one where that sequence has no
    advantage (it still counts in the token mean's denominator, as masking keeps it)."""
    model = tiny_gpt(3)
    rows, advs = [], []
    for k, text in enumerate(["2", "31", "4"]):
        completion = TOK.encode(text, bos=False) + [EOS]
        lp = seq_logprobs(model, PROMPT, completion) - (3.0 if k == 1 else 0.0)
        rows.append(row(PROMPT, completion, lp, reward=float(k == 0)))
        advs.append([1.0, -0.5, -0.5][k])
    far = Batch(1, (group("e0.0", rows, advs),))
    silenced = Batch(1, (group("e0.0", rows, [advs[0], 0.0, advs[2]]),))
    a, b = tiny_gpt(3), tiny_gpt(3)
    ma = grpo(a, lr=1e-3, off_policy="mis", is_level="sequence", is_cap=2.0).train_step(far)
    grpo(b, lr=1e-3, off_policy="mis", is_level="sequence", is_cap=2.0).train_step(silenced)
    assert max_diff(a, b) <= 1e-6
    n_far = len(rows[1].completion_ids)
    assert ma["off_policy/capped_share"] == pytest.approx(n_far / sum(len(r.completion_ids) for r in rows))
    assert max_diff(a, tiny_gpt(3)) > 1e-4


def test_the_mismatch_is_reported_per_version_lag() -> None:
    """Tokens of version 1 (the trainer's, on-policy) and of version 0 (one behind,
    perturbed), the trainer at version 1."""
    model = tiny_gpt(4)
    trainer = grpo(model, lr=1e-3)
    trainer.rl_steps = 1  # the weights of version 1
    rng = np.random.default_rng(0)
    rows = []
    for k, text in enumerate(["2", "31", "4", "57"]):
        completion = TOK.encode(text, bos=False) + [EOS]
        lp = seq_logprobs(model, PROMPT, completion)
        r = row(PROMPT, completion, lp + (rng.normal(0, 0.5, len(lp)) if k % 2 else 0.0), reward=float(k % 2))
        rows.append(dataclasses.replace(r, versions=np.full(len(lp), 1 - k % 2, np.int32)))
    m = trainer.train_step(Batch(2, (group("e0.0", rows, (1.0, -1.0, 1.0, -1.0)),)))
    assert m["off_policy/mismatch_kl_lag0"] < 1e-9 < m["off_policy/mismatch_kl_lag1"]
    assert not any(k.startswith("off_policy/mismatch_kl_lag") for k in m if k[-1] not in "01")


def test_autocast_bf16_trains_and_keeps_float32_weights() -> None:
    """`autocast: bf16`: the forward in bfloat16, the weights and AdamW state in float32; the
    step in the float32 step's direction (bf16 has 8 bits of mantissa, and Adam's first
    step moves every weight by about lr whatever its gradient's size)."""
    a, b, start = tiny_gpt(5), tiny_gpt(5), tiny_gpt(5)
    batch = on_policy_batch(a)
    ta, tb = grpo(a, lr=1e-3), grpo(b, lr=1e-3, autocast="bf16")
    ta.train_step(batch)
    mb = tb.train_step(batch)
    assert all(p.dtype == torch.float32 for p in b.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in tb.optimizer.state.values())
    da, db = (torch.cat([(p - q).flatten() for p, q in zip(m.parameters(), start.parameters(), strict=True)])
              for m in (a, b))
    assert max_diff(a, b) > 0 and np.isfinite(mb["loss"])
    assert torch.nn.functional.cosine_similarity(da, db, dim=0) > 0.9


def test_off_policy_options_are_checked() -> None:
    with pytest.raises(ValueError, match="off_policy"):
        grpo(tiny_gpt(), off_policy="bogus")
    with pytest.raises(ValueError, match="is_cap"):
        grpo(tiny_gpt(), off_policy="tis", is_cap=1.0)
    with pytest.raises(ValueError, match="autocast"):
        grpo(tiny_gpt(), autocast="fp8")
