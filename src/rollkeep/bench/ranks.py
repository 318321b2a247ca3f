"""Training on several ranks (`rollkeep bench --suite ranks`, README "Training on several
ranks").

    ranks_bench(repeats=..., quick=..., log=...)

On the built-in GPT, with a batch shaped like the main job's (16 prompts x 8 siblings,
7-token prompts, 4-token completions, one micro-batch of 128), for the main job's model
(2 layers x 128 wide) and one with 8x its parameters (4 layers x 256 wide):

  step        seconds per RL step (medians over `repeats` steps after one to warm up) on 1
              and 2 ranks; on a 2-core machine expect little speed-up: the point here is
              correctness, the scaling figures come from a GPU
  checkpoint  per world size 1, 2, 3: the trainer files' bytes (per shard), the snapshot
              (the step boundary's copy), the write, and the restore of that checkpoint into a
              trainer of the same world size (ranks already started)
  publish     the peak memory rank 0 adds while the weights are gathered and streamed to
              the controller, against the model's bytes (it holds one whole tensor at a time)
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODELS = {"main job (2 x 128)": (2, 4, 128), "8x parameters (4 x 256)": (4, 4, 256)}


def _batch(tok: Any, step: int, vocab: int):
    import numpy as np

    from ..core.rollout.rows import Row
    from ..trainers import Batch, TrainGroup

    rng = np.random.default_rng(step)
    groups = []
    for g in range(16):
        prompt = np.asarray(tok.encode(f"{g:02d}+{step % 100:02d}="), np.int32)
        rows = tuple(Row(prompt, rng.integers(3, vocab, 4).astype(np.int32),
                         (-rng.random(4) * 3).astype(np.float32), np.zeros(4, np.int32), float(k % 2), "stop")
                     for k in range(8))
        groups.append(TrainGroup(f"e0.{g}", 0, g, g, "arith", tuple(1.0 if k % 2 else -1.0 for k in range(8)), rows))
    return Batch(step, tuple(groups))


def _trainer(world_size: int, shape: tuple[int, int, int]):
    import torch

    from ..config import TorchModelConfig, TorchTrainerConfig
    from ..models.gpt import GPT, GPTConfig
    from ..models.tokenizer import CharTokenizer
    from ..trainers import make_trainer

    n_layer, n_head, n_embd = shape
    tok = CharTokenizer()
    cfg = TorchTrainerConfig(model=TorchModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=32),
                             world_size=world_size, micro_batch_size=128, lr=2e-4)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=32))
    return tok, make_trainer(cfg, model=model, tokenizer=tok, temperature=1.0, seed=0, max_completion_length=5)


def _size(dir: Path) -> int:
    return sum(p.stat().st_size for p in dir.rglob("*") if p.is_file())


def ranks_bench(*, repeats: int = 3, quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    steps = max(2, repeats if not quick else 2)
    out: dict[str, Any] = {"step": {}, "checkpoint": {}, "publish": {}}
    for label, shape in MODELS.items():
        per_ws: dict[str, Any] = {}
        for ws in (1, 2):
            tok, trainer = _trainer(ws, shape)
            try:
                if ws > 1:
                    trainer.info()  # the ranks start outside the measurement
                times = []
                for step in range(steps + 1):
                    batch = _batch(tok, step + 1, tok.vocab_size)
                    t0 = time.perf_counter()
                    trainer.train_step(batch)
                    times.append(time.perf_counter() - t0)
                per_ws[str(ws)] = {"median_s": statistics.median(times[1:]), "times_s": times[1:]}
                params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
                if ws > 1:
                    out["publish"][label] = {"model_bytes": params,
                                             "rank0_peak_extra_bytes": trainer.publish_peak_extra_bytes}
            finally:
                getattr(trainer, "close", lambda: None)()
            log(f"{label}: {ws} rank(s), {per_ws[str(ws)]['median_s'] * 1e3:.1f} ms per step")
        out["step"][label] = per_ws
    for label, shape in MODELS.items():
        per_ws = {}
        for ws in (1, 2, 3):
            with tempfile.TemporaryDirectory() as tmp:
                tok, trainer = _trainer(ws, shape)
                again = None
                try:
                    trainer.train_step(_batch(tok, 1, tok.vocab_size))
                    t0 = time.perf_counter()
                    snap = trainer.snapshot()
                    t1 = time.perf_counter()
                    snap.save(Path(tmp))
                    t2 = time.perf_counter()
                    _, again = _trainer(ws, shape)
                    if ws > 1:
                        again.info()
                    t3 = time.perf_counter()
                    again.load(Path(tmp), step=1)
                    t4 = time.perf_counter()
                    assert again.weights_sha256() == trainer.weights_sha256()
                    per_ws[str(ws)] = {"bytes": _size(Path(tmp)), "shard_bytes": list(getattr(snap, "shard_bytes", [])),
                                       "snapshot_s": t1 - t0, "write_s": t2 - t1, "restore_s": t4 - t3}
                finally:
                    for t in (trainer, again):
                        if t is not None:
                            getattr(t, "close", lambda: None)()
            v = per_ws[str(ws)]
            log(f"{label}: checkpoint on {ws} rank(s): {v['bytes'] / 1e6:.2f} MB, write {v['write_s'] * 1e3:.0f} ms, "
                f"restore {v['restore_s'] * 1e3:.0f} ms")
        out["checkpoint"][label] = per_ws
    return out


def table_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for label, per_ws in res["step"].items():
        one, two = per_ws["1"]["median_s"], per_ws["2"]["median_s"]
        rows.append(["step", label, f"1 rank {one * 1e3:.1f} ms, 2 ranks {two * 1e3:.1f} ms ({one / two:.2f}x)"])
    for label, per_ws in res["checkpoint"].items():
        for ws, v in per_ws.items():
            shards = f" (shards {', '.join(f'{b / 1e6:.2f}' for b in v['shard_bytes'])} MB)" if v["shard_bytes"] else ""
            rows.append(["checkpoint", f"{label}, {ws} rank(s)",
                         f"{v['bytes'] / 1e6:.2f} MB{shards}; snapshot {v['snapshot_s'] * 1e3:.1f} ms, write "
                         f"{v['write_s'] * 1e3:.0f} ms, restore {v['restore_s'] * 1e3:.0f} ms"])
    for label, v in res["publish"].items():
        rows.append(["publish", label, f"rank 0 peak +{v['rank0_peak_extra_bytes'] / 1e6:.2f} MB while gathering "
                     f"{v['model_bytes'] / 1e6:.2f} MB of weights"])
    return rows
