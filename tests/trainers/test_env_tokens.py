"""Multi-turn trajectories: the environment's tokens (negative versions) are context, not
actions. They get no loss and no gradient, and are not counted as the batch's tokens; a
trajectory without them trains exactly as before."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollkeep.core.rollout.rows import Row
from rollkeep.envs.base import ENV_VERSION
from rollkeep.models.gpt import GPT, GPTConfig
from rollkeep.models.tokenizer import EOS, PAD, CharTokenizer
from rollkeep.trainers import Batch, TrainGroup
from rollkeep.trainers.batching import collate, model_tokens
from rollkeep.trainers.grpo import GRPOTrainer

TOK = CharTokenizer()
E = ENV_VERSION


@dataclass(frozen=True)
class _Trajectory:
    """The Row fields a trainer reads; stands in for Row while core/rollout/rows.py still refuses
    negative versions (relaxed to allow ENV_VERSION on main)."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float = 0.0
    finish_reason: str = "stop"

    @property
    def tokens(self) -> int:
        return len(self.completion_ids)


def trajectory(prompt, completion, logprobs, versions):
    arrays = dict(prompt_ids=np.asarray(prompt, np.int32), completion_ids=np.asarray(completion, np.int32),
                  logprobs=np.asarray(logprobs, np.float32), versions=np.asarray(versions, np.int32))
    try:
        return Row(**arrays, reward=0.0, finish_reason="stop")
    except ValueError:  # Row does not accept ENV_VERSION yet
        return _Trajectory(**arrays)


def test_collate_masks_environment_targets() -> None:
    # prompt [1, 5]; completion: model 7, EOS, env 8 9, model 6, EOS
    completion, versions = [7, EOS, 8, 9, 6, EOS], [3, 3, E, E, 3, 3]
    mb = collate([[1, 5]], [completion], pad_id=PAD, old_logp=[[-1, -1, 0, 0, -1, -1]], versions=[versions])
    assert mb.targets.tolist() == [[5, 7, EOS, 8, 9, 6, EOS]]
    assert mb.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1, 1]]
    assert mb.tokens == 4 == model_tokens(versions)
    plain = collate([[1, 5]], [completion], pad_id=PAD)
    assert plain.loss_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1]] and plain.tokens == 6


def test_collate_without_environment_tokens_is_unchanged() -> None:
    prompts, completions = [[1, 5, 6], [1, 9]], [[7, 2], [2]]
    a = collate(prompts, completions, pad_id=PAD, old_logp=[[-0.5, -0.25], [-1.0]], advantages=[1.0, -1.0])
    b = collate(prompts, completions, pad_id=PAD, old_logp=[[-0.5, -0.25], [-1.0]], advantages=[1.0, -1.0],
                versions=[[0, 4], [7]])
    for field in ("input_ids", "attention_mask", "targets", "loss_mask", "old_logp", "advantages"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.tokens == b.tokens == 3


def _trainer(loss_type: str = "dapo") -> GRPOTrainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=32))
    return GRPOTrainer(model=model, logits_fn=lambda m, ids, mask: m(ids), pad_id=PAD, lr=1e-2,
                       weight_decay=0.0, betas=(0.9, 0.95), grad_clip=1.0, clip_eps=0.2, kl_coef=0.0,
                       ppo_epochs=2, micro_batch_size=64, temperature=1.0, seed=0, loss_type=loss_type,
                       max_completion_length=16)


def _step(rows, loss_type: str = "dapo") -> tuple[dict, dict]:
    tr = _trainer(loss_type)
    batch = Batch(step=1, groups=(TrainGroup(group_id="g", epoch=0, ordinal=0, idx=0, task="calc",
                                             advantages=(1.0, -1.0), rows=tuple(rows)),))
    metrics = tr.train_step(batch)
    return metrics, {k: v.clone() for k, v in tr.model.state_dict().items()}


PROMPT = TOK.encode("37*48=")
TURN1 = TOK.encode("CALC(37*48)", bos=False) + [EOS]
TURN2 = TOK.encode("1776", bos=False) + [EOS]


def _episode(response: str, env_logprob: float = 0.0, tail: str = ""):
    """Turn 1, the environment's `response`, turn 2, then `tail` (environment tokens at the
    end: a trajectory cut after a response)."""
    resp, end = TOK.encode(response, bos=False), TOK.encode(tail, bos=False)
    ids = TURN1 + resp + TURN2 + end
    versions = [0] * len(TURN1) + [E] * len(resp) + [0] * len(TURN2) + [E] * len(end)
    logprobs = [-1.0] * len(TURN1) + [env_logprob] * len(resp) + [-1.0] * len(TURN2) + [env_logprob] * len(end)
    return trajectory(PROMPT, ids, logprobs, versions)


def test_environment_tokens_get_no_loss_and_no_gradient() -> None:
    other = trajectory(PROMPT, TOK.encode("1775", bos=False) + [EOS], [-1.0] * 5, [0] * 5)
    for loss_type in ("dapo", "grpo", "dr_grpo", "bnpo"):
        base_m, base_w = _step([_episode("=1776;", tail="=5;"), other], loss_type)
        # The environment's targets (the trailing response is never an input to a model
        # token) and its log-probs change: nothing the trainer computes does.
        m, w = _step([_episode("=1776;", env_logprob=-7.0, tail="=?;"), other], loss_type)
        assert m == base_m, loss_type
        assert all(torch.equal(w[k], base_w[k]) for k in w), loss_type
        # Only model tokens are counted: 12 + 5 of the first episode, 5 of the other.
        assert base_m["tokens"] == len(TURN1) + len(TURN2) + 5
    # A model token's target does change the step (the comparison is not vacuous).
    bad = trajectory(PROMPT, TURN1 + TOK.encode("=1776;", bos=False) + TOK.encode("1777", bos=False) + [EOS],
                     [-1.0] * 23, [0] * 12 + [E] * 6 + [0] * 5)
    base_m, _ = _step([_episode("=1776;", tail="=5;"), other])
    m, _ = _step([bad, other])
    assert m["loss"] != base_m["loss"]
