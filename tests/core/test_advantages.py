"""Reward scaling (`trainer.scale_rewards`): each mode against its formula, written out here
with numpy; groups without signal exactly zero in every mode; stored advantages
group-centred and bounded by mode; the controller stores what the mode says and a killed
and resumed run trains on the same advantages."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from run_harness import check, config, final_sha, killed, run_child, run_to_end

from rollkeep.advantages import SCALE_REWARDS, batch_scaled, group_advantages, stored_advantages
from rollkeep.controller import Runner
from rollkeep.controller.build import build
from rollkeep.trainers.toy import ToyTrainer

EPS = 1e-6


def random_groups(seed: int):
    """Groups of 2..9 rewards on scales from 1e-3 to 1e3: binary, partial credit, real."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(40):
        G = int(rng.integers(2, 10))
        kind = rng.integers(3)
        r = (rng.integers(0, 2, G).astype(float) if kind == 0
             else rng.integers(0, 5, G) / 4.0 if kind == 1
             else rng.normal(0, 1, G))
        out.append([float(x) for x in r * 10.0 ** rng.integers(-3, 4)])
    return out


@pytest.mark.parametrize("mode", SCALE_REWARDS)
def test_each_mode_matches_its_formula(mode):
    for rewards in random_groups(0):
        r = np.array(rewards)
        got = np.array(stored_advantages(rewards, mode))
        if r.max() == r.min():
            assert (got == 0).all()
            continue
        centred = r - r.mean()
        want = {
            "group_population": centred / (r.std(ddof=0) + EPS),
            "group": centred / (r.std(ddof=1) + EPS),
            "batch": centred,  # the trainer divides by the batch's std (below)
            "none": centred,
        }[mode]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(r).max())


def test_population_std_advantages_are_larger_by_sqrt_g_over_g_minus_1():
    # The numbers: x1.41 at G = 2, x1.07 at G = 8 (eps = 0 to compare exactly).
    for G, factor in ((2, 1.41), (8, 1.07)):
        rewards = [float(i % 2) for i in range(G)]
        pop = group_advantages(rewards, eps=0.0)
        sample = group_advantages(rewards, eps=0.0, ddof=1)
        for p, s in zip(pop, sample, strict=True):
            assert p / s == pytest.approx(math.sqrt(G / (G - 1)), rel=1e-12)
        assert round(math.sqrt(G / (G - 1)), 2) == factor


def test_batch_mode_is_the_group_centred_reward_over_the_batch_sample_std():
    # TRL's scale_rewards="batch": (r - group mean) / (std of every reward of the batch).
    groups = random_groups(1)[:8]
    stored = [a for g in groups for a in stored_advantages(g, "batch")]
    flat = np.array([x for g in groups for x in g])
    means = np.concatenate([[np.mean(g)] * len(g) for g in groups])
    signal = np.concatenate([[max(g) != min(g)] * len(g) for g in groups])
    want = np.where(signal, flat - means, 0.0) / (flat.std(ddof=1) + EPS)
    got = np.array(batch_scaled(stored, flat.tolist()))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# Groups whose siblings all scored the same reward, where r - mean(r) is NOT exactly zero
# in floating point: the peers' formula returns that rounding noise divided by eps.
NO_SIGNAL = [[0.1] * 3, [0.7] * 7, [1 / 3] * 6, [1e3 + 0.1] * 5, [0.0] * 4, [2.5]]


def test_groups_without_signal_are_exactly_zero_in_every_mode():
    noisy = 0
    for rewards in NO_SIGNAL:
        r = np.array(rewards)
        peers = (r - r.mean()) / (r.std(ddof=1 if len(r) > 1 else 0) + EPS)  # TRL / verl
        noisy += bool(np.any(peers != 0))
        for mode in SCALE_REWARDS:
            got = stored_advantages(rewards, mode)
            assert got == (0.0,) * len(rewards), (rewards, mode)
            assert all(math.copysign(1.0, a) == 1.0 for a in got)  # not even -0.0
    assert noisy >= 2  # the case this guards against does happen
    # The batch division keeps them exactly zero, beside groups with signal or without.
    stored = [a for g in NO_SIGNAL for a in stored_advantages(g, "batch")]
    flat = [x for g in NO_SIGNAL for x in g]
    assert batch_scaled(stored, flat) == (0.0,) * len(flat)
    mixed = stored_advantages([0.0, 1.0, 1.0], "batch") + stored_advantages([0.1] * 3, "batch")
    scaled = batch_scaled(mixed, [0.0, 1.0, 1.0] + [0.1] * 3)
    assert scaled[3:] == (0.0,) * 3 and scaled[0] < 0 < scaled[1]
    # One row (no sample std) or every reward equal (std 0): zero advantages stay zero.
    assert batch_scaled([0.0], [0.3]) == (0.0,)


@pytest.mark.parametrize("mode", SCALE_REWARDS)
def test_stored_advantages_are_group_centred_finite_and_bounded_by_mode(mode):
    # What a restore-time check may rely on in every mode: finite, sum 0 per group up to
    # rounding. How large they are depends on the mode: normalised ones are bounded by a
    # function of G, centred ones (none, batch) by the group's reward range.
    for rewards in random_groups(2):
        G = len(rewards)
        adv = stored_advantages(rewards, mode)
        scale = max(abs(a) for a in adv) or 1.0
        assert all(math.isfinite(a) for a in adv)
        assert abs(sum(adv)) <= 1e-12 * G * scale
        bound = {"group_population": math.sqrt(G - 1), "group": (G - 1) / math.sqrt(G),
                 "batch": max(rewards) - min(rewards), "none": max(rewards) - min(rewards)}[mode]
        assert max(abs(a) for a in adv) <= bound * (1 + 1e-12)
    # A normalised bound fails for centred advantages: rewards on a scale of 100.
    assert max(stored_advantages([0.0, 100.0], "none")) > math.sqrt(2 - 1)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="scale_rewards"):
        stored_advantages([0.0, 1.0], "group_sample")


def test_group_advantages_keeps_its_signature():
    assert group_advantages([2.0, 0.0], normalize_std=False) == (1.0, -1.0)
    assert group_advantages([1.0, 0.0], eps=0.0) == (1.0, -1.0)
    assert group_advantages([1.0, 0.0], eps=0.0, ddof=1) == pytest.approx(
        (1 / math.sqrt(2), -1 / math.sqrt(2)))


# ---------------------------------------------------------------------------------------
# The controller stores what the mode says (at finalize), and a resumed run reuses it
# ---------------------------------------------------------------------------------------

PARTIAL = ["data.generated.task=arith_partial"]  # partial credit: most groups have signal


class RecordingTrainer(ToyTrainer):
    def __init__(self) -> None:
        super().__init__()
        self.batches = []

    def train_step(self, batch):
        self.batches.append(batch)
        return super().train_step(batch)


@pytest.mark.parametrize("mode", SCALE_REWARDS)
def test_controller_stores_the_modes_advantages(tmp_path, mode):
    cfg = config(tmp_path / mode, *PARTIAL, f"trainer.scale_rewards={mode}")
    parts = build(cfg)
    trainer = RecordingTrainer()
    asyncio.run(Runner(cfg, source=parts.source, engine=parts.engine, trainer=trainer).run())
    groups = [g for b in trainer.batches for g in b.groups]
    assert len(groups) == cfg.train.total_steps * cfg.train.num_prompts_per_step
    with_signal = 0
    for g in groups:
        rewards = [r.reward for r in g.rows]
        assert g.advantages == stored_advantages(rewards, mode)
        with_signal += max(rewards) != min(rewards)
    assert with_signal >= len(groups) // 4


@pytest.mark.slow
def test_killed_and_resumed_runs_train_on_the_same_advantages(tmp_path):
    # Deterministic toy runs (the toy trainer's digest covers every advantage it trained
    # on): kills at finalize and at ready, in a mode whose stored values differ from the
    # default's, end byte-identical to the uninterrupted run -- and not to the default's.
    over = [*PARTIAL, "deterministic=true", "rollout.on_dropped_prompt=shrink",
            "trainer.scale_rewards=none"]
    reference = config(tmp_path / "reference", *over)
    run_to_end(reference)
    default = config(tmp_path / "default", *over[:-1])
    run_to_end(default)
    assert final_sha(default) != final_sha(reference)
    cfg = config(tmp_path / "killed", *over)
    for point in ["ledger.finalizing:9", "ledger.ready:17", "ledger.finalizing:30"]:
        code = run_child(cfg, point)
        assert code == 0 or killed(code)
    run_to_end(cfg)
    report = check(cfg, final_sha(reference))
    assert report.restarts >= 3
