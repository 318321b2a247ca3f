"""Off-policy correction for asynchronous generation (`trainer.off_policy`), and the
measure of how off-policy a batch is (the `off_policy/*` metrics, every step, in every
mode).

Why
---
Every token of a batch was sampled by a behaviour policy b: the engine's weights of the
token's version (`Row.versions`), in the engine's kernels and dtype. With lookahead
(`sampler.max_lookahead_versions`) that version is older than the trainer's, and a bf16 or
otherwise different engine gives other log-probs even for the same weights. rollkeep
records b's log-probs and version for every token (`Row.logprobs`, `Row.versions`).

Three policies (after Hilton et al.'s decoupled PPO, as verl and TRL use them):

    b       behaviour: sampled the token (the engine's recorded log-prob)
    p_old   proximal: the trainer's weights at the start of the step (its log-prob of the
            token, computed with no gradient by the first PPO epoch's forward pass, before
            any update: no extra pass)
    p       the policy being updated

`off_policy: none` (the default, rollkeep's behaviour before this key, verl's "bypass"
mode) takes the PPO ratio p / b: the clip is the only correction, and a batch generated
under other kernels is clipped on every token even on-policy. `tis` and `mis` take the
PPO ratio p / p_old (ratio 1 in the first epoch, so the clip only bounds later epochs)
and weigh each token's policy loss by a detached importance weight w of p_old over b:

    token level     log w[i,t] = log p_old(token) - log b(token)
    sequence level  log w[i]   = Σ_t (log p_old - log b)       every token of sequence i
                                                              gets its sequence's weight
    tis             w' = min(w, is_cap)                       truncated IS
    mis             w' = w if w <= is_cap, else 0             masked IS: the token (or the
                                                              whole sequence) is dropped
    l[i,t]          = - w' x surrogate(p / p_old)  +  kl_coef x k3

The weight multiplies the policy term only (the KL term is not a sampled estimate of the
policy gradient), and a masked token still counts in the `loss_type` normaliser: masking
removes its gradient, not its share of the denominator. Peer settings these reproduce
(each with its trainer recomputing the old log-probs, which rollkeep's first epoch does):

    off_policy  is_level  TRL GRPOConfig (cap = is_cap)          verl (threshold = is_cap)
    tis         token     vllm_importance_sampling_mode:         algorithm.rollout_correction.
                          token_truncate                         rollout_is: token
    tis         sequence  sequence_truncate                      rollout_is: sequence
    mis         token     token_mask                             closest: rejection sampling
    mis         sequence  sequence_mask (TRL's default, cap 3)   (rollout_rs), upper bound only

(`tests/trainers/test_ports.py` checks each row against the peer's formula.)

Metrics (token means over the batch's model tokens unless said otherwise)
------------------------------------------------------------------------
    off_policy/mismatch_kl        k3 estimate of KL(b || p_old) from b's samples:
                                  r = p_old / b, k3 = r - log r - 1 (>= 0); 0 when the
                                  trainer reproduces the engine exactly
    off_policy/ratio_mean         mean of w before truncation (per token, or per sequence at
                                  sequence level)
    off_policy/ratio_max          largest w
    off_policy/capped_share       share of tokens whose weight exceeds is_cap: capped by
                                  tis, masked by mis, left as they are by none
    off_policy/mismatch_kl_lag<k> mismatch_kl over the tokens k versions older than the
                                  trainer (lag 0: the trainer's own version; `lag7plus`: 7
                                  or more); only the lags present in the batch
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = ["IS_LEVELS", "OFF_POLICY_MODES", "IsLevel", "OffPolicy", "correction", "metrics", "zero_sums"]

OffPolicy = Literal["none", "tis", "mis"]
IsLevel = Literal["token", "sequence"]
OFF_POLICY_MODES: tuple[str, ...] = ("none", "tis", "mis")
IS_LEVELS: tuple[str, ...] = ("token", "sequence")

PREFIX = "off_policy/"
LAGS = 8  # buckets 0..6 and "7 or more": a fixed set, so ranks all-reduce the same keys
_LOG_MAX = 700.0  # exp() of more overflows float64; only the statistics need it bounded


def _lag_name(k: int) -> str:
    return f"lag{k}" if k < LAGS - 1 else f"lag{LAGS - 1}plus"


def zero_sums() -> dict[str, float]:
    """The sums `correction` adds to, all zero (the same keys in every process)."""
    keys = ["kl_sum", "tokens", "ratio_sum", "units", "ratio_max", "capped"]
    keys += [f"{what}_{_lag_name(k)}" for k in range(LAGS) for what in ("kl_sum", "tokens")]
    return {PREFIX + k: 0.0 for k in keys}


def correction(
    prox_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, versions: Tensor, *,
    mode: OffPolicy, level: IsLevel, cap: float, trainer_version: int, sums: dict[str, float],
) -> Tensor | None:
    """The detached importance weights (B, T) of these sequences' tokens under `mode`
    (None for `none`), adding this part's statistics to `sums` (`zero_sums` keys; the
    metrics are `metrics(sums)`). prox_logp, behaviour_logp, mask: (B, T) as in
    `grpo_loss`; versions: (B, T) the version each target token was sampled under."""
    if mode not in OFF_POLICY_MODES or level not in IS_LEVELS:
        raise ValueError(f"off_policy must be one of {OFF_POLICY_MODES} and is_level one of {IS_LEVELS}, "
                         f"got {mode!r}, {level!r}")
    if not cap > 1.0:
        raise ValueError(f"is_cap must be > 1, got {cap}")
    with torch.no_grad():
        keep = mask.bool()
        log_r = torch.where(keep, prox_logp.double() - behaviour_logp.double(), 0.0)  # (B, T)
        k3 = torch.where(keep, torch.exp(log_r) - log_r - 1.0, 0.0)
        n = int(keep.sum().item())
        sums[PREFIX + "kl_sum"] += float(k3.sum().item())
        sums[PREFIX + "tokens"] += n
        lag = (trainer_version - versions).clamp(min=0, max=LAGS - 1)
        for k in range(LAGS):
            at = keep & (lag == k)
            if bool(at.any()):
                sums[f"{PREFIX}kl_sum_{_lag_name(k)}"] += float(k3[at].sum().item())
                sums[f"{PREFIX}tokens_{_lag_name(k)}"] += int(at.sum().item())

        if level == "sequence":
            seq = log_r.sum(dim=-1, keepdim=True)  # (B, 1)
            has = keep.any(dim=-1, keepdim=True)
            unit_log, unit_keep = seq, has
            log_w = seq.expand_as(log_r)
        else:
            unit_log, unit_keep = log_r, keep
            log_w = log_r
        ratio = torch.exp(unit_log.clamp(max=_LOG_MAX))
        sums[PREFIX + "ratio_sum"] += float(ratio[unit_keep].sum().item())
        sums[PREFIX + "units"] += int(unit_keep.sum().item())
        if bool(unit_keep.any()):
            sums[PREFIX + "ratio_max"] = max(sums[PREFIX + "ratio_max"], float(ratio[unit_keep].max().item()))
        over = keep & (log_w > math.log(cap))
        sums[PREFIX + "capped"] += int(over.sum().item())

        if mode == "none":
            return None
        if mode == "tis":
            w = torch.exp(log_w.clamp(max=math.log(cap)))
        else:  # mis
            w = torch.where(over, 0.0, torch.exp(log_w.clamp(max=math.log(cap))))
        return torch.where(keep, w, 0.0).to(prox_logp.dtype)


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """The `off_policy/*` metrics (module docstring) of a step's summed statistics."""
    def get(k: str) -> float:
        return sums.get(PREFIX + k, 0.0)

    tokens = get("tokens")
    out = {
        PREFIX + "mismatch_kl": get("kl_sum") / tokens if tokens else 0.0,
        PREFIX + "ratio_mean": get("ratio_sum") / get("units") if get("units") else 0.0,
        PREFIX + "ratio_max": get("ratio_max"),
        PREFIX + "capped_share": get("capped") / tokens if tokens else 0.0,
    }
    for k in range(LAGS):
        name = _lag_name(k)
        if get(f"tokens_{name}"):
            out[f"{PREFIX}mismatch_kl_{name}"] = get(f"kl_sum_{name}") / get(f"tokens_{name}")
    return out
