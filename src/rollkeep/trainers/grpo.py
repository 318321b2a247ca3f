"""GRPO: group-relative policy optimisation with a PPO-style clipped ratio (after CleanRL's
`ppo.py`). Read top to bottom: the two pure functions that define the objective, the
collation of rows into padded batches, the trainer (one `train_step` = `ppo_epochs`
optimizer updates on one batch), its checkpoint, and the built-in GPT wiring.

The objective
-------------
A batch holds groups of sibling completions of one prompt. Their advantages were computed
upstream (`rollkeep.core.advantages`, chosen by `trainer.scale_rewards`: reward minus group mean,
over a std or not) and arrive in `TrainGroup.advantages[generation]`; under
`scale_rewards: batch` they arrive group-centred and `train_step` divides them by the
sample std of the batch's rewards first. Every completion token of a sibling gets its
sibling's advantage A. For each completion token t of sequence i, with p the current policy
and b the behaviour policy that generated it (`Row.logprobs`, a full-vocabulary log_softmax
at the sampling temperature — `token_logprobs` computes the same quantity):

    ratio      = exp(log p(token) - log b(token))
    surrogate  = min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)
    surrogate  = max(surrogate, c * A)  if A < 0 and dual_clip = c is set (c > 1)
    k3         = exp(ref - logp) - (ref - logp) - 1        (KL estimator, >= 0)
    l[i, t]    = - surrogate  +  kl_coef * k3              (the per-token loss)

The dual clip (verl's `clip_ratio_c`) bounds the loss of a negative-advantage token, which
the clipped objective leaves unbounded (-ratio * A grows with the ratio): past ratio c the
token's loss is the constant -c * A and it has no gradient. This is the regime that stale
batches produce.

The loss aggregates l over the batch's N sequences, sequence i having L_i completion
tokens, by `loss_type`:

    dapo     loss = Σ_i Σ_t l[i,t] / Σ_i L_i               token mean over the whole batch
    grpo     loss = (1/N) Σ_i (1/L_i) Σ_t l[i,t]           mean of per-sequence token means
    dr_grpo  loss = Σ_i Σ_t l[i,t] / (N * L_max)           L_max = engine.max_new_tokens
    bnpo     loss = (1/M) Σ_m Σ_{i∈m} Σ_t l[i,t] / Σ_{i∈m} L_i
                                                           token mean per micro-batch m of
                                                           `micro_batch_size` sequences,
                                                           averaged over the M micro-batches

(a sequence without completion tokens adds nothing and still counts in N; a micro-batch
without any counts in M; the KL term is aggregated with the policy term, as in TRL).
In TRL / verl terms: `dapo` is TRL's `loss_type="dapo"` (its default) and verl's
`loss_agg_mode: token-mean` (where verl normalises by the global batch's tokens; older verl
normalised per micro-batch, which is `bnpo`); `grpo` is TRL's `"grpo"` and verl's
`seq-mean-token-mean`; `dr_grpo` is TRL's `"dr_grpo"` (verl's `seq-mean-token-sum-norm`
divides by the response length per micro-batch and averages over micro-batches, i.e.
this times the micro-batch size); `bnpo` is TRL's `"bnpo"`. `dapo` weighs every token
alike, so long completions weigh more; `grpo` weighs every sequence alike, so a token of a
short completion weighs more; `dr_grpo` weighs every token alike with a constant
denominator, so the step size does not depend on how long this batch's completions are.

Micro-batches accumulate gradients: each micro-batch's loss is its part of the batch's
loss (weights from whole-batch counts N, Σ L_i), so for `dapo`, `grpo` and `dr_grpo` the
accumulated gradient is the whole batch's and `micro_batch_size` changes memory use, not
the update. `bnpo` is a mean per micro-batch by definition, so there `micro_batch_size`
changes the update (and is a semantic config key). The ratio is always taken against the
behaviour log-probs, in every PPO epoch: in an asynchronous run the behaviour policy may be
a few versions old, and the ratio is exactly the off-policy correction.

The KL reference is a frozen copy of the policy made by `set_reference()` (call it after a
warm start); if `kl_coef > 0` and it was never called, the first `train_step` makes it from
the weights at that moment. With `kl_coef == 0` no reference exists.

Metrics returned by `train_step` (floats; averaged over the PPO epochs of the step)
---------------------------------------------------------------------------------------
The token statistics (clip_frac, dual_clip_frac, ratio_mean, kl) are token means over the
whole batch under every `loss_type`: they describe the tokens, not the weighting.

    loss                the minimised objective above, aggregated by `loss_type`
    clip_frac           fraction of completion tokens whose PPO-clipped branch is active,
                        i.e. the clip removed their gradient (ratio > 1+eps with A > 0, or
                        ratio < 1-eps with A < 0); high values mean the policy moved far
                        from the behaviour policy (stale batch, or too large a step)
    dual_clip_frac      fraction of completion tokens the dual clip caps (A < 0 and
                        ratio > c); 0 when `dual_clip` is off. Disjoint from clip_frac
    ratio_mean          token-mean of the ratio; ~1 on-policy, drifts with staleness
    kl                  token-mean k3 estimate of KL(policy || reference); 0 without one
    grad_norm           global gradient norm before clipping to `grad_clip`
    tokens              completion tokens in the batch (Σ L_i)
    reward_mean         mean reward of the batch's completions
    advantage_abs_mean  mean |advantage| over the batch's completions, as trained on (after
                        the `batch` division); 0 when every group scored all its siblings
                        alike (such a batch teaches nothing)
    lr                  the AdamW learning rate used: `lr`, or less during the linear
                        warmup (`lr_warmup_steps`) and the linear decay (`lr_decay_steps`,
                        to `lr_final_ratio` x `lr`); `GRPOTrainer.step_lr` has the formula

Metrics returned by `sft_step` (the supervised warm start)
----------------------------------------------------------
    loss       token-mean cross-entropy of the target tokens (before the update)
    tokens     target tokens in the batch
    grad_norm  global gradient norm before clipping
    lr         the learning rate used

Checkpoint files (`snapshot().files()`, loaded by `load`; docs/design.md §4: no pickle)
-----------------------------------------------------------------------------------
    model.safetensors      the model's state dict, each storage once: a tied tensor (GPT's
                           `head.weight` is `wte.weight`) is saved under its first name in
                           state-dict order only; `trainer.json` lists the ties and `load`
                           checks them against the model
    optimizer.safetensors  every optimizer state tensor as `{opt}.state.{param_index}.{name}`
                           with opt `rl` (the GRPO AdamW) or `sft` (the warm-start AdamW)
    trainer.json           format, step counters, ties, and per optimizer its param_group
                           hyper-parameters (recorded; the config, not the file, sets them
                           on load: the restore chain's config check guards changes) and
                           any non-tensor state
    rng.safetensors        `cpu`: the torch CPU generator state (uint8); it drives dropout.
                           (CUDA generators are not captured: this trainer's models run
                           on CPU; a GPU subclass must add them.)
    reference.safetensors  the KL reference's weights, when one exists

Every file declares the step its state is of (`rollkeep_step`: in trainer.json, and in
each safetensors file's metadata), which is `rl_steps`, the weight version; `load(files,
step=N)` refuses a file of another step, so trainer files copied from another checkpoint
never load under a ledger of a different version.

`load` checks every file and tensor (presence, parse, names, dtypes, shapes, ties) before
it changes anything, then restores model, optimizers (moments and step counts), RNG,
counters and reference bit-exactly. Any problem raises CheckpointError naming the file
and the tensor.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from ..config import TorchTrainerConfig
from ..core.advantages import SCALE_REWARDS, ScaleRewards, batch_scaled
from ..core.checkpoint import STEP_KEY, declared_step, step_metadata
from ..core.errors import CheckpointError
from ..core.untrusted import loads_json
from ..models.gpt import GPT
from ..models.tokenizer import PAD
from .adamw import make_adamw
from .base import Batch, check_step

__all__ = ["GRPOSnapshot", "GRPOTrainer", "TorchTrainer", "grpo_loss", "token_logprobs"]

LogitsFn = Callable[[nn.Module, Tensor, Tensor], Tensor]  # (model, ids, mask) -> logits


# ---------------------------------------------------------------------------------------
# 1. The objective: two pure functions
# ---------------------------------------------------------------------------------------


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
    part's share of the batch's token mean). An all-zero mask gives a zero loss."""
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
    ratio = torch.exp(torch.where(keep, logp - old_logp, 0.0))  # (B, T)
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
    per_token = -surrogate

    if ref_logp is not None:
        d = torch.where(keep, ref_logp - logp, 0.0)
        k3 = torch.exp(d) - d - 1.0  # unbiased, always >= 0
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


# ---------------------------------------------------------------------------------------
# 2. Collation: rows -> right-padded teacher-forcing batches
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatch:
    """Sequences `prompt + completion`, right-padded. Position t of `input_ids` predicts
    `targets[:, t]` (token t + 1); `loss_mask` marks targets that are completion tokens.
    T = longest sequence - 1."""

    input_ids: Tensor  # (B, T) int64
    attention_mask: Tensor  # (B, T) int64, 1 = real token, 0 = padding
    targets: Tensor  # (B, T) int64
    loss_mask: Tensor  # (B, T) float32
    old_logp: Tensor  # (B, T) float32: behaviour log-probs at completion targets, else 0
    advantages: Tensor  # (B,) float32
    tokens: int  # completion tokens = loss_mask.sum()


def collate(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
    old_logp: Sequence[Sequence[float]] | None = None,
    advantages: Sequence[float] | None = None,
    device: torch.device | str = "cpu",
) -> MicroBatch:
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    B, T = len(lengths), max(lengths) - 1
    ids = np.full((B, T + 1), pad_id, dtype=np.int64)
    real = np.zeros((B, T + 1), dtype=np.int64)
    loss_mask = np.zeros((B, T), dtype=np.float32)
    behaviour = np.zeros((B, T), dtype=np.float32)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        P, C = len(p), len(c)
        if P == 0:
            raise ValueError(f"sequence {b} has an empty prompt: its first token has no context")
        ids[b, :P] = p
        ids[b, P : P + C] = c
        real[b, : P + C] = 1
        loss_mask[b, P - 1 : P - 1 + C] = 1.0  # logits at P-1+j predict completion token j
        if old_logp is not None:
            behaviour[b, P - 1 : P - 1 + C] = old_logp[b]
    adv = np.zeros(B, dtype=np.float32) if advantages is None else np.asarray(advantages, np.float32)
    return MicroBatch(
        input_ids=torch.from_numpy(ids[:, :-1]).to(device),
        attention_mask=torch.from_numpy(real[:, :-1]).to(device),
        targets=torch.from_numpy(ids[:, 1:]).to(device),
        loss_mask=torch.from_numpy(loss_mask).to(device),
        old_logp=torch.from_numpy(behaviour).to(device),
        advantages=torch.from_numpy(adv).to(device),
        tokens=int(sum(len(c) for c in completions)),
    )


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# ---------------------------------------------------------------------------------------
# 3. The trainer
# ---------------------------------------------------------------------------------------


class GRPOTrainer:
    """GRPO with AdamW on any causal LM that `logits_fn` can run. Single device: the
    device of the model's parameters. Not thread-safe: the train pump calls one method at a
    time (train_step in a worker thread, snapshot on the loop thread between steps)."""

    name = "grpo"

    def __init__(
        self,
        *,
        model: nn.Module,
        logits_fn: LogitsFn,
        pad_id: int,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        grad_clip: float,
        clip_eps: float,
        kl_coef: float,
        ppo_epochs: int,
        micro_batch_size: int,
        temperature: float,
        seed: int,
        loss_type: LossType = "dapo",
        dual_clip: float | None = None,
        scale_rewards: ScaleRewards = "group_population",
        max_completion_length: int | None = None,
        lr_warmup_steps: int = 0,
        lr_decay_steps: int = 0,
        lr_final_ratio: float = 0.1,
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 to define log-probs, got {temperature}")
        if ppo_epochs < 1 or micro_batch_size < 1:
            raise ValueError("ppo_epochs and micro_batch_size must be >= 1")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
        if loss_type == "dr_grpo" and not (max_completion_length or 0) >= 1:
            raise ValueError("loss_type dr_grpo needs max_completion_length >= 1 (the engine's "
                             f"max_new_tokens), got {max_completion_length}")
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
        if lr_warmup_steps < 0 or lr_decay_steps < 0 or not 0.0 <= lr_final_ratio <= 1.0:
            raise ValueError("lr_warmup_steps and lr_decay_steps must be >= 0 and lr_final_ratio "
                             f"in [0, 1], got {lr_warmup_steps}, {lr_decay_steps}, {lr_final_ratio}")
        if scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of "
                             f"{SCALE_REWARDS}")
        self.model = model
        self.logits_fn = logits_fn
        self.pad_id = pad_id
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_final_ratio = lr_final_ratio
        self.grad_clip, self.clip_eps, self.kl_coef = grad_clip, clip_eps, kl_coef
        self.ppo_epochs, self.micro_batch_size = ppo_epochs, micro_batch_size
        self.temperature = temperature
        self.loss_type, self.dual_clip = loss_type, dual_clip
        # Only `batch` concerns the trainer: the other modes are final in the ledger.
        self.scale_rewards = scale_rewards
        self.max_completion_length = max_completion_length
        torch.manual_seed(seed)  # dropout is the only randomness; its state is checkpointed

        self._params = [p for p in model.parameters() if p.requires_grad]  # ties counted once
        self.rl_steps = 0
        self.optimizer = self._adamw(lr)
        self._set_lr()
        self._sft_optimizer: Any = None  # made by the first sft_step
        self._reference: nn.Module | None = None  # made by set_reference (kl_coef > 0)
        self.sft_steps = 0

    def _adamw(self, lr: float) -> Any:
        """AdamW: rollkeep's on the CPU (torch's arithmetic, bit for bit, without the
        ~1 s import of torch._dynamo that any torch.optim optimizer pays), torch's
        elsewhere (`trainers.adamw`)."""
        return make_adamw(self._params, lr=lr, betas=self.betas, weight_decay=self.weight_decay)

    def step_lr(self, step: int) -> float:
        """The learning rate of RL step `step` (counted from 1), with W = lr_warmup_steps,
        D = lr_decay_steps, r = lr_final_ratio:

            step < W       lr x step / W                                  linear warmup
            otherwise      lr x (1 - (1 - r) x min(1, (step - W) / D))    linear decay (D > 0)
                           lr                                             (D = 0)

        A function of the step alone, so a resumed run uses the same rates."""
        w, d = self.lr_warmup_steps, self.lr_decay_steps
        if w and step < w:
            return self.lr * step / w
        if d:
            return self.lr * (1.0 - (1.0 - self.lr_final_ratio) * min(1.0, (step - w) / d))
        return self.lr

    def _set_lr(self) -> float:
        """The optimizer holds the rate of the next RL step (so does a snapshot of it)."""
        lr = self.step_lr(self.rl_steps + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    @property
    def device(self) -> torch.device:
        return self._params[0].device

    # -- RL ------------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> dict[str, float]:
        """`ppo_epochs` AdamW updates on `batch`, rows in batch order (deterministic)."""
        # 1. Flatten the groups into sequences, in batch order, each with its advantage.
        rows, advs = [], []
        for g in batch.groups:
            if len(g.advantages) != len(g.rows):
                raise ValueError(
                    f"group {g.group_id} has {len(g.rows)} rows but {len(g.advantages)} "
                    "advantages: one per generation index"
                )
            rows.extend(g.rows)
            advs.extend(g.advantages)
        if self.scale_rewards == "batch":  # stored group-centred; the std is the batch's
            advs = list(batch_scaled(advs, [r.reward for r in rows]))
        n_tokens = sum(r.tokens for r in rows)
        if self.kl_coef > 0 and self._reference is None:
            self.set_reference()  # default reference: the weights before the first RL step

        # 2. Collate micro-batches once (and the reference log-probs, which never change).
        micro: list[tuple[MicroBatch, Tensor | None]] = []
        for start in range(0, len(rows), self.micro_batch_size):
            chunk = rows[start : start + self.micro_batch_size]
            mb = collate(
                [r.prompt_ids for r in chunk],
                [r.completion_ids for r in chunk],
                pad_id=self.pad_id,
                old_logp=[r.logprobs for r in chunk],
                advantages=advs[start : start + self.micro_batch_size],
                device=self.device,
            )
            ref_logp = None
            if self._reference is not None and self.kl_coef > 0:
                with torch.no_grad():
                    ref_logits = self.logits_fn(self._reference, mb.input_ids, mb.attention_mask)
                    ref_logp = token_logprobs(ref_logits, mb.targets, self.temperature)
            micro.append((mb, ref_logp))

        # 3. PPO epochs: one optimizer step each over the whole batch. Each micro-batch's
        #    loss and stats are its part of the batch's (whole-batch counts passed in), so
        #    they add up; a micro-batch without tokens adds nothing.
        totals = dict.fromkeys(
            ("loss", "clip_frac", "dual_clip_frac", "ratio_mean", "kl", "grad_norm"), 0.0
        )
        self.model.train()
        lr = self._set_lr()
        for _ in range(self.ppo_epochs if n_tokens else 0):  # no tokens: nothing to learn
            self.optimizer.zero_grad(set_to_none=True)
            for mb, ref_logp in micro:
                if mb.tokens == 0:
                    continue
                logits = self.logits_fn(self.model, mb.input_ids, mb.attention_mask)
                logp = token_logprobs(logits, mb.targets, self.temperature)  # (B, T)
                loss, stats = grpo_loss(
                    logp, mb.old_logp, mb.advantages, mb.loss_mask,
                    clip_eps=self.clip_eps, ref_logp=ref_logp, kl_coef=self.kl_coef,
                    loss_type=self.loss_type, dual_clip=self.dual_clip,
                    max_completion_length=self.max_completion_length,
                    batch_sequences=len(rows), batch_tokens=n_tokens, micro_batches=len(micro),
                )
                loss.backward()
                totals["loss"] += loss.item()
                for k, v in stats.items():
                    totals[k] += v.item()
            grad_norm = nn.utils.clip_grad_norm_(self._params, self.grad_clip)
            totals["grad_norm"] += grad_norm.item()
            self.optimizer.step()
        self.rl_steps += 1
        self._set_lr()

        # 4. Metrics (documented in the module docstring).
        epochs = self.ppo_epochs if n_tokens else 1
        metrics = {k: v / epochs for k, v in totals.items()}
        metrics["tokens"] = float(n_tokens)
        metrics["reward_mean"] = sum(r.reward for r in rows) / max(1, len(rows))
        metrics["advantage_abs_mean"] = sum(abs(a) for a in advs) / max(1, len(advs))
        metrics["lr"] = float(lr)
        return metrics

    def set_reference(self) -> None:
        """Freeze a copy of the current weights as the KL reference (kl_coef > 0 only)."""
        if self.kl_coef > 0:
            self._reference = _frozen_copy(self.model)

    # -- supervised warm start ------------------------------------------------------------

    def sft_step(self, sequences: Sequence[tuple[list[int], list[int]]], *, lr: float) -> dict:
        """One AdamW step of cross-entropy on the target tokens of (prompt ids, target ids
        incl. EOS) pairs, token-mean over the batch. Its own optimizer, made on first use."""
        n_tokens = sum(len(t) for _, t in sequences)
        if n_tokens == 0:
            raise ValueError("sft_step needs at least one target token")
        if self._sft_optimizer is None:
            self._sft_optimizer = self._adamw(lr)
        for group in self._sft_optimizer.param_groups:
            group["lr"] = lr

        self.model.train()
        self._sft_optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in _chunks(sequences, self.micro_batch_size):
            mb = collate(
                [p for p, _ in chunk], [t for _, t in chunk], pad_id=self.pad_id, device=self.device
            )
            logits = self.logits_fn(self.model, mb.input_ids, mb.attention_mask)
            nll = -(token_logprobs(logits, mb.targets, 1.0) * mb.loss_mask).sum()
            (nll / n_tokens).backward()
            total += nll.item()
        grad_norm = nn.utils.clip_grad_norm_(self._params, self.grad_clip)
        self._sft_optimizer.step()
        self.sft_steps += 1
        return {"loss": total / n_tokens, "tokens": float(n_tokens),
                "grad_norm": grad_norm.item(), "lr": float(lr)}

    # -- weights for the engine -----------------------------------------------------------

    def weights(self) -> dict[str, Tensor]:
        """A clone of the model's state dict; tied names share one clone, as in the model."""
        state = self.model.state_dict()
        unique, ties = _unique_state(state)
        clones = {k: _clone(v) for k, v in unique.items()}
        return {k: clones[ties.get(k, k)] for k in state}

    def weights_sha256(self) -> str:
        """sha256 over the sorted state-dict names with dtype, shape and raw bytes of each."""
        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            h.update(_raw_bytes(t))
        return h.hexdigest()

    # -- checkpoint -----------------------------------------------------------------------

    def snapshot(self) -> GRPOSnapshot:
        """Copies of everything `load` restores; no serialisation (runs on the loop)."""
        unique, ties = _unique_state(self.model.state_dict())
        optimizers = {"rl": _optimizer_state(self.optimizer)}
        if self._sft_optimizer is not None:
            optimizers["sft"] = _optimizer_state(self._sft_optimizer)
        reference = None
        if self._reference is not None:  # frozen, never mutated: references suffice
            reference = _unique_state(self._reference.state_dict())[0]
        return GRPOSnapshot(
            model={k: _clone(v) for k, v in unique.items()},
            ties=ties,
            optimizers=optimizers,
            rl_steps=self.rl_steps,
            sft_steps=self.sft_steps,
            rng=torch.get_rng_state(),
            reference=reference,
        )

    def load(self, files: Mapping[str, bytes], *, step: int | None = None) -> None:
        """Restore a snapshot's files bit-exactly. Checks everything, then changes state.
        With `step`, every file must declare that step (`rl_steps` is the weight version)."""
        # 1. Check every file against this trainer; nothing changes yet.
        for name in files:
            if name not in ALL_FILES:
                raise _bad(name, f"Unknown trainer file {name!r}", expected=f"only {ALL_FILES}")
        meta = _read_meta(files)
        state = self.model.state_dict()
        unique, ties = _unique_state(state)
        if meta["ties"] != ties:
            raise _bad(
                STATE_FILE, "The checkpoint's tied weights differ from this model's",
                field="ties", expected=json.dumps(ties), found=json.dumps(meta["ties"]),
                remedy=_REMEDY_SHAPE,
            )
        model = _read_tensors(files, MODEL_FILE)
        _check_tensors(model, unique, MODEL_FILE)
        opt_states = _read_optimizers(files, meta, self._params)
        rng = _read_tensors(files, RNG_FILE)
        _check_tensors(rng, {"cpu": torch.get_rng_state()}, RNG_FILE)
        reference = None
        if meta["reference"]:
            reference = _read_tensors(files, REFERENCE_FILE)
            _check_tensors(reference, unique, REFERENCE_FILE)
        elif REFERENCE_FILE in files:
            raise _bad(REFERENCE_FILE, f"{REFERENCE_FILE} is present but {STATE_FILE} says "
                       "there is no reference", field="reference", expected="true",
                       found="false")
        _check_steps(files, meta, step)  # well-formed files, but all of one step?

        # 2. Apply.
        with torch.no_grad():
            self.model.load_state_dict({k: model[ties.get(k, k)] for k in state}, strict=True)
        self.optimizer.load_state_dict(_torch_optimizer_state(self.optimizer, opt_states["rl"]))
        if "sft" in opt_states:
            self._sft_optimizer = self._adamw(meta["optimizers"]["sft"]["param_groups"][0]["lr"])
            self._sft_optimizer.load_state_dict(
                _torch_optimizer_state(self._sft_optimizer, opt_states["sft"])
            )
        else:
            self._sft_optimizer = None
        torch.set_rng_state(rng["cpu"])
        self.rl_steps, self.sft_steps = meta["rl_steps"], meta["sft_steps"]
        self._set_lr()
        self._reference = None
        if reference is not None:
            self._reference = _frozen_copy(self.model)
            with torch.no_grad():
                self._reference.load_state_dict(
                    {k: reference[ties.get(k, k)] for k in state}, strict=True
                )


def _frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


# ---------------------------------------------------------------------------------------
# 4. Snapshot and its files
# ---------------------------------------------------------------------------------------

FORMAT = "rollkeep.grpo/1"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer.json"
RNG_FILE = "rng.safetensors"
REFERENCE_FILE = "reference.safetensors"
ALL_FILES = (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, RNG_FILE, REFERENCE_FILE)
OPTIMIZER_NAMES = ("rl", "sft")


@dataclass(frozen=True)
class OptimizerState:
    """One optimizer's state: tensors keyed `state.{param_index}.{name}`, the non-tensor
    state values under the same keys, and the hyper-parameters of its param groups."""

    tensors: dict[str, Tensor]
    scalars: dict[str, float | int | bool]
    param_groups: list[dict[str, Any]]


@dataclass(frozen=True)
class GRPOSnapshot:
    model: dict[str, Tensor]  # unique tensors only (see ties)
    ties: dict[str, str]  # tied name -> the saved name it shares storage with
    optimizers: dict[str, OptimizerState]  # "rl", and "sft" once the warm start ran
    rl_steps: int
    sft_steps: int
    rng: Tensor  # torch.get_rng_state(), uint8
    reference: dict[str, Tensor] | None

    @property
    def step(self) -> int:
        """The weight version this state is of: RL steps taken (the warm start is step 0)."""
        return self.rl_steps

    def files(self) -> dict[str, bytes]:
        """Serialise (on the checkpoint writer's thread): safetensors and JSON only."""
        optimizer_tensors = {
            f"{opt}.{key}": t for opt, s in self.optimizers.items() for key, t in s.tensors.items()
        }
        meta = {
            "format": FORMAT,
            STEP_KEY: self.rl_steps,
            "rl_steps": self.rl_steps,
            "sft_steps": self.sft_steps,
            "ties": self.ties,
            "reference": self.reference is not None,
            "optimizers": {
                opt: {"param_groups": s.param_groups, "scalars": s.scalars}
                for opt, s in self.optimizers.items()
            },
        }
        bound = step_metadata(self.rl_steps)  # each file says which step it is of
        out = {
            MODEL_FILE: st_save(self.model, metadata=bound),
            OPTIMIZER_FILE: st_save(optimizer_tensors, metadata=bound),
            STATE_FILE: json.dumps(meta, indent=1, sort_keys=True).encode(),
            RNG_FILE: st_save({"cpu": self.rng}, metadata=bound),
        }
        if self.reference is not None:
            out[REFERENCE_FILE] = st_save(self.reference, metadata=bound)
        return out


def _unique_state(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Split a state dict into its unique tensors and ties (name -> earlier name that is the
    same tensor view: same storage, offset, shape, stride and dtype)."""
    unique: dict[str, Tensor] = {}
    ties: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
                 tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in seen:
            ties[name] = seen[ident]
        else:
            seen[ident] = name
            unique[name] = t
    return unique, ties


def _clone(t: Tensor) -> Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format)


def _raw_bytes(t: Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _optimizer_state(opt: Any) -> OptimizerState:
    """Copies of an optimizer's state, params numbered as `Optimizer.state_dict` does."""
    params = [p for group in opt.param_groups for p in group["params"]]
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, float | int | bool] = {}
    for i, p in enumerate(params):
        for name, value in opt.state.get(p, {}).items():
            if torch.is_tensor(value):
                tensors[f"state.{i}.{name}"] = _clone(value)
            else:
                scalars[f"state.{i}.{name}"] = value
    groups = [
        json.loads(json.dumps({k: v for k, v in g.items() if k != "params"}))
        for g in opt.param_groups
    ]
    return OptimizerState(tensors, scalars, groups)


# ---------------------------------------------------------------------------------------
# 5. Reading the files back: check everything, name the file and the tensor
# ---------------------------------------------------------------------------------------

_REMEDY_CORRUPT = (
    "the trainer files of this checkpoint are damaged or were not written by this rollkeep; "
    "restore from an older checkpoint, or start the run fresh."
)
_REMEDY_SHAPE = (
    "the checkpoint was written for a different model or optimizer; resume with the model "
    "config of the run that wrote it (trainer.model), or start the run fresh."
)


def _bad(file: str, what: str, *, field: str | None = None, expected: str | None = None,
         found: str | None = None, remedy: str = _REMEDY_CORRUPT) -> CheckpointError:
    return CheckpointError(what, path=f"trainer/{file}", field=field, expected=expected,
                           found=found, remedy=remedy)


def _read_tensors(files: Mapping[str, bytes], name: str) -> dict[str, Tensor]:
    if name not in files:
        raise _bad(name, f"The trainer file {name} is missing", expected=f"a file {name}",
                   found=f"only {sorted(files)}")
    try:
        return st_load(bytes(files[name]))
    except Exception as err:  # SafetensorError, or whatever a malformed header provokes
        raise _bad(name, f"{name} is not a readable safetensors file",
                   expected="a complete safetensors file", found=f"{type(err).__name__}: {err}"
                   ) from None


def _check_tensors(found: Mapping[str, Tensor], expected: Mapping[str, Tensor], file: str) -> None:
    """`found` must have exactly `expected`'s names, each with its dtype and shape."""
    for name, want in expected.items():
        if name not in found:
            raise _bad(file, f"Tensor {name!r} is missing", field=name,
                       expected=f"{want.dtype} {list(want.shape)}",
                       found=f"{len(found)} other tensors", remedy=_REMEDY_SHAPE)
        got = found[name]
        if got.dtype != want.dtype or got.shape != want.shape:
            raise _bad(file, f"Tensor {name!r} has the wrong dtype or shape", field=name,
                       expected=f"{want.dtype} {list(want.shape)}",
                       found=f"{got.dtype} {list(got.shape)}", remedy=_REMEDY_SHAPE)
    for name in found:
        if name not in expected:
            raise _bad(file, f"Unexpected tensor {name!r}", field=name,
                       expected=f"only the {len(expected)} tensors of this model", found=name,
                       remedy=_REMEDY_SHAPE)


def _read_meta(files: Mapping[str, bytes]) -> dict[str, Any]:
    if STATE_FILE not in files:
        raise _bad(STATE_FILE, f"The trainer file {STATE_FILE} is missing",
                   found=f"only {sorted(files)}")
    try:
        meta = loads_json(files[STATE_FILE])
    except ValueError as err:
        raise _bad(STATE_FILE, f"{STATE_FILE} is not valid JSON", found=str(err)) from None
    shape = {"format": str, "rl_steps": int, "sft_steps": int, "ties": dict,
             "reference": bool, "optimizers": dict}
    if isinstance(meta, dict) and STEP_KEY in meta:  # absent in files written before the binding
        shape[STEP_KEY] = int
    if not isinstance(meta, dict):
        raise _bad(STATE_FILE, f"{STATE_FILE} is not a JSON object", found=type(meta).__name__)
    for key, typ in shape.items():
        value = meta.get(key)
        if not isinstance(value, typ) or (typ is int and (isinstance(value, bool) or value < 0)):
            raise _bad(STATE_FILE, f"Field {key!r} is missing or of the wrong type", field=key,
                       expected=typ.__name__ + (" >= 0" if typ is int else ""),
                       found=repr(value)[:80])
    if meta["format"] != FORMAT:
        raise _bad(STATE_FILE, "Unsupported trainer checkpoint format", field="format",
                   expected=FORMAT, found=repr(meta["format"]))
    if set(meta) != set(shape):
        raise _bad(STATE_FILE, "Unknown fields", expected=str(sorted(shape)),
                   found=str(sorted(set(meta) - set(shape))))
    opts = meta["optimizers"]
    if "rl" not in opts or not set(opts) <= set(OPTIMIZER_NAMES):
        raise _bad(STATE_FILE, "Wrong optimizer list", field="optimizers",
                   expected='"rl", optionally "sft"', found=str(sorted(opts)))
    for opt, entry in opts.items():
        groups = entry.get("param_groups") if isinstance(entry, dict) else None
        if not (isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], dict)
                and isinstance(groups[0].get("lr"), float | int)
                and isinstance(entry.get("scalars"), dict)):
            raise _bad(STATE_FILE, f"Optimizer {opt!r} is malformed", field=f"optimizers.{opt}",
                       expected='{"param_groups": [{"lr": <float>, ...}], "scalars": {...}}',
                       found=repr(entry)[:120])
    return meta


def _check_steps(files: Mapping[str, bytes], meta: Mapping[str, Any], step: int | None) -> None:
    """Every file declares the same step: `rl_steps` (trainer.json's `rollkeep_step`, and
    each safetensors file's metadata). A file copied from another checkpoint is refused."""
    bound = STEP_KEY in meta
    if bound and meta[STEP_KEY] != meta["rl_steps"]:
        raise _bad(STATE_FILE, f"{STEP_KEY} and rl_steps disagree", field=STEP_KEY,
                   expected=str(meta["rl_steps"]), found=str(meta[STEP_KEY]))
    check_step(STATE_FILE, meta["rl_steps"], step)
    for name, data in sorted(files.items()):
        if not name.endswith(".safetensors"):
            continue
        try:
            declared = declared_step(name, data)
        except ValueError as err:
            raise _bad(name, f"{name} is not a readable safetensors file", found=str(err)) from None
        if bound or declared is not None:
            check_step(name, declared, meta["rl_steps"])


def _read_optimizers(
    files: Mapping[str, bytes], meta: Mapping[str, Any], params: Sequence[Tensor]
) -> dict[str, dict[int, dict[str, Any]]]:
    """optimizer.safetensors (+ scalars) -> {opt: {param_index: {name: value}}}, checked:
    known optimizers, indices in range, moments shaped like their parameter, 0-d steps."""
    tensors = _read_tensors(files, OPTIMIZER_FILE)
    out: dict[str, dict[int, dict[str, Any]]] = {opt: {} for opt in meta["optimizers"]}
    values = list(tensors.items())
    for opt, entry in meta["optimizers"].items():
        values += [(f"{opt}.{k}", v) for k, v in entry["scalars"].items()]
    for key, value in values:
        opt, _, rest = key.partition(".")
        parts = rest.split(".")
        field = key
        if opt not in out or len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise _bad(OPTIMIZER_FILE, f"Unexpected optimizer state {key!r}", field=field,
                       expected=f"{{opt}}.state.{{param_index}}.{{name}}, opt in {sorted(out)}",
                       found=key)
        index, name = int(parts[1]), parts[2]
        if index >= len(params):
            raise _bad(OPTIMIZER_FILE, f"Optimizer state {key!r} names no parameter", field=field,
                       expected=f"param_index < {len(params)}", found=str(index),
                       remedy=_REMEDY_SHAPE)
        p = params[index]
        if torch.is_tensor(value):
            want = (torch.Size([]), None) if name == "step" else (p.shape, p.dtype)
            if value.shape != want[0] or (want[1] is not None and value.dtype != want[1]):
                raise _bad(OPTIMIZER_FILE, f"Optimizer state {key!r} does not fit parameter "
                           f"{index}", field=field,
                           expected=f"shape {list(want[0])}" + (f" {want[1]}" if want[1] else ""),
                           found=f"shape {list(value.shape)} {value.dtype}",
                           remedy=_REMEDY_SHAPE)
            value = value.clone()  # the optimizer updates it in place
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(STATE_FILE, f"Optimizer scalar {key!r} is not a number", field=field,
                       found=repr(value)[:80])
        out[opt].setdefault(index, {})[name] = value
    return out


def _torch_optimizer_state(opt: Any, state: dict[int, dict[str, Any]]) -> dict:
    """`Optimizer.load_state_dict` input: the checkpoint's state with this optimizer's own
    param groups (hyper-parameters come from the config)."""
    groups, start = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + n))})
        start += n
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------------
# 6. The built-in GPT
# ---------------------------------------------------------------------------------------


class TorchTrainer(GRPOTrainer):
    """GRPO on the built-in tiny GPT (`trainer.name = torch`)."""

    name = "torch"

    def __init__(
        self, cfg: TorchTrainerConfig, *, model: GPT, tokenizer: Any, temperature: float,
        seed: int, max_completion_length: int | None = None,
    ) -> None:
        """`temperature` and `max_completion_length` (dr_grpo's L_max) are the engine's
        `temperature` and `max_new_tokens`, handed over by the builder."""
        want = cfg.model
        vocab = want.vocab_size if want.vocab_size is not None else tokenizer.vocab_size
        for field, expected in (("vocab_size", vocab), ("n_layer", want.n_layer),
                                ("n_head", want.n_head), ("n_embd", want.n_embd),
                                ("block_size", want.block_size), ("dropout", want.dropout)):
            if getattr(model.cfg, field) != expected:
                raise ValueError(f"model.cfg.{field} = {getattr(model.cfg, field)} but "
                                 f"trainer.model asks for {expected}")
        if model.cfg.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"the model's vocabulary ({model.cfg.vocab_size}) is smaller than "
                             f"the tokenizer's ({tokenizer.vocab_size})")
        self.tokenizer = tokenizer
        super().__init__(
            model=model,
            logits_fn=lambda m, ids, mask: m(ids),  # causal: right padding never looks back
            pad_id=PAD,
            temperature=temperature,
            seed=seed,
            max_completion_length=max_completion_length,
            **hyperparameters(cfg),
        )


def hyperparameters(cfg: Any) -> dict[str, Any]:
    """The GRPO settings shared by every trainer config section (torch, hf)."""
    return {
        "lr": cfg.lr,
        "lr_warmup_steps": cfg.lr_warmup_steps,
        "lr_decay_steps": cfg.lr_decay_steps,
        "lr_final_ratio": cfg.lr_final_ratio,
        "weight_decay": cfg.weight_decay,
        "betas": cfg.betas,
        "grad_clip": cfg.grad_clip,
        "clip_eps": cfg.clip_eps,
        "kl_coef": cfg.kl_coef,
        "ppo_epochs": cfg.ppo_epochs,
        "micro_batch_size": cfg.micro_batch_size,
        "loss_type": cfg.loss_type,
        "dual_clip": cfg.dual_clip,
        "scale_rewards": cfg.scale_rewards,
    }

