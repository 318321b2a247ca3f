"""The GRPO objective as two pure functions of tensors: `token_logprobs` (the policy's
log-probs, the same quantity as the engine's) and `grpo_loss` (the clipped ratio, dual
clip, KL term and the four `loss_type` aggregations). `GRPOTrainer` (`grpo`) calls them.

The objective
-------------
A batch holds groups of sibling completions of one prompt. Their advantages were computed
upstream (`rollkeep.core.rollout.advantages`, chosen by `trainer.scale_rewards`: reward minus group mean,
over a std or not) and arrive in `TrainGroup.advantages[generation]`; under
`scale_rewards: batch` they arrive group-centred and `GRPOTrainer.train_step` divides
them by the sample std of the batch's rewards first. Every completion token of a sibling
gets its sibling's advantage A. For each completion token t of sequence i, with p the
current policy and b the behaviour policy that generated it (`Row.logprobs`, a
full-vocabulary log_softmax at the sampling temperature — `token_logprobs` computes the
same quantity):

    ratio      = exp(log p(token) - log b(token))
    surrogate  = min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)
    surrogate  = max(surrogate, c * A)  if A < 0 and dual_clip = c is set (c > 1)
    k3         = exp(ref - logp) - (ref - logp) - 1        (KL estimator, >= 0)
    l[i, t]    = - surrogate  +  kl_coef * k3              (the per-token loss)

The dual clip (verl's `clip_ratio_c`, which verl always applies, c = 3 by default; TRL's
`delta` when c > 1 + clip_eps) bounds the loss of a negative-advantage token, which
the clipped objective leaves unbounded (-ratio * A grows with the ratio): past ratio c the
token's loss is the constant -c * A and it has no gradient. This is the regime that stale
batches produce.

The loss aggregates l over the batch's N sequences, sequence i having L_i completion
tokens, by `loss_type` (in a multi-turn trajectory only the model's tokens count: the
environment's are outside `mask`, so L_i and every token statistic leave them out; L_max,
the engine's bound on the whole trajectory, still bounds L_i):

    dapo     loss = Σ_i Σ_t l[i,t] / Σ_i L_i               token mean over the whole batch
    grpo     loss = (1/N) Σ_i (1/L_i) Σ_t l[i,t]           mean of per-sequence token means
    dr_grpo  loss = Σ_i Σ_t l[i,t] / (N * L_max)           L_max = engine.max_new_tokens
    bnpo     loss = (1/M) Σ_m Σ_{i∈m} Σ_t l[i,t] / Σ_{i∈m} L_i
                                                           token mean per micro-batch m of
                                                           `micro_batch_size` sequences,
                                                           averaged over the M micro-batches

With `log_ratio_clamp` c every log-ratio (logp - old, ref - logp) is first clamped to
[-c, c], and with `kl_clamp` k3 is clamped above, as verl does (20 and 10); with
`is_weights` (`off_policy`) the policy term -surrogate is multiplied by the token's
importance weight before the KL term is added.

(a sequence without completion tokens adds nothing and still counts in N; a micro-batch
without any counts in M; the KL term is aggregated with the policy term, as in TRL).
In TRL / verl terms: `dapo` is TRL's `loss_type="dapo"` (its default) and verl's
`loss_agg_mode: token-mean` (where verl normalises by the global batch's tokens; older verl
normalised per micro-batch, which is `bnpo`); `grpo` is TRL's `"grpo"` and verl's
`seq-mean-token-mean`; `dr_grpo` is TRL's `"dr_grpo"` and verl >= 0.9's
`seq-mean-token-sum-norm` with `actor.loss_scale_factor` = L_max (verl's default, null,
divides by each micro-batch's padded length instead; verl's legacy `dp_actor` gives this
times the micro-batch size); `bnpo` is TRL's `"bnpo"`. `dapo` weighs every token
alike, so long completions weigh more; `grpo` weighs every sequence alike, so a token of a
short completion weighs more; `dr_grpo` weighs every token alike with a constant
denominator, so the step size does not depend on how long this batch's completions are.

Micro-batches accumulate gradients: each micro-batch's loss is its part of the batch's
loss (weights from whole-batch counts N, Σ L_i), so for `dapo`, `grpo` and `dr_grpo` the
accumulated gradient is the whole batch's and `micro_batch_size` changes memory use, not
the update. `bnpo` is a mean per micro-batch by definition, so there `micro_batch_size`
changes the update (and is a semantic config key). The ratio is taken against the
behaviour log-probs, in every PPO epoch, unless `trainer.off_policy` is `tis` or `mis`:
then it is taken against the step's starting weights and importance weights correct for
the behaviour policy (`off_policy` has the formulas).

The KL reference is a frozen copy of the policy made by `GRPOTrainer.set_reference()`
(call it after a warm start); if `kl_coef > 0` and it was never called, the first
`train_step` makes it from the weights at that moment. With `kl_coef == 0` no reference
exists.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LOSS_TYPES", "LossType", "grpo_loss", "token_logprobs"]


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) at `targets`: (B, T, V), (B, T) -> (B, T) float32.

    The same quantity as the engine's behaviour log-probs (full vocabulary, same
    temperature), so their difference is the log importance ratio."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)


LossType = Literal["dapo", "grpo", "dr_grpo", "bnpo"]
LOSS_TYPES: tuple[str, ...] = ("dapo", "grpo", "dr_grpo", "bnpo")


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    loss_type: LossType = "dapo",
    dual_clip: float | None = None,
    max_completion_length: int | None = None,
    batch_sequences: int | None = None,
    batch_tokens: int | None = None,
    micro_batches: int = 1,
    is_weights: Tensor | None = None,
    kl_clamp: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GRPO objective of these B sequences as their part of a step's batch
    (the formulas are in the module docstring).

    logp, old_logp, mask, ref_logp: (B, T); advantages: (B,) one per sequence (or (B, T)).
    `batch_sequences` (N) and `batch_tokens` (Σ L_i) are the whole batch's counts, and
    `micro_batches` (M, bnpo only) the number of micro-batches it is split into; None / 1
    means these B sequences are the whole batch. With them, the losses and stats of a
    batch's micro-batches add up to those of the batch (for bnpo, by its definition).
    `max_completion_length` (L_max) is required by dr_grpo. Returns (loss, stats) with
    stats `clip_frac`, `dual_clip_frac`, `ratio_mean`, `kl` (detached scalars, each this
    part's share of the batch's token mean). An all-zero mask gives a zero loss.
    `is_weights` (B, T), detached: the off-policy correction's importance weights
    (`off_policy.correction`), multiplying each token's policy term. `log_ratio_clamp` c
    bounds every log-ratio (the policy's against `old_logp`, the reference's against the
    policy's) to [-c, c] and `kl_clamp` bounds k3 above, as verl does (c = 20, k3 <= 10);
    None: no clamp (TRL's arithmetic). A clamped value has no gradient."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type dr_grpo needs max_completion_length (engine.max_new_tokens)")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    keep = mask.bool()
    mask = mask.to(logp.dtype)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # (B, 1)|(B, T)
    adv = adv.to(logp.dtype)
    n_tokens = float(mask.sum().item() if batch_tokens is None else batch_tokens)
    n_tokens = max(n_tokens, 1.0)  # no tokens: every sum is 0, so is the loss
    n_seqs = float(max(1, logp.shape[0] if batch_sequences is None else batch_sequences))

    # Masked positions (padding, prompt) get log-ratio 0, so whatever they hold can never
    # overflow exp() into inf * 0 = nan.
    log_ratio = torch.where(keep, logp - old_logp, 0.0)  # (B, T)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(keep)
    if dual_clip is not None:
        # A < 0: min(...) = A * max(ratio, clipped ratio) falls without bound as the ratio
        # grows; c * A is its floor (a constant: no gradient through capped tokens).
        floor = dual_clip * adv
        dual = (adv < 0) & (floor > surrogate)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, floor), surrogate)
    per_token = -surrogate if is_weights is None else -surrogate * is_weights

    if ref_logp is not None:
        d = torch.where(keep, ref_logp - logp, 0.0)
        if log_ratio_clamp is not None:
            d = d.clamp(-log_ratio_clamp, log_ratio_clamp)
        k3 = torch.exp(d) - d - 1.0  # unbiased, always >= 0
        if kl_clamp is not None:
            k3 = k3.clamp(max=kl_clamp)
        per_token = per_token + kl_coef * k3
        kl = ((k3 * mask).sum() / n_tokens).detach()
    else:
        kl = torch.zeros((), dtype=logp.dtype, device=logp.device)

    # Each token's weight in the batch's loss (module docstring); all from whole-batch
    # counts except bnpo's, which is per micro-batch by definition.
    if loss_type == "dapo":
        weight = mask / n_tokens
    elif loss_type == "grpo":
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)  # (B, 1)
        weight = mask / (n_seqs * lengths)
    elif loss_type == "dr_grpo":
        weight = mask / (n_seqs * float(max_completion_length))
    else:  # bnpo
        weight = mask / (float(micro_batches) * mask.sum().clamp(min=1.0))
    loss = (per_token * weight).sum()

    with torch.no_grad():
        stats = {
            "clip_frac": ((clipped < unclipped).to(logp.dtype) * mask).sum() / n_tokens,
            "dual_clip_frac": (dual.to(logp.dtype) * mask).sum() / n_tokens,
            "ratio_mean": (ratio * mask).sum() / n_tokens,
            "kl": kl,
        }
    return loss, stats
