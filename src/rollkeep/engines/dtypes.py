"""`engine.dtype`: the precision an engine holds its copy of the weights in.

Trainers keep float32 master weights; every refit hands them to the engine, which holds
them cast to its dtype (`engine.dtype` of the hf and vllm engines):

  auto      the checkpoint's dtype, as the backend resolves it: transformers takes
            config.json's `dtype` (`torch_dtype` before transformers 5); vLLM does the same
            except that a float32 checkpoint runs in a 16-bit dtype (bfloat16 where the GPU
            has it: `_resolve_auto_dtype`, vllm/config/model.py, read in 0.22.0 and 0.32.0)
  float32 | bfloat16 | float16   that dtype, whatever the checkpoint holds

The cast rounds each weight to nearest (torch's `Tensor.to`, the same rounding the engine's
own `copy_` into a 16-bit parameter would do), so casting before the weights travel (to a
Ray replica: `transfer_dtype`) changes nothing the engine computes; it halves the bytes.

Torch is imported inside the functions: the config and the core never import it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
_SIXTEEN_BIT = ("bfloat16", "float16")


def checkpoint_dtype(model_path: str | Path) -> str | None:
    """The dtype config.json of `model_path` declares ("bfloat16", ...), None if it names
    none (or the file cannot be read: loading the model reports that better)."""
    try:
        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    name = config.get("dtype", config.get("torch_dtype"))
    return name if isinstance(name, str) and name in DTYPES[1:] else None


def torch_dtype(name: Any) -> Any:
    """`name` ("float32", ...) as a torch.dtype; a torch.dtype as it is; None for None."""
    import torch

    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES[1:]:
        raise ValueError(f"engine dtype {name!r}: expected one of {', '.join(DTYPES[1:])}")
    return getattr(torch, name)


def cast_weights(weights: Any, dtype: Any) -> Any:
    """A state dict `weights` with every floating-point tensor cast to `dtype` (None, or
    weights that are no mapping, e.g. the toy trainer's: `weights` itself).

    A storage several names share (a tied embedding and output head, as the trainer's
    `weights()` hands them over) is cast once, so the names still share one tensor; other
    values (integer buffers, non-tensors) pass as they are."""
    import torch

    if dtype is None or not isinstance(weights, Mapping):
        return weights
    done: dict[tuple, Any] = {}
    out = {}
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
            out[name] = t
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key not in done:
            done[key] = t.detach().to(dtype)
        out[name] = done[key]
    return out


def transfer_dtype(section: Any, context: Mapping[str, Any]) -> Any:
    """The 16-bit torch.dtype an engine of `section` will hold its weights in, when that is
    known before it starts; weights cast to it before they travel are half the bytes and
    load to the same values. None: they travel as they are (float32, or a dtype only the
    engine can resolve, or one the run's context sets: deterministic runs sample in float64)."""
    name = getattr(section, "dtype", None)
    if name is None or "dtype" in context:
        return None
    if name == "auto":
        name = checkpoint_dtype(section.model_path)  # a 16-bit checkpoint runs in its dtype on both
    return torch_dtype(name) if name in _SIXTEEN_BIT else None
