"""How much of an update bf16 master weights lose (docs/training.md, "Precision").

    python scripts/master_weights.py [--lr 1e-5 1e-6] [--n-embd 32 256] [--steps 3]

Builds a tiny GPT-2 from config (rollkeep.models.tiny_hf), saves it in bfloat16 as Qwen
and Llama ship, and trains it with the hf trainer (`trainer.dtype: float32`, the default,
and `bfloat16`) on the same batches: prints, per learning rate, the share of parameter
elements with a gradient that each AdamW step changes, overall and for the layer norms'
weights (values near 1).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from rollkeep.config import HFTrainerConfig
from rollkeep.core.rollout.rows import Row
from rollkeep.trainers import Batch, TrainGroup, make_trainer


def bf16_checkpoint(path: Path, n_embd: int) -> Path:
    from transformers import AutoModelForCausalLM

    from rollkeep.models.tiny_hf import make_tiny_hf_model

    make_tiny_hf_model(path, n_embd=n_embd, n_head=max(1, n_embd // 32))
    conf = json.loads((path / "config.json").read_text())
    conf.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    (path / "config.json").write_text(json.dumps(conf))
    AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(torch.bfloat16).save_pretrained(path)
    return path


def batch(step: int, rng: np.random.Generator) -> Batch:
    groups = []
    for g in range(4):
        rows = []
        for _ in range(4):
            completion = rng.integers(4, 60, size=6).astype(np.int32)
            rows.append(Row(prompt_ids=np.asarray([1, 10 + g, 20 + g], np.int32), completion_ids=completion,
                            logprobs=np.full(6, -3.0, np.float32), versions=np.full(6, step - 1, np.int32),
                            reward=float(rng.random() < 0.5), finish_reason="stop"))
        advs = tuple(float(x) for x in rng.normal(size=4))
        groups.append(TrainGroup(group_id=f"e{step}.{g}", epoch=0, ordinal=g, idx=g, task="t", advantages=advs,
                                 rows=tuple(rows)))
    return Batch(step, tuple(groups))


def shares(path: Path, dtype: str, lr: float, steps: int) -> tuple[float, float]:
    trainer = make_trainer(HFTrainerConfig(model_path=str(path), dtype=dtype, lr=lr), temperature=1.0, seed=0,
                           max_completion_length=8)
    rng = np.random.default_rng(0)
    changed = total = norm_changed = norm_total = 0
    for step in range(1, steps + 1):
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train_step(batch(step, rng))
        for n, p in trainer.model.named_parameters():
            has = p.grad != 0
            moved = int(((p.detach() != before[n]) & has).sum())
            changed, total = changed + moved, total + int(has.sum())
            if ".ln_" in n and n.endswith("weight"):
                norm_changed, norm_total = norm_changed + moved, norm_total + int(has.sum())
    return changed / total, norm_changed / max(1, norm_total)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-6])
    p.add_argument("--n-embd", type=int, nargs="+", default=[32, 256])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    print("| n_embd | lr | master dtype | elements changed per step | layer-norm weights changed |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for n_embd in args.n_embd:
            path = bf16_checkpoint(Path(tmp) / f"m{n_embd}", n_embd)
            for lr in args.lr:
                for dtype in ("float32", "bfloat16"):
                    all_, norms = shares(path, dtype, lr, args.steps)
                    print(f"| {n_embd} | {lr:g} | {dtype} | {all_:.3f} | {norms:.3f} |", flush=True)


if __name__ == "__main__":
    main()
