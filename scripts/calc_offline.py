"""The calc task end to end without the runner: warm start on demonstrations, then a
synchronous on-policy GRPO loop over multi-turn calculator episodes, with held-out greedy
evaluations. A tool for choosing `configs/calc.yaml`'s settings until `rollkeep train`
drives environments; the library pieces it composes are the ones the runner uses:

    warm start   controller.warmup.run_warmup(..., make_env=...)    (checkpointed in a temp dir)
    evaluation   controller.evaluate.Evaluator(..., make_env=..., max_turns=...)
    training     trainers.grpo.GRPOTrainer.train_step(Batch)        (env tokens masked by version)

What is its own (and only here): `sample_episodes`, a batched KV-cache sampler of
episodes with `models.sampling.sample` (a token's randomness is a function of its
episode's seed and its position in the trajectory, as in the engine), and the loop. Each
step samples `--prompts` training problems x `--group` episodes with the current weights
(on-policy: behaviour = trained policy, version = steps taken), scores them, computes
group advantages (`core.advantages`, group_population) and takes one `train_step`.

    PYTHONPATH=src python scripts/calc_offline.py --seed 0 --out runs/calc_offline/seed0.json

Measured (2 CPU cores, 2 torch threads, configs/calc.yaml's settings = the defaults
below): held-out greedy accuracy on 500 problems, at the warm start and every 10 RL steps

    seed 0   0.564 0.934 0.958 1.0   0.998 0.99  1.0 ...  1.0   (150 steps, 1:46 wall)
    seed 1   0.108 0.096 0.082 0.252 0.58  0.926 1.0 ...  1.0   (2:08)
    seed 2   0.1   0.122 0.168 0.386 0.71  0.964 1.0 ...  1.0   (2:06)

What did not work, for the record: engine temperature 1.0 (a partial warm start almost
never samples a whole right episode; the policy collapsed), 16 prompts x 8 at lr 3e-4
(collapsed from seed 2's 0.1 warm start), lr 1e-3 (collapsed), operands 100..999 (17%
of products have 5 digits; GRPO stalled at ~0.80).

Rows of episodes are `EpisodeRow`s, not `core.rows.Row`s: Row does not accept the
environment's negative versions yet (being relaxed on main). The trainer reads only the
fields both have.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rollkeep.config import load_config
from rollkeep.controller.evaluate import Evaluator
from rollkeep.controller.warmup import run_warmup
from rollkeep.core.advantages import stored_advantages
from rollkeep.core.batch import Batch, TrainGroup
from rollkeep.envs import calc as calc_env
from rollkeep.envs.base import ENV_VERSION
from rollkeep.models.gpt import GPT, GPTConfig
from rollkeep.models.sampling import sample
from rollkeep.models.tokenizer import EOS, PAD, CharTokenizer
from rollkeep.tasks import calc
from rollkeep.trainers.grpo import GRPOTrainer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--seed", type=int, default=0, help="model init, data and sampling seed")
    a("--digits", type=int, default=3, help="digits of each operand")
    a("--n-rows", type=int, default=4000, help="training problems")
    a("--eval-rows", type=int, default=500, help="held-out problems (none in the training rows)")
    a("--n-layer", type=int, default=2)
    a("--n-head", type=int, default=4)
    a("--n-embd", type=int, default=128)
    a("--block-size", type=int, default=64, help="prompt + trajectory")
    a("--max-turns", type=int, default=3)
    a("--max-new-tokens", type=int, default=40, help="trajectory bound (model + env tokens)")
    a("--sft-steps", type=int, default=100, help="warm-start steps (deliberately partial)")
    a("--sft-lr", type=float, default=3e-4)
    a("--sft-batch", type=int, default=32, help="rows per warm-start step (all their turns)")
    a("--lr", type=float, default=3e-4)
    a("--lr-warmup", type=int, default=20, help="RL lr warmup steps (a fresh AdamW)")
    a("--steps", type=int, default=150, help="RL steps")
    a("--prompts", type=int, default=32, help="prompts per RL step")
    a("--group", type=int, default=8, help="episodes per prompt (GRPO group)")
    a("--temperature", type=float, default=0.5)
    a("--eval-every", type=int, default=10)
    a("--time-limit", type=float, default=600.0, help="stop RL after this many seconds of wall")
    a("--threads", type=int, default=2, help="torch intra-op threads")
    a("--out", type=Path, default=None, help="write the curve as JSON here")
    return p.parse_args()


@dataclass(frozen=True)
class EpisodeRow:
    """A sampled episode in the fields `GRPOTrainer.train_step` reads of a Row."""

    prompt_ids: np.ndarray  # int32 [P]
    completion_ids: np.ndarray  # int32 [C]: model turns and env responses in order
    logprobs: np.ndarray  # float32 [C]: behaviour log-probs, 0 for env tokens
    versions: np.ndarray  # int32 [C]: weight version, ENV_VERSION for env tokens
    reward: float

    @property
    def tokens(self) -> int:
        return len(self.completion_ids)


def sample_turn(model: GPT, contexts: list[list[int]], budgets: list[int], seeds: list[int],
                offsets: list[int], temperature: float) -> list[tuple[list[int], list[float]]]:
    """One sampled turn per context (ids up to EOS or its budget, and their log-probs);
    token j of context i is drawn at trajectory position offsets[i] + j. Contexts of equal
    length and budget decode as one batch."""
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in contexts]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (c, b) in enumerate(zip(contexts, budgets, strict=True)):
        if b > 0:
            groups.setdefault((len(c), b), []).append(i)
    for (_, n_new), members in groups.items():
        x = torch.tensor([contexts[i] for i in members], dtype=torch.long)  # (B, L)
        cache, start = model.new_cache(), 0
        toks, lps = [], []
        done = torch.zeros(len(members), dtype=torch.bool)
        for step in range(n_new):
            logits = model(x, cache, start)[:, -1, :]  # (B, V)
            t, lp = sample(logits, [seeds[i] for i in members], [offsets[i] + step for i in members],
                           temperature=temperature, top_p=1.0)
            toks.append(t)
            lps.append(lp)
            done |= t == EOS
            if bool(done.all()):
                break
            start += x.size(1)
            x = t.unsqueeze(1)
        ids = torch.stack(toks, 1).tolist()
        logp = torch.stack(lps, 1).tolist()
        for i, row_ids, row_lp in zip(members, ids, logp, strict=True):
            n = row_ids.index(EOS) + 1 if EOS in row_ids else len(row_ids)  # rows that ended ran on
            out[i] = (row_ids[:n], row_lp[:n])
    return out


def sample_episodes(model: GPT, tok: CharTokenizer, rows: list[dict], seeds: list[int], *, version: int,
                    max_turns: int, max_new_tokens: int, temperature: float) -> list[EpisodeRow]:
    """Episodes under the same stop rules as the evaluator's greedy ones
    (`controller.evaluate`): done, `max_turns`, or no room for response + next turn."""
    block = model.cfg.block_size
    prompts = [tok.encode(r["prompt"]) for r in rows]
    ids: list[list[int]] = [[] for _ in rows]
    lps: list[list[float]] = [[] for _ in rows]
    vers: list[list[int]] = [[] for _ in rows]
    rewards, turns = [0.0] * len(rows), [0] * len(rows)
    envs = [calc_env.make() for _ in rows]
    for env, row, s in zip(envs, rows, seeds, strict=True):
        env.reset(row, s)
    live = list(range(len(rows)))
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        while live:
            new = sample_turn(model, [prompts[i] + ids[i] for i in live],
                              [min(max_new_tokens - len(ids[i]), block - len(prompts[i]) - len(ids[i])) for i in live],
                              [seeds[i] for i in live], [len(ids[i]) for i in live], temperature)
            going = []
            for i, (t, lp) in zip(live, new, strict=True):
                step = envs[i].step(tok.decode(t))
                rewards[i] += step.reward
                turns[i] += 1
                ids[i] += t
                lps[i] += lp
                vers[i] += [version] * len(t)
                if step.done or turns[i] == max_turns:
                    continue
                resp = tok.encode(step.response, bos=False)
                room = min(max_new_tokens - len(ids[i]), block - len(prompts[i]) - len(ids[i]))
                if not t or t[-1] != EOS or len(resp) >= room:
                    continue
                ids[i] += resp
                lps[i] += [0.0] * len(resp)
                vers[i] += [ENV_VERSION] * len(resp)
                going.append(i)
            live = going
    model.train(was_training)
    return [
        EpisodeRow(np.asarray(p, np.int32), np.asarray(c, np.int32), np.asarray(lp, np.float32),
                   np.asarray(v, np.int32), r)
        for p, c, lp, v, r in zip(prompts, ids, lps, vers, rewards, strict=True)
    ]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    tok = CharTokenizer()
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                          n_embd=args.n_embd, block_size=args.block_size))
    n_params = sum(p.numel() for p in model.parameters())
    trainer = GRPOTrainer(
        model=model, logits_fn=lambda m, ids, mask: m(ids), pad_id=PAD, lr=args.lr, weight_decay=0.0,
        betas=(0.9, 0.999), grad_clip=1.0, clip_eps=0.2, kl_coef=0.0, ppo_epochs=1,
        micro_batch_size=128, temperature=args.temperature, seed=args.seed, loss_type="dapo",
        lr_warmup_steps=args.lr_warmup,
    )
    train_rows = calc.make_rows(args.n_rows, digits=args.digits, seed=args.seed)
    held_out = calc.held_out_rows(args.eval_rows, digits=args.digits, seed=args.seed, exclude=train_rows)
    evaluator = Evaluator(held_out, model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens,
                          num_samples=3, make_env=calc_env.make, max_turns=args.max_turns)
    curve: list[dict] = []

    def evaluate(step: int) -> None:
        t0 = time.perf_counter()
        res = evaluator.evaluate(trainer.weights())
        point = {"step": step, "wall_s": round(time.perf_counter() - t_start, 1),
                 **{k.split("/")[1]: round(v, 4) for k, v in res.metrics.items()}}
        curve.append(point)
        print(json.dumps(point), f"(eval {time.perf_counter() - t0:.1f}s)", res.samples[0]["completion"],
              flush=True)

    # 1. Warm start on the demonstrations: the library's warm start, in a scratch run dir.
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(None, [f"run_dir={run_dir}", f"seed={args.seed}", f"warmup.sft_steps={args.sft_steps}",
                                 f"warmup.sft_lr={args.sft_lr}", f"warmup.sft_batch_size={args.sft_batch}",
                                 f"checkpoint.warmup_every_steps={max(1, args.sft_steps)}"])
        run_warmup(cfg, dataset=train_rows, trainer=trainer, tokenizer=tok, log=lambda _: None,
                   make_env=calc_env.make)
    print(f"params {n_params}, warm start {args.sft_steps} steps in {time.perf_counter() - t_start:.1f}s")
    evaluate(0)

    # 2. Synchronous on-policy GRPO.
    for step in range(1, args.steps + 1):
        rng = np.random.default_rng([args.seed, 0xCA1C, step])
        idx = rng.integers(0, len(train_rows), args.prompts)
        rows = [train_rows[int(i)] for i in idx for _ in range(args.group)]
        seeds = [int(s) for s in rng.integers(0, 2**63, len(rows))]
        eps = sample_episodes(model, tok, rows, seeds, version=trainer.rl_steps, max_turns=args.max_turns,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        groups = []
        for g in range(args.prompts):
            members = tuple(eps[g * args.group : (g + 1) * args.group])
            groups.append(TrainGroup(group_id=f"{step}/{g}", epoch=0, ordinal=g, idx=int(idx[g]), task=calc.TASK,
                                     advantages=stored_advantages([e.reward for e in members], "group_population"),
                                     rows=members))  # type: ignore[arg-type]  # EpisodeRow: see the docstring
        m = trainer.train_step(Batch(step=step, groups=tuple(groups)))
        if step % 10 == 0:
            print(f"step {step} reward {m['reward_mean']:.3f} tokens {m['tokens']:.0f} "
                  f"clip {m['clip_frac']:.3f} wall {time.perf_counter() - t_start:.0f}s", flush=True)
        out_of_time = time.perf_counter() - t_start > args.time_limit
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            evaluate(step)
        if out_of_time:
            break

    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "params": n_params, "curve": curve, "wall_s": round(time.perf_counter() - t_start, 1)}
    print(json.dumps({"seed": args.seed, "accuracy": [p["accuracy"] for p in curve], "wall_s": result["wall_s"]}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
