"""Loading a transformers causal LM and its tokenizer from a local directory, for the hf
engine and the hf trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import UserInputError

_EXPECTED = "a local directory with a transformers model (config.json and weights) and its tokenizer"


def load_pretrained(model_path: str, *, field: str) -> tuple[Any, Any]:
    """The tokenizer and the causal LM of a local directory (never downloads). Errors name
    the config key `field` (engine.model_path or trainer.model_path)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise UserInputError(
            "the hf backend needs the transformers library, which is not installed",
            field=field,
            found=f"ImportError: {e}",
            remedy="pip install 'rollkeep[hf]'",
        ) from e
    path = Path(model_path).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        if not path.exists():
            found = "nothing at that path"
        elif not path.is_dir():
            found = "a file, not a directory"
        else:
            names = sorted(p.name for p in path.iterdir())
            found = f"a directory without config.json, holding {names[:10] or 'nothing'}"
        raise UserInputError(
            f"{field} {str(path)!r} is not a transformers model directory",
            path=str(path), field=field, expected=_EXPECTED, found=found,
            remedy=f"point {field} at a directory written by save_pretrained (downloads are off)",
        )
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles and not any(path.glob("*.safetensors")):
        # Other weight formats (pytorch_model.bin, *.pt) are pickles: reading one runs
        # whatever code it holds. rollkeep never reads a pickle.
        raise UserInputError(
            f"{field} {str(path)!r} holds no safetensors weights",
            path=str(path), field=field,
            expected="model.safetensors (or sharded model-*.safetensors): rollkeep reads no pickle",
            found=f"weights in a pickle format only: {', '.join(pickles)}",
            remedy="convert it once, on a machine where you trust the file: "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)",
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True)
    except Exception as e:
        raise UserInputError(
            f"{field} {str(path)!r}: transformers could not load a causal LM and its tokenizer",
            path=str(path), field=field, expected=_EXPECTED, found=f"{type(e).__name__}: {e}",
            remedy="check that the directory is complete and its model type is a causal LM",
        ) from e
    return tokenizer, model


def greedy_texts(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int,
                 chat_template: bool = False) -> list[str]:
    """Argmax decoding of a transformers causal LM, for evaluation: each prompt encoded as
    the hf engine encodes it (the tokenizer's special tokens, or its chat template), prompts
    of equal token length in one batch (no padding), the key/value cache, EOS ends a
    completion (and is not part of its text), and so does the model's context length.
    Returns the decoded completions, in order."""
    import inspect

    import torch

    if chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=False) for p in prompts]
        encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:
        encoded = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    context = getattr(model.config, "max_position_embeddings", None)
    eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    out = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for length, members in by_len.items():
                n_new = max_new_tokens if context is None else min(max_new_tokens, context - length)
                if n_new <= 0 or length == 0:
                    continue
                x = torch.tensor([encoded[i] for i in members], dtype=torch.long, device=device)  # (B, P)
                cache, steps = None, []
                done = torch.zeros(len(members), dtype=torch.bool, device=device)
                for _ in range(n_new):
                    res = model(input_ids=x, use_cache=True, **{cache_arg: cache})
                    cache = res[cache_arg]
                    nxt = res.logits[:, -1, :].argmax(dim=-1)  # (B,)
                    steps.append(nxt)
                    if eos is not None:
                        done |= nxt == eos
                    if bool(done.all()):
                        break
                    x = nxt.unsqueeze(1)
                rows = torch.stack(steps, dim=1).tolist()  # (B, T)
                for i, ids in zip(members, rows, strict=True):
                    if eos is not None and eos in ids:
                        ids = ids[: ids.index(eos)]
                    out[i] = tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out
