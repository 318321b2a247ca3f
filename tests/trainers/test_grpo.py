"""The GRPO trainer: the objective against hand-computed values, learning direction,
gradient accumulation, a bit-exact checkpoint round trip, and checkpoint errors."""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from trainer_files import as_dir, files_of

from rollkeep.config import TorchModelConfig, TorchTrainerConfig
from rollkeep.core.errors import CheckpointError
from rollkeep.core.rollout.rows import Row
from rollkeep.models.gpt import GPT, GPTConfig
from rollkeep.models.tokenizer import EOS, PAD, CharTokenizer
from rollkeep.trainers import Batch, TrainGroup, make_trainer
from rollkeep.trainers.batching import collate
from rollkeep.trainers.grpo import GRPOTrainer, TorchTrainer
from rollkeep.trainers.grpo_loss import grpo_loss, token_logprobs

TOK = CharTokenizer()
LN = math.log


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls: a second OpenMP thread only adds spin-waiting (75x slower on a busy
    # 2-core machine). Restored afterwards for the other test modules.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# token_logprobs
# ---------------------------------------------------------------------------------------


def test_token_logprobs_hand_computed():
    # Vocabulary of 2, logits [0, ln 3]: softmax = [1/4, 3/4].
    logits = t([[[0.0, LN(3)], [0.0, LN(3)]]])  # (B=1, T=2, V=2)
    got = token_logprobs(logits, torch.tensor([[1, 0]]), 1.0)
    assert got.dtype == torch.float32 and got.shape == (1, 2)
    torch.testing.assert_close(got, t([[LN(0.75), LN(0.25)]]))
    # Temperature 2: logits [0, ln3 / 2] -> probs [1, sqrt 3] / (1 + sqrt 3).
    got = token_logprobs(logits.double(), torch.tensor([[0, 1]]), 2.0)
    assert got.dtype == torch.float32
    s3 = math.sqrt(3)
    torch.testing.assert_close(got, t([[-LN(1 + s3), LN(s3 / (1 + s3))]]))


# ---------------------------------------------------------------------------------------
# grpo_loss
# ---------------------------------------------------------------------------------------


def test_grpo_loss_unclipped():
    # ratios 1.1 and 0.9 (inside [0.8, 1.2]), A = +1: surrogate = [1.1, 0.9];
    # loss = -(1.1 + 0.9) / 2 = -1.0; ratio_mean = 1.0; nothing clipped.
    logp = t([[LN(1.1), LN(0.9)]]).requires_grad_()
    loss, st = grpo_loss(logp, t([[0.0, 0.0]]), t([1.0]), t([[1, 1]]), clip_eps=0.2)
    torch.testing.assert_close(loss, t(-1.0))
    torch.testing.assert_close(st["ratio_mean"], t(1.0))
    assert st["clip_frac"].item() == 0.0 and st["kl"].item() == 0.0
    # d loss / d logp = -ratio * A / N = [-0.55, -0.45]
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-0.55, -0.45]]))


def test_grpo_loss_clipped_positive_advantage():
    # A = +1, eps = 0.2. ratio 1.5: min(1.5, 1.2) = 1.2 (clipped branch, no gradient);
    # ratio 0.5: min(0.5, 0.8) = 0.5 (unclipped). loss = -(1.2 + 0.5) / 2 = -0.85.
    logp = t([[LN(1.5), LN(0.5)]]).requires_grad_()
    loss, st = grpo_loss(logp, t([[0.0, 0.0]]), t([1.0]), t([[1, 1]]), clip_eps=0.2)
    torch.testing.assert_close(loss, t(-0.85))
    torch.testing.assert_close(st["clip_frac"], t(0.5))
    torch.testing.assert_close(st["ratio_mean"], t(1.0))
    loss.backward()  # clipped token: 0; the other: -ratio * A / N = -0.5 / 2
    torch.testing.assert_close(logp.grad, t([[0.0, -0.25]]))


def test_grpo_loss_clipped_negative_advantage():
    # A = -1. ratio 0.5: min(-0.5, -0.8) = -0.8 (clipped); ratio 1.5: min(-1.5, -1.2) = -1.5
    # (unclipped: a bad token made likelier is never let off). loss = -(-0.8 - 1.5)/2 = 1.15.
    logp = t([[LN(0.5), LN(1.5)]]).requires_grad_()
    loss, st = grpo_loss(logp, t([[0.0, 0.0]]), t([-1.0]), t([[1, 1]]), clip_eps=0.2)
    torch.testing.assert_close(loss, t(1.15))
    torch.testing.assert_close(st["clip_frac"], t(0.5))
    loss.backward()  # clipped: 0; the other: -ratio * A / N = 1.5 / 2
    torch.testing.assert_close(logp.grad, t([[0.0, 0.75]]))


def test_grpo_loss_masking():
    # The masked tokens carry absurd values; they must not count. Unmasked: ratio 1, A = 2:
    # loss = -2. The old_logp here is ln 2 against logp ln 2 (ratio 1).
    logp = t([[LN(2), 50.0, -50.0]]).requires_grad_()
    old = t([[LN(2), -50.0, 50.0]])
    loss, st = grpo_loss(logp, old, t([2.0]), t([[1, 0, 0]]), clip_eps=0.2)
    torch.testing.assert_close(loss, t(-2.0))
    torch.testing.assert_close(st["ratio_mean"], t(1.0))
    assert st["clip_frac"].item() == 0.0
    loss.backward()
    assert logp.grad[0, 1:].abs().sum().item() == 0.0


def test_grpo_loss_token_mean_across_sequences_of_different_lengths():
    # Sequence 0: 3 tokens, A = +1; sequence 1: 1 token, A = -1; all ratios 1.
    # Token mean: -(1 + 1 + 1 - 1) / 4 = -0.5. (A mean of sequence means would give 0.)
    zeros = torch.zeros(2, 3)
    mask = t([[1, 1, 1], [1, 0, 0]])
    loss, _ = grpo_loss(zeros, zeros, t([1.0, -1.0]), mask, clip_eps=0.2)
    torch.testing.assert_close(loss, t(-0.5))


def test_grpo_loss_kl_term():
    # A = 0, ratio 1: the policy term is 0. k3 with d = ref - logp:
    #   d = ln 2: e^d - d - 1 = 2 - 0.6931472 - 1 = 0.3068528;  d = 0: 0.
    # kl = (0.3068528 + 0) / 2 = 0.1534264; loss = 0.1 * kl = 0.01534264.
    logp = t([[LN(0.25), LN(0.5)]])
    ref = t([[LN(0.5), LN(0.5)]])
    loss, st = grpo_loss(logp, logp, t([0.0]), t([[1, 1]]), clip_eps=0.2, ref_logp=ref,
                         kl_coef=0.1)
    torch.testing.assert_close(st["kl"], t(0.1534264))
    torch.testing.assert_close(loss, t(0.01534264))
    # Without a reference the kl stat is 0 and the loss has no KL term.
    loss, st = grpo_loss(logp, logp, t([0.0]), t([[1, 1]]), clip_eps=0.2, kl_coef=0.1)
    assert loss.item() == 0.0 and st["kl"].item() == 0.0


def test_collate_aligns_completion_targets():
    # prompt [1, 5, 6], completion [7, 2]: input [1 5 6 7], targets [5 6 7 2]; the loss
    # covers targets 7 and 2, predicted at positions 2 and 3. Sequence [1, 9, 2] is
    # right-padded to 5 tokens: input [1 9 2 PAD], targets [9 2 PAD PAD].
    mb = collate([[1, 5, 6], [1, 9]], [[7, 2], [2]], pad_id=PAD,
                 old_logp=[[-0.5, -0.25], [-1.0]], advantages=[1.0, -1.0])
    assert mb.input_ids.tolist() == [[1, 5, 6, 7], [1, 9, 2, PAD]]
    assert mb.targets.tolist() == [[5, 6, 7, 2], [9, 2, PAD, PAD]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert mb.old_logp.tolist() == [[0, 0, -0.5, -0.25], [0, -1.0, 0, 0]]
    assert mb.tokens == 3


# ---------------------------------------------------------------------------------------
# The trainer on a tiny GPT
# ---------------------------------------------------------------------------------------


def tiny_gpt(seed: int = 0, *, dropout: float = 0.0, n_embd: int = 32) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=n_embd,
                         block_size=32, dropout=dropout))


def grpo(model: GPT, **overrides) -> GRPOTrainer:
    args = dict(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), grad_clip=1.0, clip_eps=0.2,
                kl_coef=0.0, ppo_epochs=1, micro_batch_size=64, temperature=1.0, seed=0)
    args.update(overrides)
    return GRPOTrainer(model=model, logits_fn=lambda m, ids, mask: m(ids), pad_id=PAD, **args)


def seq_logprobs(model, prompt, completion, temperature=1.0) -> np.ndarray:
    """Per completion token log-probs under `model` (eval mode, no grad)."""
    was = model.training
    model.eval()
    with torch.no_grad():
        mb = collate([prompt], [completion], pad_id=PAD)
        lp = token_logprobs(model(mb.input_ids), mb.targets, temperature)
    model.train(was)
    return lp[mb.loss_mask.bool()].numpy().astype(np.float32)


def row(prompt, completion, logprobs, reward=0.0) -> Row:
    return Row(
        prompt_ids=np.asarray(prompt, np.int32),
        completion_ids=np.asarray(completion, np.int32),
        logprobs=np.asarray(logprobs, np.float32),
        versions=np.zeros(len(completion), np.int32),
        reward=float(reward),
        finish_reason="stop",
    )


def group(gid, rows, advantages) -> TrainGroup:
    return TrainGroup(group_id=gid, epoch=0, ordinal=0, idx=0, task="t",
                      advantages=tuple(advantages), rows=tuple(rows))


PROMPT = TOK.encode("1+1=")
GOOD = TOK.encode("2", bos=False) + [EOS]
BAD = TOK.encode("3", bos=False) + [EOS]


def test_train_step_raises_the_good_completion_and_lowers_the_bad():
    model = tiny_gpt()
    trainer = grpo(model)
    good0 = seq_logprobs(model, PROMPT, GOOD).sum()
    bad0 = seq_logprobs(model, PROMPT, BAD).sum()
    for step in range(1, 6):  # on-policy: behaviour log-probs from the current weights
        rows = [row(PROMPT, GOOD, seq_logprobs(model, PROMPT, GOOD), 1.0),
                row(PROMPT, BAD, seq_logprobs(model, PROMPT, BAD), 0.0)]
        m = trainer.train_step(Batch(step, (group("e0.0", rows, (1.0, -1.0)),)))
    assert seq_logprobs(model, PROMPT, GOOD).sum() > good0 + 0.5
    assert seq_logprobs(model, PROMPT, BAD).sum() < bad0 - 0.5
    lagged = {k for k in m if k.startswith("off_policy/mismatch_kl_lag")}
    assert set(m) - lagged == {"loss", "clip_frac", "dual_clip_frac", "ratio_mean", "kl", "grad_norm",
                               "tokens", "reward_mean", "advantage_abs_mean", "lr", "off_policy/mismatch_kl",
                               "off_policy/ratio_mean", "off_policy/ratio_max", "off_policy/capped_share"}
    assert m["off_policy/mismatch_kl"] < 1e-9 and abs(m["off_policy/ratio_mean"] - 1.0) < 1e-5  # on-policy
    assert m["dual_clip_frac"] == 0.0  # dual clip off by default
    assert m["tokens"] == 4.0 and m["reward_mean"] == 0.5 and m["advantage_abs_mean"] == 1.0
    assert m["lr"] == 1e-2 and m["kl"] == 0.0
    assert abs(m["ratio_mean"] - 1.0) < 1e-5  # on-policy, no dropout
    assert trainer.rl_steps == 5


def mixed_batch(model, step=1) -> Batch:
    """2 groups x 4 siblings of different lengths; behaviour log-probs off-policy by a
    fixed perturbation so some ratios leave the clip range."""
    rng = np.random.default_rng(7)
    groups = []
    for gi in range(2):
        prompt = TOK.encode(["12+7=", "3*4="][gi])
        rows, rewards = [], []
        for k in range(4):
            completion = [int(x) for x in rng.integers(3, TOK.vocab_size, size=1 + 2 * k)] + [EOS]
            lp = seq_logprobs(model, prompt, completion) + rng.normal(0, 0.3, len(completion))
            rows.append(row(prompt, completion, lp, reward=float(k % 2)))
            rewards.append(float(k % 2))
        adv = [1.0 if r else -1.0 for r in rewards]
        groups.append(group(f"e0.{gi}", rows, adv))
    return Batch(step, tuple(groups))


def test_gradient_accumulation_equals_the_whole_batch():
    a, b = tiny_gpt(1), tiny_gpt(1)
    batch = mixed_batch(a)
    ta = grpo(a, micro_batch_size=1, ppo_epochs=2, kl_coef=0.1, lr=3e-4)
    tb = grpo(b, micro_batch_size=8, ppo_epochs=2, kl_coef=0.1, lr=3e-4)
    ma, mb = ta.train_step(batch), tb.train_step(batch)
    # float32 summation order differs (1 vs 8 sequences per pass, different padding);
    # Adam's g / sqrt(v) amplifies that most for gradients near 0, so the bound is on the
    # update at a moderate lr (observed ~2e-7), and on the last epoch's gradients.
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (pa - pb).abs().max().item() <= 1e-6, name
        assert (pa.grad - pb.grad).abs().max().item() <= 1e-6, name
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-6), k
    assert ma["clip_frac"] > 0  # the perturbation exercised the clip
    assert ma["kl"] > 0  # the second epoch moved away from the reference
    # It moved: the update is not trivially zero.
    assert (a.wte.weight - tiny_gpt(1).wte.weight).abs().max().item() > 1e-4


def test_batch_without_tokens_changes_nothing():
    model = tiny_gpt()
    trainer = grpo(model)
    before = trainer.weights_sha256()
    m = trainer.train_step(Batch(1, (group("e0.0", [row(PROMPT, [], [])], (1.0,)),)))
    assert trainer.weights_sha256() == before and m["tokens"] == 0.0 and m["loss"] == 0.0


def test_advantages_must_match_rows():
    trainer = grpo(tiny_gpt())
    with pytest.raises(ValueError, match="advantages"):
        trainer.train_step(Batch(1, (group("e0.0", [row(PROMPT, GOOD, [0, 0])], (1.0, 2.0)),)))


def test_weights_are_clones():
    model = tiny_gpt()
    trainer = grpo(model)
    before = trainer.weights_sha256()
    w = trainer.weights()
    assert set(w) == set(model.state_dict())
    assert w["head.weight"] is w["wte.weight"]  # the tie survives, as one clone
    for v in w.values():
        v.add_(1.0)
    assert trainer.weights_sha256() == before
    assert torch.equal(model.wte.weight, tiny_gpt().wte.weight)


def test_sft_step_lowers_the_loss():
    data = [(TOK.encode(f"{a}+{b}="), TOK.encode(str(a + b), bos=False) + [EOS])
            for a, b in [(1, 2), (3, 4), (5, 5), (9, 8)]]
    trainer = grpo(tiny_gpt(), micro_batch_size=3)
    first = trainer.sft_step(data, lr=1e-2)
    for _ in range(30):
        last = trainer.sft_step(data, lr=1e-2)
    assert first["tokens"] == 10.0 and set(first) == {"loss", "tokens", "grad_norm", "lr"}
    assert last["loss"] < 0.5 * first["loss"]
    assert trainer.sft_steps == 31 and trainer.rl_steps == 0


# ---------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------


SFT_DATA = [(TOK.encode("2+2="), TOK.encode("4", bos=False) + [EOS])]


def run_steps(trainer: GRPOTrainer, start: int, n: int) -> None:
    for step in range(start, start + n):
        trainer.train_step(mixed_batch(trainer.model, step))


def ckpt_trainer(seed: int = 0, **kw) -> GRPOTrainer:
    # dropout uses the RNG, so the round trip must restore it; KL makes a reference; one
    # SFT step makes the second optimizer.
    return grpo(tiny_gpt(seed, dropout=0.1, **kw), kl_coef=0.05, ppo_epochs=2,
                micro_batch_size=3, lr=3e-3)


def optimizer_tensors(opt) -> list[tuple[int, str, torch.Tensor]]:
    return [(i, k, v) for i, (_, s) in enumerate(sorted(opt.state_dict()["state"].items()))
            for k, v in sorted(s.items())]


def test_checkpoint_round_trip_is_bit_exact():
    a = ckpt_trainer()
    a.sft_step(SFT_DATA, lr=1e-3)
    run_steps(a, 1, 3)
    snap = a.snapshot()
    files = files_of(snap)
    assert set(files) == {"model.safetensors", "optimizer.safetensors", "trainer.json",
                          "rng.safetensors", "reference.safetensors"}

    run_steps(a, 4, 2)  # the uninterrupted run
    assert files_of(snap) == files  # the snapshot holds copies, not live tensors

    b = ckpt_trainer(seed=99)  # a fresh, different model
    assert b.weights_sha256() != a.weights_sha256()
    b.load(as_dir(files))
    assert b.rl_steps == 3 and b.sft_steps == 1
    run_steps(b, 4, 2)  # the resumed run

    assert b.weights_sha256() == a.weights_sha256()
    for opt_a, opt_b in ((a.optimizer, b.optimizer), (a._sft_optimizer, b._sft_optimizer)):
        sa, sb = optimizer_tensors(opt_a), optimizer_tensors(opt_b)
        assert len(sa) == len(sb) > 0
        for (ia, ka, va), (ib, kb, vb) in zip(sa, sb, strict=True):
            assert (ia, ka) == (ib, kb) and torch.equal(va, vb), (ia, ka)
    assert files_of(b.snapshot()) == files_of(a.snapshot())  # everything, byte for byte


def test_checkpoint_round_trip_needs_the_rng():
    # The test above can fail: resuming with another RNG state (dropout masks) diverges.
    a = ckpt_trainer()
    run_steps(a, 1, 1)
    files = files_of(a.snapshot())
    run_steps(a, 2, 1)
    b = ckpt_trainer(seed=5)
    b.load(as_dir(files))
    torch.manual_seed(12345)
    run_steps(b, 2, 1)
    assert b.weights_sha256() != a.weights_sha256()


def test_checkpoint_files_use_no_pickle(monkeypatch):
    a = ckpt_trainer()
    a.sft_step(SFT_DATA, lr=1e-3)
    run_steps(a, 1, 1)
    files = files_of(a.snapshot())
    for name, data in files.items():
        assert not data.startswith(b"\x80"), name  # pickle protocol >= 2
        assert not data.startswith(b"PK\x03\x04"), name  # torch.save's zip
        if name.endswith(".safetensors"):
            st_load(data)  # parses as safetensors
    tied = st_load(files["model.safetensors"])
    assert "wte.weight" in tied and "head.weight" not in tied  # the tie is stored once

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while loading a checkpoint")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    b = ckpt_trainer(seed=3)
    b.load(as_dir(files))
    assert b.weights_sha256() == a.weights_sha256()


def snapshot_files() -> dict[str, bytes]:
    a = ckpt_trainer()
    a.sft_step(SFT_DATA, lr=1e-3)
    run_steps(a, 1, 1)
    return files_of(a.snapshot())


@pytest.mark.parametrize(
    "name, corrupt",
    [
        ("model.safetensors", lambda d: d[: len(d) // 2]),  # truncated
        ("optimizer.safetensors", lambda d: d[:7]),  # shorter than the header length
        ("rng.safetensors", lambda d: b"\xff" * 8 + d[8:]),  # absurd header length
        ("reference.safetensors", lambda d: d[:-1]),
        ("trainer.json", lambda d: d[:-2]),  # invalid JSON
        ("trainer.json", lambda d: d.replace(b"rollkeep.grpo/1", b"rollkeep.grpo/9")),
        ("rng.safetensors", None),  # missing
        ("model.safetensors", None),
    ],
)
def test_bad_file_raises_checkpoint_error_and_changes_nothing(name, corrupt):
    files = snapshot_files()
    files = {k: v for k, v in files.items() if k != name or corrupt is not None}
    if corrupt is not None:
        files[name] = corrupt(files[name])
    b = ckpt_trainer(seed=4)
    before = files_of(b.snapshot())
    with pytest.raises(CheckpointError) as err:
        b.load(as_dir(files))
    assert err.value.path == f"trainer/{name}"
    assert name in str(err.value) and err.value.remedy
    assert files_of(b.snapshot()) == before


def test_shape_mismatch_names_file_and_tensor():
    files = snapshot_files()
    wide = grpo(tiny_gpt(dropout=0.1, n_embd=48), kl_coef=0.05)
    with pytest.raises(CheckpointError) as err:
        wide.load(as_dir(files))
    assert err.value.path == "trainer/model.safetensors"
    assert err.value.field == "wte.weight"
    assert f"torch.float32 [{TOK.vocab_size}, 48]" in err.value.expected
    assert f"torch.float32 [{TOK.vocab_size}, 32]" in err.value.found
    assert "model config" in err.value.remedy


def test_optimizer_state_mismatch_names_the_tensor():
    files = snapshot_files()
    opt = st_load(files["optimizer.safetensors"])
    opt["rl.state.1.exp_avg"] = torch.zeros(3)
    files["optimizer.safetensors"] = st_save(opt)
    with pytest.raises(CheckpointError) as err:
        ckpt_trainer(seed=4).load(as_dir(files))
    assert err.value.path == "trainer/optimizer.safetensors"
    assert err.value.field == "rl.state.1.exp_avg"
    opt.pop("rl.state.1.exp_avg")
    opt["adam.state.0.step"] = torch.tensor(1.0)
    files["optimizer.safetensors"] = st_save(opt)
    with pytest.raises(CheckpointError, match="adam.state.0.step"):
        ckpt_trainer(seed=4).load(as_dir(files))


# ---------------------------------------------------------------------------------------
# The built-in GPT wiring
# ---------------------------------------------------------------------------------------


def test_torch_trainer_from_config():
    shape = TorchModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)
    cfg = TorchTrainerConfig(model=shape, lr=1e-3, micro_batch_size=4)
    trainer = make_trainer(cfg, model=tiny_gpt(), tokenizer=TOK, temperature=0.7, seed=1)
    assert isinstance(trainer, TorchTrainer) and trainer.name == "torch"
    assert trainer.micro_batch_size == 4 and trainer.temperature == 0.7
    prompt = PROMPT
    lp = seq_logprobs(trainer.model, prompt, GOOD, temperature=0.7)
    m = trainer.train_step(Batch(1, (group("e0.0", [row(prompt, GOOD, lp)], (1.0,)),)))
    assert abs(m["ratio_mean"] - 1.0) < 1e-5  # same temperature as the behaviour log-probs
    with pytest.raises(ValueError, match="n_embd"):
        TorchTrainer(cfg, model=tiny_gpt(n_embd=64), tokenizer=TOK, temperature=1.0, seed=1)


# ---------------------------------------------------------------------------------------
# loss_type, dual_clip, metrics: against the formulas, written out here independently
# (module docstring of rollkeep.trainers.grpo_loss), on random ragged batches in float64
# ---------------------------------------------------------------------------------------

LOSS_TYPES = ["dapo", "grpo", "dr_grpo", "bnpo"]
L_MAX = 9  # dr_grpo's configured maximum completion length (>= every length below)


def ragged_case(seed: int):
    """B sequences of random lengths 0..L_MAX-1 (at least one token in the batch), one
    advantage each (some exactly 0, some negative), log-ratios wide enough to leave the
    clip range and pass ratio 2 often, and a reference policy. Padded positions hold junk."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 8))
    lengths = [int(x) for x in rng.integers(0, L_MAX, size=B)]
    if sum(lengths) == 0:
        lengths[0] = 1
    T = max(lengths) + 1  # one all-padding column
    old = rng.normal(-2.0, 0.5, size=(B, T))
    logp = old + rng.normal(0.0, 0.7, size=(B, T))
    ref = logp + rng.normal(0.0, 0.3, size=(B, T))
    adv = rng.normal(0.0, 1.0, size=B)
    adv[rng.random(B) < 0.2] = 0.0
    mask = np.zeros((B, T))
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    junk = rng.normal(0.0, 30.0, size=(B, T))
    logp, old, ref = (np.where(mask > 0, x, junk) for x in (logp, old, ref))
    return logp, old, ref, adv, mask, lengths


def reference_loss(logp, old, ref, adv, lengths, *, loss_type, clip_eps, kl_coef, dual_clip,
                   micro_batch_size=None):
    """Loss, d loss / d logp and the token metrics, one token at a time in plain Python."""
    B = len(lengths)
    n_tokens = sum(lengths)
    size = micro_batch_size or B
    chunks = [range(s, min(B, s + size)) for s in range(0, B, size)]
    chunk_of = {i: c for c in chunks for i in c}
    loss, grad = 0.0, np.zeros_like(logp)
    clipped = dual = 0
    ratio_sum = k3_sum = 0.0
    for i in range(B):
        A = adv[i]
        for t in range(lengths[i]):
            r = math.exp(logp[i, t] - old[i, t])
            # the PPO clip: min(r A, clip(r) A); its clipped branch is active (gradient 0)
            # when r > 1 + eps with A > 0 or r < 1 - eps with A < 0
            if (A > 0 and r > 1 + clip_eps) or (A < 0 and r < 1 - clip_eps):
                s, ds = min(max(r, 1 - clip_eps), 1 + clip_eps) * A, 0.0
                clipped += 1
            else:
                s, ds = r * A, r * A
            if dual_clip is not None and A < 0 and r > dual_clip:  # floor c A, constant
                s, ds = dual_clip * A, 0.0
                dual += 1
            d = ref[i, t] - logp[i, t]
            k3 = math.exp(d) - d - 1
            ell = -s + kl_coef * k3
            dell = -ds + kl_coef * (1 - math.exp(d))
            if loss_type == "dapo":
                w = 1 / n_tokens
            elif loss_type == "grpo":
                w = 1 / (B * lengths[i])
            elif loss_type == "dr_grpo":
                w = 1 / (B * L_MAX)
            else:  # bnpo: token mean in this sequence's micro-batch, mean over micro-batches
                w = 1 / (len(chunks) * max(1, sum(lengths[j] for j in chunk_of[i])))
            loss += w * ell
            grad[i, t] = w * dell
            ratio_sum += r
            k3_sum += k3
    metrics = {"clip_frac": clipped / n_tokens, "dual_clip_frac": dual / n_tokens,
               "ratio_mean": ratio_sum / n_tokens, "kl": k3_sum / n_tokens}
    return loss, grad, metrics


def d(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dual_clip", [None, 1.1, 2.0])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_grpo_loss_matches_its_formula(loss_type, dual_clip, kl_coef):
    # 25 random ragged batches per option: loss, gradient and metrics, to float64 round-off.
    # (dual_clip 1.1 < 1 + clip_eps: the cap then also reaches ratios inside the clip range.)
    seen = dict.fromkeys(("clip_frac", "dual_clip_frac", "kl"), 0.0)
    for seed in range(25):
        logp, old, ref, adv, mask, lengths = ragged_case(seed)
        want, want_grad, want_metrics = reference_loss(
            logp, old, ref, adv, lengths, loss_type=loss_type, clip_eps=0.2, kl_coef=kl_coef,
            dual_clip=dual_clip)
        x = d(logp).requires_grad_()
        loss, stats = grpo_loss(x, d(old), d(adv), d(mask), clip_eps=0.2,
                                ref_logp=d(ref) if kl_coef else None, kl_coef=kl_coef,
                                loss_type=loss_type, dual_clip=dual_clip,
                                max_completion_length=L_MAX)
        loss.backward()
        assert loss.dtype == torch.float64
        assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-14), seed
        np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-11, atol=1e-14)
        for k, v in want_metrics.items():
            got = stats[k].item()
            if k == "kl" and not kl_coef:
                assert got == 0.0  # no reference: no KL
                continue
            assert got == pytest.approx(v, rel=1e-12, abs=1e-15), (seed, k)
            seen[k] = seen.get(k, 0.0) + got
    assert seen["clip_frac"] > 0 and (seen["dual_clip_frac"] > 0) == (dual_clip is not None)


def test_loss_types_differ_on_ragged_batches():
    # The four are different objectives (same at equal lengths only up to constants).
    logp, old, ref, adv, mask, lengths = ragged_case(3)
    assert len(set(lengths)) > 1
    losses = {lt: grpo_loss(d(logp), d(old), d(adv), d(mask), clip_eps=0.2, loss_type=lt,
                            max_completion_length=L_MAX)[0].item()
              for lt in ("dapo", "grpo", "dr_grpo")}
    assert len({round(v, 12) for v in losses.values()}) == 3


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_micro_batch_parts_add_up(loss_type, micro_batch_size):
    # Split into micro-batches with whole-batch counts passed in, the losses, gradients and
    # metrics add up: to the one-batch values for dapo, grpo, dr_grpo (accumulation is
    # exact), and for bnpo to its per-micro-batch formula (micro_batch_size is semantic).
    for seed in range(20):
        logp, old, ref, adv, mask, lengths = ragged_case(100 + seed)
        B = len(lengths)
        want, want_grad, want_metrics = reference_loss(
            logp, old, ref, adv, lengths, loss_type=loss_type, clip_eps=0.2, kl_coef=0.1,
            dual_clip=2.0, micro_batch_size=micro_batch_size if loss_type == "bnpo" else None)
        x = d(logp).requires_grad_()
        total = torch.zeros((), dtype=torch.float64)
        metrics = dict.fromkeys(want_metrics, 0.0)
        starts = range(0, B, micro_batch_size)
        for s in starts:
            part = slice(s, s + micro_batch_size)
            loss, stats = grpo_loss(
                x[part], d(old[part]), d(adv[part]), d(mask[part]), clip_eps=0.2,
                ref_logp=d(ref[part]), kl_coef=0.1, loss_type=loss_type, dual_clip=2.0,
                max_completion_length=L_MAX, batch_sequences=B, batch_tokens=sum(lengths),
                micro_batches=len(starts))
            total = total + loss
            for k in metrics:
                metrics[k] += stats[k].item()
        total.backward()
        assert total.item() == pytest.approx(want, rel=1e-12, abs=1e-14), seed
        np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-11, atol=1e-14)
        for k, v in want_metrics.items():
            assert metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-15), (seed, k)


def test_dual_clip_caps_a_negative_advantage_token_by_hand():
    # A = -1, eps = 0.2, c = 3. ratio 5: clipped objective min(-5, -1.2) = -5 (unbounded,
    # gradient -ratio*A/N = 5/2); dual clip: max(-5, -3) = -3, loss 3/2 there, gradient 0.
    # ratio 2 (< c): untouched, min(-2, -1.2) = -2. loss = -(-3 - 2) / 2 = 2.5.
    logp = t([[LN(5.0), LN(2.0)]]).requires_grad_()
    loss, st = grpo_loss(logp, t([[0.0, 0.0]]), t([-1.0]), t([[1, 1]]), clip_eps=0.2,
                         dual_clip=3.0)
    torch.testing.assert_close(loss, t(2.5))
    torch.testing.assert_close(st["dual_clip_frac"], t(0.5))
    assert st["clip_frac"].item() == 0.0  # the PPO clip is not what removed that gradient
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[0.0, 1.0]]))
    # Positive advantages are never dual-clipped: A = +1, ratio 5 -> min(5, 1.2) = 1.2.
    loss, st = grpo_loss(t([[LN(5.0)]]), t([[0.0]]), t([1.0]), t([[1]]), clip_eps=0.2,
                         dual_clip=3.0)
    torch.testing.assert_close(loss, t(-1.2))
    assert st["dual_clip_frac"].item() == 0.0 and st["clip_frac"].item() == 1.0


def test_loss_options_are_checked():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(z, z, t([1.0]), t([[1, 1]]), clip_eps=0.2, loss_type="token_mean")
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(z, z, t([1.0]), t([[1, 1]]), clip_eps=0.2, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="dual_clip"):
        grpo_loss(z, z, t([1.0]), t([[1, 1]]), clip_eps=0.2, dual_clip=1.0)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo(tiny_gpt(), loss_type="dr_grpo")
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo(tiny_gpt(), scale_rewards="batch_sample")


# ---------------------------------------------------------------------------------------
# The options in the trainer
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_gradient_accumulation_is_exact_for_every_whole_batch_loss(loss_type):
    # As test_gradient_accumulation_equals_the_whole_batch, per loss_type, dual clip on.
    a, b = tiny_gpt(1), tiny_gpt(1)
    batch = mixed_batch(a)
    opts = dict(ppo_epochs=2, kl_coef=0.1, lr=3e-4, loss_type=loss_type, dual_clip=1.5,
                max_completion_length=L_MAX)
    ma = grpo(a, micro_batch_size=3, **opts).train_step(batch)
    mb = grpo(b, micro_batch_size=8, **opts).train_step(batch)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert (pa - pb).abs().max().item() <= 1e-6, name
        assert (pa.grad - pb.grad).abs().max().item() <= 1e-6, name
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-6), k
    assert ma["dual_clip_frac"] > 0 and ma["clip_frac"] > 0


def trained_grads(loss_type, micro_batch_size):
    model = tiny_gpt(1)
    trainer = grpo(model, micro_batch_size=micro_batch_size, loss_type=loss_type, lr=3e-4,
                   max_completion_length=L_MAX)
    m = trainer.train_step(mixed_batch(model))
    return m, [p.grad.clone() for p in model.parameters()]


def test_bnpo_depends_on_the_micro_batch_size():
    # bnpo is a token mean per micro-batch: one sequence per micro-batch is exactly grpo's
    # mean of sequence means, one micro-batch for the whole batch is dapo, and in between
    # it is neither (8 sequences of 2..8 tokens).
    cases = {
        "bnpo1": trained_grads("bnpo", 1), "grpo": trained_grads("grpo", 8),
        "bnpo8": trained_grads("bnpo", 8), "dapo": trained_grads("dapo", 3),
        "bnpo3": trained_grads("bnpo", 3),
    }

    def same(x, y):
        return (cases[x][0]["loss"] == pytest.approx(cases[y][0]["loss"], rel=1e-5)
                and all((gx - gy).abs().max().item() <= 1e-6
                        for gx, gy in zip(cases[x][1], cases[y][1], strict=True)))

    assert same("bnpo1", "grpo") and same("bnpo8", "dapo")
    assert not same("bnpo3", "dapo") and not same("bnpo3", "grpo") and not same("grpo", "dapo")


def left_aligned(model, rows, temperature=1.0):
    """(B, T) float64 arrays of each row's completion-token log-probs under `model`, its
    behaviour log-probs, and the lengths, tokens left-aligned from column 0."""
    T = max(len(r.completion_ids) for r in rows) + 1
    logp, old = np.zeros((len(rows), T)), np.zeros((len(rows), T))
    for i, r in enumerate(rows):
        n = len(r.completion_ids)
        logp[i, :n] = seq_logprobs(model, r.prompt_ids.tolist(), r.completion_ids.tolist(),
                                   temperature)
        old[i, :n] = r.logprobs
    return logp, old, [len(r.completion_ids) for r in rows]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_trainer_loss_and_metrics_match_their_definitions(loss_type, dual_clip):
    # One PPO epoch: the reported loss and token metrics are those of the weights before
    # the update, so the formulas, fed the model's own log-probs, must give them. A KL
    # reference that differs from the policy (an SFT step after freezing it) makes kl > 0.
    model = tiny_gpt(2)
    trainer = grpo(model, micro_batch_size=3, loss_type=loss_type, dual_clip=dual_clip,
                   kl_coef=0.1, max_completion_length=L_MAX, lr=3e-4)
    trainer.set_reference()
    trainer.sft_step(SFT_DATA, lr=1e-2)
    batch = mixed_batch(model)
    rows = [r for g in batch.groups for r in g.rows]
    adv = np.array([a for g in batch.groups for a in g.advantages])
    logp, old, lengths = left_aligned(model, rows)
    ref, _, _ = left_aligned(trainer._reference, rows)
    want, _, want_metrics = reference_loss(logp, old, ref, adv, lengths, loss_type=loss_type,
                                           clip_eps=0.2, kl_coef=0.1, dual_clip=dual_clip,
                                           micro_batch_size=3)
    m = trainer.train_step(batch)
    assert m["loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    for k, v in want_metrics.items():
        assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert m["kl"] > 0 and m["clip_frac"] > 0
    assert m["tokens"] == sum(lengths)
    assert m["advantage_abs_mean"] == pytest.approx(np.abs(adv).mean())


def test_batch_scaling_divides_by_the_sample_std_of_the_batch_rewards():
    # scale_rewards=batch: the trainer divides the stored group-centred advantages by the
    # sample std of all rewards of the step (+1e-6); the same update as a trainer handed
    # those quotients directly. Groups without signal stay at exactly 0.
    base = mixed_batch(tiny_gpt(3))
    rewards = np.array([r.reward for g in base.groups for r in g.rows]) * 3.0 + 1.0
    centred_groups, k = [], 0
    for g in base.groups:
        rs = rewards[k : k + len(g.rows)]
        k += len(g.rows)
        rows = [dataclasses.replace(r, reward=float(x)) for r, x in zip(g.rows, rs, strict=True)]
        centred_groups.append(dataclasses.replace(g, rows=tuple(rows),
                                                  advantages=tuple(rs - rs.mean())))
    flat = dataclasses.replace(centred_groups[1], advantages=(0.0,) * 4,
                               rows=tuple(dataclasses.replace(r, reward=1.0)
                                          for r in centred_groups[1].rows))
    groups = (centred_groups[0], flat)
    all_rewards = np.array([r.reward for g in groups for r in g.rows])
    std = all_rewards.std(ddof=1)
    divided = tuple(dataclasses.replace(g, advantages=tuple(np.array(g.advantages) / (std + 1e-6)))
                    for g in groups)

    a, b = tiny_gpt(3), tiny_gpt(3)
    ma = grpo(a, scale_rewards="batch").train_step(Batch(1, groups))
    mb = grpo(b, scale_rewards="group").train_step(Batch(1, divided))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert (pa - pb).abs().max().item() <= 1e-7
    assert ma["advantage_abs_mean"] == pytest.approx(mb["advantage_abs_mean"], rel=1e-12)
    assert ma["advantage_abs_mean"] == pytest.approx(
        np.abs(np.concatenate([g.advantages for g in divided])).mean(), rel=1e-12)
    # Without the division the update differs (the std here is far from 1).
    c = tiny_gpt(3)
    grpo(c, scale_rewards="none").train_step(Batch(1, groups))
    moved = [(pa - pc).abs().max().item()
             for pa, pc in zip(a.parameters(), c.parameters(), strict=True)]
    assert max(moved) > 1e-6


def test_torch_trainer_gets_the_options_from_config():
    shape = TorchModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)
    cfg = TorchTrainerConfig(model=shape, loss_type="dr_grpo", dual_clip=3.0,
                             scale_rewards="batch")
    trainer = make_trainer(cfg, model=tiny_gpt(), tokenizer=TOK, temperature=1.0, seed=1,
                           max_completion_length=7)
    assert (trainer.loss_type, trainer.dual_clip, trainer.scale_rewards,
            trainer.max_completion_length) == ("dr_grpo", 3.0, "batch", 7)
    with pytest.raises(ValueError, match="max_completion_length"):
        make_trainer(cfg, model=tiny_gpt(), tokenizer=TOK, temperature=1.0, seed=1)


def warm_trainer(seed: int, warmup: int) -> GRPOTrainer:
    return grpo(tiny_gpt(seed, dropout=0.1), kl_coef=0.05, ppo_epochs=2, micro_batch_size=3,
                lr=3e-3, lr_warmup_steps=warmup)


def test_lr_warmup_rates_and_resume_bit_exact():
    a = warm_trainer(0, 4)
    assert [a.step_lr(k) for k in (1, 2, 3, 4, 9)] == pytest.approx([3e-3 / 4, 3e-3 / 2, 3e-3 * 3 / 4,
                                                                     3e-3, 3e-3])
    lrs = []
    for step in range(1, 3):
        lrs.append(a.train_step(mixed_batch(a.model, step))["lr"])
    assert lrs == pytest.approx([3e-3 / 4, 3e-3 / 2])
    files = files_of(a.snapshot())
    run_steps(a, 3, 3)  # the uninterrupted run, through the end of the warmup
    b = warm_trainer(99, 4)
    b.load(as_dir(files))
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 3 / 4)  # the next step's
    run_steps(b, 3, 3)
    assert b.weights_sha256() == a.weights_sha256()
    assert files_of(b.snapshot()) == files_of(a.snapshot())
    # No warmup: every step at lr (the behaviour before the key existed).
    c = ckpt_trainer()
    assert c.train_step(mixed_batch(c.model, 1))["lr"] == pytest.approx(3e-3)
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        warm_trainer(0, -1)


def test_lr_decay_after_the_warmup():
    t = grpo(tiny_gpt(), lr=1e-3, lr_warmup_steps=10, lr_decay_steps=100, lr_final_ratio=0.2)
    got = [t.step_lr(k) for k in (1, 5, 10, 60, 110, 500)]
    assert got == pytest.approx([1e-4, 5e-4, 1e-3, 6e-4, 2e-4, 2e-4])
    no_warmup = grpo(tiny_gpt(), lr=1e-3, lr_decay_steps=10, lr_final_ratio=0.0)
    assert [no_warmup.step_lr(k) for k in (1, 5, 10, 11)] == pytest.approx([9e-4, 5e-4, 0.0, 0.0])
