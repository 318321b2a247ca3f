"""Data-parallel ranks (`trainer.world_size` > 1, rollkeep.trainers.ranks): the 2-rank
step equals the 1-rank step for every loss type; sharded checkpoints load on any number of
ranks (and one process); a damaged, incomplete or other-step shard is refused; a rank that
raises is a bug, one that dies is named."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from test_grpo import TOK, group, mixed_batch, row

from rollkeep.config import TorchModelConfig, TorchTrainerConfig
from rollkeep.core.errors import CheckpointError
from rollkeep.models.gpt import GPT, GPTConfig
from rollkeep.models.tokenizer import EOS
from rollkeep.trainers import Batch, make_trainer
from rollkeep.trainers.ranks import RankRaised, TrainerRankFailed, split_rows

pytestmark = pytest.mark.slow

SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64}


def build(world_size: int, **kw):
    cfg = TorchTrainerConfig(model=TorchModelConfig(**SHAPE), world_size=world_size, step_timeout_s=120,
                             **{"micro_batch_size": 3, "lr": 1e-3, **kw})
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=TOK.vocab_size, dropout=0.0, **SHAPE))
    return make_trainer(cfg, model=model, tokenizer=TOK, temperature=1.0, seed=0, max_completion_length=8)


def max_diff(a, b) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True))


@pytest.fixture
def closing():
    made = []
    yield made.append
    for t in made:
        t.close()


@pytest.mark.parametrize(("loss_type", "off_policy"),
                         [("dapo", "none"), ("grpo", "tis"), ("dr_grpo", "mis"), ("bnpo", "none")])
def test_two_ranks_take_the_one_process_step(closing, loss_type, off_policy) -> None:
    """Loss, token statistics, off-policy statistics, gradient norm and the updated
    weights (which carry the gradients through AdamW) equal one process's, to float32
    round-off; over two PPO epochs with a KL reference, so every term of the loss is
    exercised."""
    # (a moderate lr: Adam's g / sqrt(v) amplifies the round-off of gradients near 0)
    kw = dict(loss_type=loss_type, kl_coef=0.1, ppo_epochs=2, lr=3e-4, off_policy=off_policy, is_cap=1.3,
              is_level="sequence" if off_policy == "mis" else "token")
    one, two = build(1, **kw), build(2, **kw)
    closing(two)
    assert two.weights_sha256() == one.weights_sha256()  # the same initial weights
    batch = mixed_batch(one.model)
    m1, m2 = one.train_step(batch), two.train_step(batch)
    for k, v in m1.items():
        assert m2[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert m1["kl"] > 0 and m1["off_policy/mismatch_kl"] > 0  # the KL term was active, the batch off-policy
    assert m1["clip_frac" if off_policy == "none" else "off_policy/capped_share"] > 0  # the clip / the cap
    assert max_diff(one, two) <= 1e-6
    assert max_diff(one, build(1)) > 1e-4  # (it moved)
    assert {"rank0_step_s", "rank1_step_s", "slowest_rank", "slowest_rank_step_s"} <= set(m2)


def test_two_ranks_take_the_one_process_warm_start_step(closing) -> None:
    """The supervised step too: each sequence once, on one rank, normalised by the whole
    batch's target tokens (micro-batches larger than a rank's share included)."""
    one, two = build(1, micro_batch_size=64), build(2, micro_batch_size=64)
    closing(two)
    for step in range(1, 4):
        seqs = [(TOK.encode(f"{i:02d}+{step}="), TOK.encode(str(i + step), bos=False) + [EOS]) for i in range(40)]
        m1, m2 = one.sft_step(seqs, lr=1e-3), two.sft_step(seqs, lr=1e-3)
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5) and m2["tokens"] == m1["tokens"]
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    assert max_diff(one, two) <= 1e-6 and two.sft_steps == 3


def test_the_split_keeps_bnpo_micro_batches_whole_and_balances_tokens() -> None:
    rows = [row([1], [5] * n + [2], [0.0] * (n + 1)) for n in (1, 9, 1, 1, 9, 1, 1)]
    advs = [0.0] * len(rows)
    whole = split_rows(rows, advs, world_size=2, micro_batch_size=3, keep_micro_batches=True)
    assert [[len(c) for c, _ in part] for part in whole] == [[3], [3, 1]]  # the one-process micro-batches
    free = split_rows(rows, advs, world_size=3, micro_batch_size=2, keep_micro_batches=False)
    assert sum(len(c) for part in free for c, _ in part) == len(rows)
    assert [r for part in free for c, _ in part for r in c] == rows  # contiguous, in batch order
    assert split_rows(rows[:1], advs[:1], world_size=2, micro_batch_size=4, keep_micro_batches=False)[1] == []


def test_sharded_checkpoints_load_on_any_number_of_ranks(closing, tmp_path) -> None:
    """A 2-rank checkpoint loads on 1 and 3 ranks and a 1-rank one on 3, with the same
    weights (byte-identical) and the same next step (to round-off); the shards are
    safetensors bound to their step, with no pickle beside them."""
    two = build(2, kl_coef=0.1)
    closing(two)
    two.train_step(mixed_batch(two.model))
    (tmp_path / "two").mkdir()
    snap = two.snapshot()
    snap.save(tmp_path / "two")
    files = sorted(str(p.relative_to(tmp_path / "two")) for p in (tmp_path / "two").rglob("*") if p.is_file())
    assert files == ["reference.safetensors", "rng.safetensors", "shards/shard-00001-model-00001-of-00001.safetensors",
                     "shards/shard-00002-model-00001-of-00001.safetensors", "trainer.json"]
    assert len(snap.shard_bytes) == 2 and all(b > 0 for b in snap.shard_bytes)
    assert json.loads((tmp_path / "two" / "trainer.json").read_text())["world_size"] == 2

    one, three = build(1, kl_coef=0.1), build(3, kl_coef=0.1)
    closing(three)
    one.load(tmp_path / "two", step=1)
    three.load(tmp_path / "two", step=1)
    assert one.weights_sha256() == three.weights_sha256() == two.weights_sha256()
    batch = mixed_batch(two.model, step=2)
    for t in (one, two, three):
        t.train_step(batch)
    assert max_diff(one, two) <= 1e-6 and max_diff(three, two) <= 1e-6

    (tmp_path / "one").mkdir()
    one.snapshot().save(tmp_path / "one")
    three.load(tmp_path / "one", step=2)  # a one-process checkpoint on 3 ranks
    assert three.weights_sha256() == one.weights_sha256()


def test_a_bad_shard_is_refused_before_any_rank_loads(closing, tmp_path) -> None:
    two = build(2)
    closing(two)
    ckpts = {}
    for step in (1, 2):
        two.train_step(mixed_batch(two.model, step=step))
        ckpts[step] = tmp_path / f"s{step}"
        ckpts[step].mkdir()
        two.snapshot().save(ckpts[step])
    fresh = build(1)
    before = fresh.weights_sha256()
    shard = "shards/shard-00002-model-00001-of-00001.safetensors"

    def refused(change, match: str) -> None:
        d = tmp_path / "bad"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(ckpts[2], d)
        change(d)
        with pytest.raises(CheckpointError, match=match):
            fresh.load(d, step=2)
        assert fresh.weights_sha256() == before  # nothing changed

    refused(lambda d: shutil.copy(ckpts[1] / shard, d / shard), "not of step 2")  # a shard of another step
    refused(lambda d: (d / shard).unlink(), "not the 2 the checkpoint lists")
    refused(lambda d: (d / shard).write_bytes((d / shard).read_bytes()[:100]), "not a readable safetensors shard")
    refused(lambda d: shutil.copy(d / shard, d / "shards/shard-00003-model-00001-of-00001.safetensors"),
            "not the 2 the checkpoint lists")
    with pytest.raises(CheckpointError, match="state of step 2, not of step 1"):
        fresh.load(ckpts[2], step=1)  # the whole directory of another step


    # A rank's save that meets a failing disk (here: a file where the shards' directory
    # goes) is an OSError, as the store expects of any trainer (it undoes the checkpoint;
    # the run's exit 5), not a bug.
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "shards").write_text("in the way")
    with pytest.raises(OSError, match=r"trainer rank [01] during save: File exists"):  # (whichever answers first)
        two.snapshot().save(tmp_path / "disk")


def test_a_rank_that_raises_is_a_bug_and_one_that_dies_is_named(closing) -> None:
    two = build(2)
    closing(two)
    bad = Batch(1, (group("e0.0", [row([1], [TOK.vocab_size + 5, 2], [0.0, 0.0], 1.0),
                                   row([1], [3, 2], [0.0, 0.0], 0.0)], (1.0, -1.0)),))
    with pytest.raises(RankRaised, match="trainer rank 0 raised during train: IndexError"):
        two.train_step(bad)
    with pytest.raises(RankRaised):  # stopped for good: never retried
        two.train_step(mixed_batch(two.model))

    other = build(2)
    closing(other)
    pid = other.info()["pids"][1]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TrainerRankFailed, match=rf"trainer rank 1 \(pid {pid}\) died during train: killed by SIGKILL"):
        other.train_step(mixed_batch(other.model))
