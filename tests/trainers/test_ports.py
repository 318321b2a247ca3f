"""Every documented mapping of rollkeep's GRPO options to TRL's and verl's (docs/training.md,
"GRPO options, as in TRL and verl"; `rollkeep.trainers.grpo_loss`, `off_policy`): each test
transcribes the peer's formula (TRL 1.16 `GRPOTrainer._compute_loss`, verl 0.9.1
`compute_policy_loss_vanilla`, `agg_loss`, `kl_penalty("low_var_kl")`, `rollout_is`, and
verl's legacy `dp_actor` aggregation) and checks rollkeep's loss and gradient against it on
random ragged batches, including where they are documented to differ."""

from __future__ import annotations

import math

import pytest
import torch

from rollkeep.trainers import off_policy
from rollkeep.trainers.grpo_loss import grpo_loss

EPS = 0.2
CASES = 40


def cases(seed: int = 0, *, scale: float = 0.5, n: int = CASES):
    """Random batches: B sequences of ragged lengths padded to T, log-probs of a policy and
    an old policy `scale` apart, a reference, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        B = int(torch.randint(2, 7, (1,), generator=g))
        T = int(torch.randint(2, 9, (1,), generator=g))
        lengths = torch.randint(0, T + 1, (B,), generator=g)
        lengths[0] = max(1, int(lengths[0]))  # at least one token in the batch
        mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
        old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
        logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * scale).requires_grad_(True)
        ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
        adv = torch.randn(B, generator=g, dtype=torch.float64)
        yield logp, old, ref, adv, mask


def ours(logp, old, ref, adv, mask, **kw):
    loss, _ = grpo_loss(logp, old, adv, mask, clip_eps=EPS, ref_logp=ref, **kw)
    return loss


def same(a, b, logp, *, tol: float = 1e-10) -> None:
    """Equal losses and equal gradients with respect to the policy's log-probs."""
    ga, = torch.autograd.grad(a, logp, retain_graph=True)
    gb, = torch.autograd.grad(b, logp, retain_graph=True)
    assert float(a.detach()) == pytest.approx(float(b.detach()), abs=tol, rel=tol)
    assert (ga - gb).abs().max().item() <= tol * max(1.0, gb.abs().max().item())


# -- TRL ---------------------------------------------------------------------------------


def trl_loss(logp, old, ref, adv, mask, *, loss_type: str, beta: float, delta: float | None = None,
             max_completion_length: int | None = None, is_ratio=None):
    """TRL's `_compute_loss`: coef_1 = exp(logp - old), optionally capped at `delta`; the
    clipped branch; the vLLM importance-sampling ratio on the policy term; + beta x k3."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    a = adv[:, None]
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    if is_ratio is not None:
        per_token = per_token * is_ratio
    d = ref - logp
    per_token = per_token + beta * (torch.exp(d) - d - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    return (per_token * mask).sum() / mask.sum()  # dapo: the batch's tokens


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_each_loss_type_is_trls(loss_type) -> None:
    for logp, old, ref, adv, mask in cases(1):
        kw = {"max_completion_length": 12} if loss_type == "dr_grpo" else {}
        same(ours(logp, old, ref, adv, mask, loss_type=loss_type, kl_coef=0.05, **kw),
             trl_loss(logp, old, ref, adv, mask, loss_type=loss_type, beta=0.05, **kw), logp)


@pytest.mark.parametrize("c", [1.5, 3.0, 10.0])
def test_dual_clip_is_trls_delta_above_one_plus_eps(c) -> None:
    for logp, old, ref, adv, mask in cases(2, scale=1.5):
        same(ours(logp, old, ref, adv, mask, dual_clip=c, kl_coef=0.0),
             trl_loss(logp, old, ref, adv, mask, loss_type="dapo", beta=0.0, delta=c), logp)


def test_trls_delta_at_or_below_one_plus_eps_caps_the_ratio_not_the_loss() -> None:
    """A = -1, ratio 1.15, c = 1.1: rollkeep (and verl) lose 1.10, TRL 1.15."""
    logp = torch.tensor([[math.log(1.15)]], dtype=torch.float64, requires_grad=True)
    old, mask, adv = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), torch.tensor(
        [-1.0], dtype=torch.float64)
    assert float(ours(logp, old, None, adv, mask, dual_clip=1.1).detach()) == pytest.approx(1.10)
    assert float(trl_loss(logp, old, old, adv, mask, loss_type="dapo", beta=0.0, delta=1.1).detach()) == pytest.approx(1.15)


@pytest.mark.parametrize(("mode", "level", "trl_mode"), [
    ("tis", "token", "token_truncate"), ("tis", "sequence", "sequence_truncate"),
    ("mis", "token", "token_mask"), ("mis", "sequence", "sequence_mask")])
def test_off_policy_modes_are_trls_vllm_importance_sampling(mode, level, trl_mode) -> None:
    """TRL: is_ratio from the recomputed old log-probs over vLLM's, per token or the
    sequence's product, truncated at the cap or zeroed past it; the PPO ratio against the
    recomputed old log-probs."""
    cap = 1.6
    for logp, prox, ref, adv, mask in cases(3, scale=0.3):
        behaviour = prox + torch.randn(prox.shape, generator=torch.Generator().manual_seed(9),
                                       dtype=torch.float64) * 0.4
        diff = (prox - behaviour) * mask
        ratio = torch.exp(diff.sum(-1, keepdim=True)) if trl_mode.startswith("sequence") else torch.exp(diff)
        ratio = torch.clamp(ratio, max=cap) if trl_mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)
        sums = off_policy.zero_sums()
        w = off_policy.correction(prox, behaviour, mask, torch.zeros_like(mask, dtype=torch.long), mode=mode,
                                  level=level, cap=cap, trainer_version=0, sums=sums)
        same(ours(logp, prox, ref, adv, mask, kl_coef=0.05, is_weights=w),
             trl_loss(logp, prox, ref, adv, mask, loss_type="dapo", beta=0.05, is_ratio=ratio), logp)


# -- verl --------------------------------------------------------------------------------


def verl_pg_losses(logp, old, adv, *, clip_ratio_c: float | None = 3.0, clamp_log_ratio: bool = True,
                   weights=None):
    """verl 0.9.1 `compute_policy_loss_vanilla` before aggregation."""
    log_ratio = logp - old
    if clamp_log_ratio:
        log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    a = adv[:, None]
    clipped = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - EPS, 1 + EPS))
    if clip_ratio_c is not None:
        clipped = torch.where(a < 0, torch.minimum(-a * clip_ratio_c, clipped), clipped)
    return clipped if weights is None else clipped * weights


def verl_low_var_kl(logp, ref):
    kl = torch.clamp(ref - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(kl) - kl - 1, -10.0, 10.0)


def verl_agg(losses, mask, mode: str, *, loss_scale_factor: float | None = None):
    """verl 0.9.1 `agg_loss` for one process holding the whole batch."""
    if mode == "token-mean":
        return (losses * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return ((losses * mask).sum(-1) / (mask.sum(-1) + 1e-8)).sum() / losses.size(0)
    assert mode == "seq-mean-token-sum-norm"
    return ((losses * mask).sum(-1) / loss_scale_factor).sum() / losses.size(0)


@pytest.mark.parametrize(("loss_type", "mode"), [
    ("dapo", "token-mean"), ("grpo", "seq-mean-token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")])
def test_each_loss_type_is_verls_with_its_dual_clip_and_clamps(loss_type, mode) -> None:
    """dual_clip 3 = verl's always-on clip_ratio_c; kl_clamp 10 and log_ratio_clamp 20 =
    verl's clamps; dr_grpo = seq-mean-token-sum-norm with loss_scale_factor = max_new_tokens."""
    L = 12
    for logp, old, ref, adv, mask in cases(4, scale=4.0):  # large log-ratios: the clamps bind
        verl = (verl_agg(verl_pg_losses(logp, old, adv), mask, mode, loss_scale_factor=L)
                + 0.1 * verl_agg(verl_low_var_kl(logp, ref), mask, mode, loss_scale_factor=L))
        kw = {"max_completion_length": L} if loss_type == "dr_grpo" else {}
        tol = 1e-7 if loss_type == "grpo" else 1e-10  # verl's + 1e-8 in each token count
        same(ours(logp, old, ref, adv, mask, loss_type=loss_type, kl_coef=0.1, dual_clip=3.0, kl_clamp=10.0,
                  log_ratio_clamp=20.0, **kw), verl, logp, tol=tol)


def test_without_the_clamps_rollkeep_differs_from_verl_where_k3_exceeds_10() -> None:
    """ref - logp = 3: k3 = 16.1, which verl clamps to 10 (and so drops its gradient)."""
    logp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    ref, mask, adv = torch.full((1, 1), 3.0, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), torch.zeros(
        1, dtype=torch.float64)
    plain = ours(logp, logp.detach(), ref, adv, mask, kl_coef=1.0)
    clamped = ours(logp, logp.detach(), ref, adv, mask, kl_coef=1.0, kl_clamp=10.0)
    assert float(plain) == pytest.approx(math.exp(3) - 4) and float(clamped) == pytest.approx(10.0)
    assert torch.autograd.grad(clamped, logp)[0].abs().max() == 0


def test_dr_grpo_is_legacy_verls_sum_norm_over_the_micro_batch_size() -> None:
    """Legacy verl (`dp_actor`, <= 0.7): each micro-batch's token sum over its padded length
    (max_new_tokens), averaged over the gradient-accumulation steps: rollkeep's dr_grpo
    times the micro-batch size."""
    L, m = 12, 2
    for logp, old, _ref, adv, mask in cases(5):
        B = logp.size(0) - logp.size(0) % m
        if B == 0:
            continue
        lp, o, a, mk = logp[:B], old[:B], adv[:B], mask[:B]
        pg = verl_pg_losses(lp, o, a, clip_ratio_c=None, clamp_log_ratio=False)
        parts = [(pg[s:s + m] * mk[s:s + m]).sum() / L for s in range(0, B, m)]
        legacy = sum(parts) / len(parts)
        mine = ours(lp, o, None, a, mk, loss_type="dr_grpo", max_completion_length=L)
        same(mine * m, legacy, logp)


def test_bnpo_is_legacy_verls_token_mean_per_micro_batch() -> None:
    m = 2
    for logp, old, _ref, adv, mask in cases(6):
        B = logp.size(0)
        M = -(-B // m)
        pg = verl_pg_losses(logp, old, adv, clip_ratio_c=None, clamp_log_ratio=False)
        legacy = sum((pg[s:s + m] * mask[s:s + m]).sum() / mask[s:s + m].sum().clamp(min=1.0)
                     for s in range(0, B, m)) / M
        mine = sum(ours(logp[s:s + m], old[s:s + m], None, adv[s:s + m], mask[s:s + m], loss_type="bnpo",
                        micro_batches=M) for s in range(0, B, m))
        same(mine, legacy, logp)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_is_verls_rollout_is(level) -> None:
    """verl's `rollout_is: token | sequence` with `rollout_is_threshold`: exp of the old
    policy's log-ratio over the rollout's (per token, or summed over the sequence),
    truncated above, multiplying the policy loss."""
    cap = 2.0
    for logp, prox, _ref, adv, mask in cases(7, scale=0.3):
        rollout = prox - torch.rand(prox.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        lr = (prox - rollout) * mask
        lr = lr.sum(-1, keepdim=True).expand_as(lr) if level == "sequence" else lr
        weights = torch.exp(lr).clamp(max=cap) * mask
        verl = verl_agg(verl_pg_losses(logp, prox, adv, weights=weights), mask, "token-mean")
        w = off_policy.correction(prox, rollout, mask, torch.zeros_like(mask, dtype=torch.long), mode="tis",
                                  level=level, cap=cap, trainer_version=0, sums=off_policy.zero_sums())
        same(ours(logp, prox, None, adv, mask, dual_clip=3.0, log_ratio_clamp=20.0, is_weights=w), verl, logp)


def test_off_policy_statistics_by_hand() -> None:
    """Two sequences: [log r = ln 3, 0] at version 0 and [ln 0.5] at version 1, trainer at
    version 1, cap 2: per token w = 3, 1, 0.5; k3 = r - ln r - 1."""
    prox = torch.tensor([[math.log(3.0), 0.0], [math.log(0.5), 0.0]], dtype=torch.float64)
    behaviour = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    versions = torch.tensor([[0, 0], [1, -1]])
    k3 = [3 - math.log(3) - 1, 0.0, 0.5 - math.log(0.5) - 1]

    sums = off_policy.zero_sums()
    w = off_policy.correction(prox, behaviour, mask, versions, mode="tis", level="token", cap=2.0,
                              trainer_version=1, sums=sums)
    assert w.flatten().tolist() == pytest.approx([2.0, 1.0, 0.5, 0.0])
    m = off_policy.metrics(sums)
    assert m["off_policy/mismatch_kl"] == pytest.approx(sum(k3) / 3)
    assert m["off_policy/ratio_mean"] == pytest.approx(4.5 / 3) and m["off_policy/ratio_max"] == pytest.approx(3.0)
    assert m["off_policy/capped_share"] == pytest.approx(1 / 3)
    assert m["off_policy/mismatch_kl_lag1"] == pytest.approx((k3[0] + k3[1]) / 2)
    assert m["off_policy/mismatch_kl_lag0"] == pytest.approx(k3[2])

    sums = off_policy.zero_sums()
    w = off_policy.correction(prox, behaviour, mask, versions, mode="mis", level="sequence", cap=2.0,
                              trainer_version=1, sums=sums)
    assert w.flatten().tolist() == pytest.approx([0.0, 0.0, 0.5, 0.0])  # the first sequence's w = 3 > cap: dropped
    m = off_policy.metrics(sums)
    assert m["off_policy/ratio_mean"] == pytest.approx(3.5 / 2) and m["off_policy/capped_share"] == pytest.approx(2 / 3)
    assert off_policy.correction(prox, behaviour, mask, versions, mode="none", level="token", cap=2.0,
                                 trainer_version=1, sums=off_policy.zero_sums()) is None
