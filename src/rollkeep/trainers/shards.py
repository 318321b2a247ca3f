"""The sharded trainer checkpoint (`trainer.world_size` > 1): its layout, and reading it
back into whole tensors with every check done before anything is used.

Layout of the checkpoint's `trainer/` directory (docs/design.md §14)
-------------------------------------------------------------------
    trainer.json         as for one process (`grpo_snapshot`), format `rollkeep.grpo.sharded/1`,
                         plus `world_size` (the ranks that wrote the shards)
    rng.safetensors      `rank0` … `rank{N-1}`: each rank's torch CPU generator state
    reference.safetensors  the KL reference's weights, whole, when one exists
    shards/shard-0000{r+1}-model-00001-of-00001.safetensors
                         rank r's shard, written by `torch.distributed.checkpoint` with its
                         safetensors writer (`HuggingFaceStorageWriter(save_distributed=True)`):
                         the rank's local slice of every tensor, its offset in the whole
                         tensor in the header (`DCP_SHARDING_INFO`), and `rollkeep_step.rank{r}`
                         (an int64 [1] holding the step): every shard is bound to its step.

Tensor names: `model.{name}` for the model's unique state-dict tensors (ties once, as in
the one-process `model.safetensors`), `optimizer.{opt}.state.{i}.{name}` for the AdamW
state of parameter i (`rl`, `sft`), as in `optimizer.safetensors`. No pickle anywhere:
DCP's default `.metadata` file (a pickle) is never written; the safetensors headers are the
metadata.

Any checkpoint, sharded or not, loads on any number of ranks: a rank loads a sharded one
through DCP's resharding (each reads the slices it needs), a one-process one by slicing the
whole tensors; one process loads a sharded one by assembling the shards (`read_shards`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from ..core.errors import CheckpointError

__all__ = ["FORMAT", "SHARD_DIR", "read_shards", "shard_name", "split", "step_key"]

FORMAT = "rollkeep.grpo.sharded/1"
SHARD_DIR = "shards"
MODEL_PREFIX, OPTIMIZER_PREFIX = "model.", "optimizer."
_SHARD = re.compile(r"shard-(\d{5})-model-00001-of-00001\.safetensors")
_INFO = "DCP_SHARDING_INFO"
_REMEDY = ("the trainer shards of this checkpoint are damaged, incomplete or from another checkpoint; "
           "restore from an older checkpoint, or start the run fresh.")


def shard_name(rank: int) -> str:
    """The file DCP's safetensors writer names rank `rank`'s shard."""
    return f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


def step_key(rank: int) -> str:
    return f"rollkeep_step.rank{rank}"


def _bad(file: str, what: str, *, expected: str, found: str) -> CheckpointError:
    return CheckpointError(what, path=f"trainer/{file}", expected=expected, found=found, remedy=_REMEDY)


def read_shards(dir: Path, *, world_size: int, step: int) -> dict[str, Tensor]:
    """The whole tensors of the shards under `dir/shards/`, checked: exactly the
    `world_size` shard files, each a readable safetensors file bound to `step`, each
    tensor's slices within its whole shape and covering it exactly once (a replicated
    0-d tensor may appear in several shards, with equal values). Raises CheckpointError
    naming the shard."""
    from safetensors import safe_open

    root = Path(dir) / SHARD_DIR
    want = {shard_name(r): r for r in range(world_size)}
    try:
        found = sorted(p.name for p in root.iterdir())
    except OSError as e:
        raise _bad(SHARD_DIR, "The trainer shards cannot be listed", expected=f"{world_size} shard files",
                   found=e.strerror or str(e)) from None
    if sorted(want) != found:
        raise _bad(SHARD_DIR, f"The trainer shards are not the {world_size} the checkpoint lists",
                   expected=", ".join(sorted(want)), found=", ".join(found) or "none")
    chunks: dict[str, list[tuple[list[int], Tensor, str]]] = {}
    for name, rank in sorted(want.items(), key=lambda kv: kv[1]):
        rel = f"{SHARD_DIR}/{name}"
        path = root / name
        try:
            if not path.is_file() or path.is_symlink():
                raise ValueError("not a regular file")
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                info = json.loads(meta.get(_INFO, "null"))
                keys = list(f.keys())
                tensors = {k: f.get_tensor(k) for k in keys}
        except Exception as e:  # SafetensorError, JSON, whatever a damaged header provokes
            raise _bad(rel, f"Shard {name} is not a readable safetensors shard",
                       expected="a complete shard written by this run's ranks",
                       found=f"{type(e).__name__}: {e}"[:300]) from None
        bound = tensors.pop(step_key(rank), None)
        if bound is None or bound.shape != (1,) or int(bound[0]) != step:
            raise _bad(rel, f"Shard {name} is not of step {step}", expected=f"{step_key(rank)} = [{step}]",
                       found="no such tensor" if bound is None else f"{bound.tolist()}")
        if not isinstance(info, dict):
            raise _bad(rel, f"Shard {name} has no sharding information", expected=f"a {_INFO} header",
                       found=repr(info)[:80])
        for key, t in tensors.items():
            offsets = (info.get(key) or {}).get("saved_offsets")
            if not (isinstance(offsets, list) and len(offsets) == t.dim()
                    and all(isinstance(o, int) and o >= 0 for o in offsets)):
                raise _bad(rel, f"Shard {name} gives tensor {key!r} no valid offset",
                           expected=f"{t.dim()} offsets >= 0", found=repr(offsets)[:80])
            chunks.setdefault(key, []).append((offsets, t, rel))
    return {key: _assemble(key, parts) for key, parts in chunks.items()}


def _assemble(key: str, parts: list[tuple[list[int], Tensor, str]]) -> Tensor:
    first = parts[0][1]
    if first.dim() == 0:
        for _, t, rel in parts[1:]:
            if not torch.equal(t, first):
                raise _bad(rel, f"Replicated tensor {key!r} differs between shards",
                           expected=f"{first.item()}", found=f"{t.item()}")
        return first.clone()
    shape = [max(o[d] + t.shape[d] for o, t, _ in parts) for d in range(first.dim())]
    out = torch.empty(shape, dtype=first.dtype)
    covered = torch.zeros(shape, dtype=torch.int8)
    for offsets, t, rel in parts:
        if t.dtype != first.dtype:
            raise _bad(rel, f"Tensor {key!r} has slices of different dtypes", expected=str(first.dtype),
                       found=str(t.dtype))
        index = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=True))
        out[index] = t
        covered[index] += 1
    if not bool((covered == 1).all()):
        raise _bad(parts[0][2], f"The slices of tensor {key!r} do not cover it exactly once",
                   expected=f"slices tiling shape {shape}", found=f"{len(parts)} slices that overlap or leave a gap")
    return out


def split(tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor], list[str]]:
    """(model tensors by name, optimizer tensors by `{opt}.state.{i}.{name}`, other names)."""
    model, optimizer, other = {}, {}, []
    for key, t in tensors.items():
        if key.startswith(MODEL_PREFIX):
            model[key[len(MODEL_PREFIX):]] = t
        elif key.startswith(OPTIMIZER_PREFIX):
            optimizer[key[len(OPTIMIZER_PREFIX):]] = t
        else:
            other.append(key)
    return model, optimizer, other

