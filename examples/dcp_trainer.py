"""A trainer that saves its state with torch.distributed.checkpoint (DCP): the worked
example of "Bring your own trainer" in docs/library.md.

It is the built-in GRPO trainer on the built-in GPT (`TorchTrainer`) with another
checkpoint format. The protocol it follows (rollkeep.trainers.base):

    snapshot()      on the loop thread, at the cut: clone the tensors, serialise nothing
                    (the built-in `GRPOSnapshot` already is such a copy)
    save(dir)       on the checkpoint writer's thread: `dcp.save` into `dir/dcp/`
                    (`.metadata` + `__0_0.distcp`), and `dir/step.json` recording
                    `rollkeep_step`: rollkeep cannot read a .distcp shard, so the JSON file
                    is what binds this state to its step (restore step 5)
    load(dir, step) read `step.json`, refuse another step, `dcp.load` the tensors

Use it (from the repository root, so that `examples` is importable):

    PYTHONPATH=. rollkeep train configs/arith.yaml trainer.name=custom \\
        trainer.factory=examples.dcp_trainer:make

Under FSDP every rank would call `dcp.save` with its own shards into the same `dir/dcp/`
(DCP coordinates the ranks and writes one `.metadata`), and rank 0 would write step.json.
rollkeep runs one trainer process; a multi-rank trainer is yours to run behind `save`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from rollkeep.config import TorchModelConfig, TorchTrainerConfig
from rollkeep.core.checkpoint.cut import STEP_KEY
from rollkeep.core.errors import CheckpointError
from rollkeep.core.io.untrusted import loads_json, read_regular
from rollkeep.trainers.base import check_step
from rollkeep.trainers.grpo import GRPOSnapshot, TorchTrainer
from rollkeep.trainers.grpo_snapshot import OptimizerState

FORMAT = "example.dcp/1"
STEP_FILE = "step.json"
DCP_DIR = "dcp"


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP without an initialised process group saves and loads in this process alone (torch
    2.13), and warns that it assumes so: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class DCPSnapshot:
    """The built-in snapshot's copies, written with DCP."""

    def __init__(self, inner: GRPOSnapshot) -> None:
        self.inner = inner
        self.step = inner.step

    def save(self, dir: Path) -> None:
        s = self.inner
        tensors = {f"model/{k}": t for k, t in s.model.items()}
        tensors |= {f"optim/{opt}/{k}": t for opt, o in s.optimizers.items() for k, t in o.tensors.items()}
        tensors |= {f"reference/{k}": t for k, t in (s.reference or {}).items()}
        tensors["rng"] = s.rng
        with _single_process():
            dcp.save(tensors, checkpoint_id=Path(dir) / DCP_DIR)
        meta = {"format": FORMAT, STEP_KEY: s.step, "rl_steps": s.rl_steps, "sft_steps": s.sft_steps,
                "ties": s.ties, "reference": s.reference is not None,
                "optimizers": {opt: {"param_groups": o.param_groups, "scalars": o.scalars}
                               for opt, o in s.optimizers.items()}}
        (Path(dir) / STEP_FILE).write_text(json.dumps(meta, sort_keys=True))


class DCPTrainer(TorchTrainer):
    name = "dcp-example"

    def snapshot(self) -> DCPSnapshot:
        return DCPSnapshot(super().snapshot())

    def load(self, dir: Path, *, step: int | None = None) -> None:
        dir = Path(dir)
        try:
            meta = loads_json(read_regular(dir / STEP_FILE))
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            reader = dcp.FileSystemReader(dir / DCP_DIR)
            # Tensors allocated as the checkpoint's metadata says, then filled in place.
            tensors = {k: torch.empty(m.size, dtype=m.properties.dtype)
                       for k, m in reader.read_metadata().state_dict_metadata.items()}
            with _single_process():
                dcp.load(tensors, storage_reader=reader)
        except (OSError, ValueError, RuntimeError, AttributeError) as e:
            raise CheckpointError(
                "the DCP trainer state cannot be read", path=f"trainer/{STEP_FILE}, trainer/{DCP_DIR}/",
                expected=f"{STEP_FILE} ({FORMAT}) and a torch.distributed.checkpoint directory",
                found=f"{type(e).__name__}: {e}"[:300], remedy="restore from another checkpoint") from None
        check_step(STEP_FILE, meta.get(STEP_KEY), step)

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}

        snap = GRPOSnapshot(
            model=part("model/"), ties=meta["ties"],
            optimizers={opt: OptimizerState(part(f"optim/{opt}/"), o["scalars"], o["param_groups"])
                        for opt, o in meta["optimizers"].items()},
            rl_steps=meta["rl_steps"], sft_steps=meta["sft_steps"], rng=tensors["rng"],
            reference=part("reference/") if meta["reference"] else None)
        # The built-in trainer's `load` checks every tensor against this model (names,
        # dtypes, shapes, ties) before it changes anything; reuse it through its own
        # format, written to a scratch directory (the checkpoint itself is never touched).
        with tempfile.TemporaryDirectory(prefix="rollkeep-dcp-") as scratch:
            snap.save(Path(scratch))
            super().load(Path(scratch), step=step)


def make(*, model: Any, tokenizer: Any, temperature: float, seed: int, max_completion_length: int,
         scale_rewards: str, **kwargs: Any) -> DCPTrainer:
    """`trainer.factory` for `trainer.name: custom`: the built-in GPT rollkeep made, and
    `trainer.kwargs` as the GRPO settings (`lr`, `kl_coef`, ...: TorchTrainerConfig's keys)."""
    c = model.cfg
    shape = TorchModelConfig(vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
                             block_size=c.block_size, dropout=c.dropout)
    cfg = TorchTrainerConfig(model=shape, scale_rewards=scale_rewards, **kwargs)
    return DCPTrainer(cfg, model=model, tokenizer=tokenizer, temperature=temperature, seed=seed,
                      max_completion_length=max_completion_length)
