"""GRPO: group-relative policy optimisation with a PPO-style clipped ratio (after CleanRL's
`ppo.py`). Read top to bottom: the trainer (one `train_step` = `ppo_epochs` optimizer
updates on one batch), then the built-in GPT wiring. The objective it minimises, every
formula and option, is in `grpo_loss`; the collation of rows into padded batches in
`batching`; its checkpoint files and the checks on reading them back in `grpo_snapshot`.

Metrics returned by `train_step` (floats; averaged over the PPO epochs of the step)
---------------------------------------------------------------------------------------
The token statistics (clip_frac, dual_clip_frac, ratio_mean, kl) are token means over the
whole batch under every `loss_type`: they describe the tokens, not the weighting.

    loss                the minimised objective (`grpo_loss`), aggregated by `loss_type`
    clip_frac           fraction of completion tokens whose PPO-clipped branch is active,
                        i.e. the clip removed their gradient (ratio > 1+eps with A > 0, or
                        ratio < 1-eps with A < 0); high values mean the policy moved far
                        from the behaviour policy (stale batch, or too large a step)
    dual_clip_frac      fraction of completion tokens the dual clip caps (A < 0 and
                        ratio > c); 0 when `dual_clip` is off. Disjoint from clip_frac
    ratio_mean          token-mean of the ratio; ~1 on-policy, drifts with staleness (under
                        `off_policy: tis | mis` the ratio is against the step's own
                        starting weights, so 1 in the first PPO epoch)
    kl                  token-mean k3 estimate of KL(policy || reference); 0 without one
    grad_norm           global gradient norm before clipping to `grad_clip`
    tokens              model-written completion tokens in the batch (Σ L_i; a
                        multi-turn trajectory's environment tokens are not counted)
    reward_mean         mean reward of the batch's completions
    advantage_abs_mean  mean |advantage| over the batch's completions, as trained on (after
                        the `batch` division); 0 when every group scored all its siblings
                        alike (such a batch teaches nothing)
    lr                  the AdamW learning rate used: `lr`, or less during the linear
                        warmup (`lr_warmup_steps`) and the linear decay (`lr_decay_steps`,
                        to `lr_final_ratio` x `lr`); `GRPOTrainer.step_lr` has the formula
    off_policy/*        how far the behaviour policy was from the trainer's weights
                        (mismatch KL, importance ratios, per version lag), in every
                        `off_policy` mode: `off_policy` has the list and the formulas

Metrics returned by `sft_step` (the supervised warm start)
----------------------------------------------------------
    loss       token-mean cross-entropy of the target tokens (before the update)
    tokens     target tokens in the batch
    grad_norm  global gradient norm before clipping
    lr         the learning rate used
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
from torch import Tensor

from ..config import TorchTrainerConfig
from ..core.rollout.advantages import SCALE_REWARDS, ScaleRewards, batch_scaled
from ..models.gpt import GPT
from ..models.tokenizer import PAD
from . import off_policy
from .adamw import make_adamw
from .base import Batch
from .batching import MicroBatch, _chunks, collate, model_tokens
from .grpo_loss import LOSS_TYPES, LossType, grpo_loss, token_logprobs
from .grpo_snapshot import (
    _REMEDY_SHAPE,
    ALL_FILES,
    MODEL_FILE,
    OPTIMIZER_FILE,
    REFERENCE_FILE,
    RNG_FILE,
    SHARDED_FILES,
    SHARDED_FORMAT,
    STATE_FILE,
    GRPOSnapshot,
    TrainerFiles,
    Verified,
    _bad,
    _check_steps,
    _check_tensors,
    _clone,
    _optimizer_state,
    _read_meta,
    _read_optimizers,
    _read_tensors,
    _torch_optimizer_state,
    _unique_state,
)
from .off_policy import IS_LEVELS, OFF_POLICY_MODES, IsLevel, OffPolicy
from .shards import SHARD_DIR, read_shards
from .shards import split as split_shards

# GRPOSnapshot, grpo_loss and token_logprobs are defined in grpo_snapshot and grpo_loss;
# they were public here before the split and stay importable from here.
__all__ = ["GRPOSnapshot", "GRPOTrainer", "TorchTrainer", "grpo_loss", "token_logprobs"]

Autocast = Literal["none", "bf16"]
AUTOCASTS: tuple[str, ...] = ("none", "bf16")
LogitsFn = Callable[[nn.Module, Tensor, Tensor], Tensor]  # (model, ids, mask) -> logits


# ---------------------------------------------------------------------------------------
# 1. The trainer
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
        autocast: Autocast = "none",
        off_policy: OffPolicy = "none",
        is_cap: float = 2.0,
        is_level: IsLevel = "token",
        kl_clamp: float | None = None,
        log_ratio_clamp: float | None = None,
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
        if autocast not in AUTOCASTS:
            raise ValueError(f"unknown autocast {autocast!r}; expected one of {AUTOCASTS}")
        if off_policy not in OFF_POLICY_MODES or is_level not in IS_LEVELS or not is_cap > 1.0:
            raise ValueError(f"off_policy must be one of {OFF_POLICY_MODES}, is_level one of {IS_LEVELS} and "
                             f"is_cap > 1, got {off_policy!r}, {is_level!r}, {is_cap}")
        for name, c in (("kl_clamp", kl_clamp), ("log_ratio_clamp", log_ratio_clamp)):
            if c is not None and not c > 0:
                raise ValueError(f"{name} must be > 0 (or None), got {c}")
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
        self.autocast = autocast
        self.off_policy, self.is_cap, self.is_level = off_policy, is_cap, is_level
        self.kl_clamp, self.log_ratio_clamp = kl_clamp, log_ratio_clamp
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
        rows, advs = flatten(batch, self.scale_rewards)
        # Model tokens only: environment tokens (negative versions) are masked out of the
        # loss, so they must not dilute its normalisation either.
        n_tokens = sum(model_tokens(r.versions) for r in rows)
        totals, lr = self.update(micro_chunks(rows, advs, self.micro_batch_size), n_rows=len(rows),
                                 n_tokens=n_tokens)
        return step_metrics(totals, rows, advs, n_tokens, lr, self.ppo_epochs if n_tokens else 1)

    def update(self, chunks: Sequence[tuple[Sequence[Any], Sequence[float]]], *, n_rows: int,
               n_tokens: int, n_micro: int | None = None, passes: int = 0) -> tuple[dict[str, float], float]:
        """The PPO epochs of one RL step over `chunks`, micro-batches of (rows, advantages)
        that are this process's part of a batch of `n_rows` sequences, `n_tokens` model
        tokens and `n_micro` micro-batches (default: these are the whole batch). Each
        micro-batch's loss and stats are its part of the batch's (whole-batch counts), so
        parts add up across micro-batches and across ranks. `passes`: forward/backward
        passes to run per epoch at least (a rank runs as many as the busiest one; the extra
        ones weigh nothing). Returns the totals summed over epochs, and the rate used."""
        if self.kl_coef > 0 and self._reference is None:
            self.set_reference()  # default reference: the weights before the first RL step
        n_micro = len(chunks) if n_micro is None else n_micro

        # Collate micro-batches once (and the reference log-probs, which never change).
        micro: list[tuple[MicroBatch, Tensor | None]] = []
        for chunk, chunk_advs in chunks:
            mb = collate(
                [r.prompt_ids for r in chunk],
                [r.completion_ids for r in chunk],
                pad_id=self.pad_id,
                old_logp=[r.logprobs for r in chunk],
                advantages=list(chunk_advs),
                versions=[r.versions for r in chunk],
                device=self.device,
            )
            ref_logp = None
            if self._reference is not None and self.kl_coef > 0:
                with torch.no_grad():
                    ref_logp = token_logprobs(self._forward(self._reference, mb), mb.targets, self.temperature)
            micro.append((mb, ref_logp))

        # PPO epochs: one optimizer step each over the whole batch; a micro-batch without
        # tokens adds nothing (in lockstep it still runs, weighing nothing).
        totals = dict.fromkeys(
            ("loss", "clip_frac", "dual_clip_frac", "ratio_mean", "kl", "grad_norm"), 0.0
        ) | off_policy.zero_sums()
        # The off-policy weights (and proximal log-probs) of each micro-batch, from the first
        # epoch's forward pass: the weights before any update (off_policy module docstring).
        corrections: dict[int, tuple[Tensor, Tensor | None]] = {}
        self.model.train()
        lr = self._set_lr()
        for epoch in range(self.ppo_epochs if n_tokens else 0):  # no tokens: nothing to learn
            self.optimizer.zero_grad(set_to_none=True)
            for i in range(max(passes, len(micro))):
                if i >= len(micro):
                    self._backward(self._idle_loss())
                    continue
                mb, ref_logp = micro[i]
                if mb.tokens == 0 and not passes:
                    continue
                logp = token_logprobs(self._forward(self.model, mb), mb.targets, self.temperature)  # (B, T)
                if epoch == 0:
                    prox = logp.detach()
                    weights = off_policy.correction(
                        prox, mb.old_logp, mb.loss_mask, mb.versions, mode=self.off_policy,
                        level=self.is_level, cap=self.is_cap, trainer_version=self.rl_steps, sums=totals)
                    corrections[i] = (prox, weights)
                prox, weights = corrections[i]
                loss, stats = grpo_loss(
                    logp, mb.old_logp if self.off_policy == "none" else prox, mb.advantages, mb.loss_mask,
                    clip_eps=self.clip_eps, ref_logp=ref_logp, kl_coef=self.kl_coef,
                    loss_type=self.loss_type, dual_clip=self.dual_clip,
                    max_completion_length=self.max_completion_length,
                    batch_sequences=n_rows, batch_tokens=n_tokens, micro_batches=n_micro,
                    is_weights=weights, kl_clamp=self.kl_clamp, log_ratio_clamp=self.log_ratio_clamp,
                )
                self._backward(loss)
                totals["loss"] += loss.item()
                for k, v in stats.items():
                    totals[k] += v.item()
            totals["grad_norm"] += self._clip_grad_norm()
            self.optimizer.step()
        self.rl_steps += 1
        self._set_lr()
        return totals, lr

    def _forward(self, model: nn.Module, mb: MicroBatch) -> Tensor:
        """The logits of `mb` under `model`, in bf16 autocast when `autocast: bf16` (the
        weights, gradients and AdamW state stay in their own dtype)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast == "bf16"):
            return self.logits_fn(model, mb.input_ids, mb.attention_mask)

    # The seams a data-parallel rank overrides (rollkeep.trainers.rank): how a loss part is
    # backpropagated, what an idle pass computes, how the gradient norm is taken.

    def _backward(self, loss: Tensor) -> None:
        loss.backward()

    def _idle_loss(self) -> Tensor:
        raise AssertionError("a single process never runs an idle pass")

    def _clip_grad_norm(self) -> float:
        return float(nn.utils.clip_grad_norm_(self._params, self.grad_clip).item())

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
        total, grad_norm = self.sft_update(list(_chunks(sequences, self.micro_batch_size)),
                                           n_tokens=n_tokens, lr=lr)
        return {"loss": total / n_tokens, "tokens": float(n_tokens), "grad_norm": grad_norm, "lr": float(lr)}

    def sft_update(self, chunks: Sequence[Sequence[tuple[list[int], list[int]]]], *, n_tokens: int,
                   lr: float, passes: int = 0) -> tuple[float, float]:
        """The supervised step over `chunks`, this process's micro-batches of a batch of
        `n_tokens` target tokens (`passes` as in `update`). Returns (summed nll, grad norm)."""
        if self._sft_optimizer is None:
            self._sft_optimizer = self._adamw(lr)
        for group in self._sft_optimizer.param_groups:
            group["lr"] = lr

        self.model.train()
        self._sft_optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            mb = collate(
                [p for p, _ in chunk], [t for _, t in chunk], pad_id=self.pad_id, device=self.device
            )
            nll = -(token_logprobs(self._forward(self.model, mb), mb.targets, 1.0) * mb.loss_mask).sum()
            self._backward(nll / n_tokens)
            total += nll.item()
        for _ in range(passes - len(chunks)):
            self._backward(self._idle_loss())
        grad_norm = self._clip_grad_norm()
        self._sft_optimizer.step()
        self.sft_steps += 1
        return total, grad_norm

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

    def verify(self, dir: Path, *, step: int | None = None) -> Verified:
        """Read and check every file `load` restores from (a one-process checkpoint, or the
        shards of a sharded one, `shards`), against this trainer's model; nothing changes.
        Raises CheckpointError naming the file and the tensor."""
        files = TrainerFiles(dir)
        meta = _read_meta(files)
        sharded = meta["format"] == SHARDED_FORMAT
        allowed = SHARDED_FILES if sharded else ALL_FILES
        for name in files:
            if name not in allowed and not (sharded and name.startswith(SHARD_DIR + "/")):
                raise _bad(name, f"Unknown trainer file {name!r}", expected=f"only {allowed}")
        unique, ties = _unique_state(self.model.state_dict())
        if meta["ties"] != ties:
            raise _bad(
                STATE_FILE, "The checkpoint's tied weights differ from this model's",
                field="ties", expected=json.dumps(ties), found=json.dumps(meta["ties"]),
                remedy=_REMEDY_SHAPE,
            )
        if sharded:
            _check_steps(files, meta, step)  # before reading every shard: a directory of another step costs nothing
            model, optimizer, other = split_shards(read_shards(files.dir, world_size=meta["world_size"],
                                                               step=meta["rl_steps"]))
            if other:
                raise _bad(SHARD_DIR, f"Unexpected tensor {other[0]!r} in the shards", field=other[0],
                           expected="model.* and optimizer.* tensors", found=other[0], remedy=_REMEDY_SHAPE)
            rng = _read_tensors(files, RNG_FILE)
            _check_tensors(rng, {f"rank{r}": torch.get_rng_state() for r in range(meta["world_size"])},
                           RNG_FILE)
        else:
            model = _read_tensors(files, MODEL_FILE)
            optimizer = _read_tensors(files, OPTIMIZER_FILE)
            cpu = _read_tensors(files, RNG_FILE)
            _check_tensors(cpu, {"cpu": torch.get_rng_state()}, RNG_FILE)
            rng = {"rank0": cpu["cpu"]}
        _check_tensors(model, unique, MODEL_FILE if not sharded else SHARD_DIR)
        opt_states = _read_optimizers(optimizer, meta, self._params)
        reference = None
        if meta["reference"]:
            reference = _read_tensors(files, REFERENCE_FILE)
            _check_tensors(reference, unique, REFERENCE_FILE)
        elif REFERENCE_FILE in files:
            raise _bad(REFERENCE_FILE, f"{REFERENCE_FILE} is present but {STATE_FILE} says "
                       "there is no reference", field="reference", expected="true",
                       found="false")
        if not sharded:
            _check_steps(files, meta, step)  # well-formed files, but all of one step?
        return Verified(meta, model, opt_states, rng, reference)

    def load(self, dir: Path, *, step: int | None = None) -> None:
        """Restore the files a snapshot saved into `dir` bit-exactly. Checks everything,
        then changes state (nothing in `dir`). With `step`, every file must declare that
        step (`rl_steps` is the weight version)."""
        self.restore(self.verify(dir, step=step))  # every file checked before anything changes

    def restore(self, v: Verified) -> None:
        """Apply what `verify` read, bit-exactly."""
        meta, model, opt_states, rng, reference = v.meta, v.model, v.optimizers, v.rng, v.reference
        state = self.model.state_dict()
        ties = meta["ties"]
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
        torch.set_rng_state(rng["rank0"])
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


def _raw_bytes(t: Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def flatten(batch: Batch, scale_rewards: str) -> tuple[list[Any], list[float]]:
    """A batch's rows in batch order, each with the advantage it is trained on (under
    `scale_rewards: batch`, divided by the batch's reward std here)."""
    rows, advs = [], []
    for g in batch.groups:
        if len(g.advantages) != len(g.rows):
            raise ValueError(
                f"group {g.group_id} has {len(g.rows)} rows but {len(g.advantages)} "
                "advantages: one per generation index"
            )
        rows.extend(g.rows)
        advs.extend(g.advantages)
    if scale_rewards == "batch":  # stored group-centred; the std is the batch's
        advs = list(batch_scaled(advs, [r.reward for r in rows]))
    return rows, advs


def micro_chunks(rows: Sequence[Any], advs: Sequence[float], size: int) -> list[tuple[Sequence[Any], Sequence[float]]]:
    """Consecutive micro-batches of `size` sequences (the last may be shorter)."""
    return [(rows[s : s + size], advs[s : s + size]) for s in range(0, len(rows), size)]


def step_metrics(totals: dict[str, float], rows: Sequence[Any], advs: Sequence[float], n_tokens: int,
                 lr: float, epochs: int) -> dict[str, float]:
    """The metrics of `train_step` (module docstring) from the summed totals of `update`."""
    metrics = {k: v / epochs for k, v in totals.items() if not k.startswith(off_policy.PREFIX)}
    metrics |= off_policy.metrics(totals)  # computed once, in the first epoch
    metrics["tokens"] = float(n_tokens)
    metrics["reward_mean"] = sum(r.reward for r in rows) / max(1, len(rows))
    metrics["advantage_abs_mean"] = sum(abs(a) for a in advs) / max(1, len(advs))
    metrics["lr"] = float(lr)
    return metrics


# ---------------------------------------------------------------------------------------
# 2. The built-in GPT
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
        "autocast": cfg.autocast,
        "off_policy": cfg.off_policy,
        "is_cap": cfg.is_cap,
        "is_level": cfg.is_level,
        "kl_clamp": cfg.kl_clamp,
        "log_ratio_clamp": cfg.log_ratio_clamp,
    }

