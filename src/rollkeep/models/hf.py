"""Loading a transformers causal LM and its tokenizer from a local directory, for the hf
engine and the hf trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.errors import UserInputError

_EXPECTED = "a local directory with a transformers model (config.json and weights) and its tokenizer"


def load_pretrained(model_path: str, *, field: str, dtype: str | None = None) -> tuple[Any, Any]:
    """The tokenizer and the causal LM of a local directory (never downloads). Errors name
    the config key `field` (engine.model_path or trainer.model_path). `dtype` ("float32",
    "bfloat16", ...): the model's parameters in that dtype; None: the checkpoint's
    (transformers 5's `dtype="auto"`)."""
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
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                     **({} if dtype is None else {"dtype": _torch_dtype(dtype)}))
    except Exception as e:
        raise UserInputError(
            f"{field} {str(path)!r}: transformers could not load a causal LM and its tokenizer",
            path=str(path), field=field, expected=_EXPECTED, found=f"{type(e).__name__}: {e}",
            remedy="check that the directory is complete and its model type is a causal LM",
        ) from e
    return tokenizer, model


def _torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"not a floating-point torch dtype: {name!r}")
    return dtype


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
        from .chat import prompt_ids

        encoded = [prompt_ids(tokenizer, p) for p in prompts]
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


def read_weights_dir(path: str, model: Any) -> dict[str, Any]:
    """The state dict of the HF model directory `path` (config.json, *.safetensors, as
    `save_pretrained` or the controller's RUN_DIR/weights/v<N>/ writes it), checked to fit
    `model` exactly: the same model type, the same parameter names and shapes, so loading
    it with `load_state_dict(strict=True)` copies everything or fails before copying
    anything. If the directory holds a WEIGHTS.json, every file it lists must have its
    size and sha256 (a torn or tampered write is refused). Raises UserInputError naming
    what does not fit; reads no pickle."""
    import hashlib
    import json

    field = "weights_path"
    where = Path(path).expanduser()

    def refuse(what: str, found: str, expected: str = _EXPECTED) -> UserInputError:
        return UserInputError(what, path=str(where), field=field, expected=expected, found=found,
                              remedy="point the reload at a complete directory of the served model's architecture")

    if not where.is_dir() or not (where / "config.json").is_file():
        raise refuse(f"{str(where)!r} is not a transformers model directory",
                     "nothing at that path" if not where.exists() else "no config.json there")
    if not any(where.glob("*.safetensors")):
        raise refuse(f"{str(where)!r} holds no safetensors weights", "no *.safetensors file")
    listing = where / "WEIGHTS.json"
    if listing.is_file():
        try:
            files = json.loads(listing.read_text())["files"]
            listed = {str(name): (int(v["size"]), str(v["sha256"])) for name, v in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise refuse("its WEIGHTS.json does not parse", f"{type(e).__name__}: {e}",
                         'WEIGHTS.json {"files": {name: {"size", "sha256"}}}') from e
        for name, (size, sha) in sorted(listed.items()):
            f = where / name
            if Path(name).is_absolute() or ".." in Path(name).parts or not f.is_file():
                raise refuse(f"WEIGHTS.json lists {name!r}, which is not a file in the directory", "missing")
            digest = hashlib.sha256()
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            if f.stat().st_size != size or digest.hexdigest() != sha:
                raise refuse(f"{name} does not match WEIGHTS.json",
                             f"{f.stat().st_size} bytes, sha256 {digest.hexdigest()[:16]}...",
                             f"{size} bytes, sha256 {sha[:16]}...")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(where, local_files_only=True)
        if config.model_type != model.config.model_type:
            raise refuse(f"{str(where)!r} holds another architecture", f"model type {config.model_type!r}",
                         f"model type {model.config.model_type!r}")
        loaded, info = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, use_safetensors=True,
                                                            output_loading_info=True)
    except UserInputError:
        raise
    except Exception as e:
        raise refuse(f"{str(where)!r}: transformers could not load it", f"{type(e).__name__}: {e}") from e
    gaps = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if gaps or info.get("error_msgs"):
        raise refuse(f"{str(where)!r} does not hold exactly the model's tensors",
                     "; ".join(f"{k}: {', '.join(map(str, v[:5]))}" for k, v in gaps.items())
                     or "; ".join(info["error_msgs"]))
    weights = loaded.state_dict()
    served = model.state_dict()
    wrong = sorted(set(weights) ^ set(served)) + sorted(
        k for k in set(weights) & set(served) if tuple(weights[k].shape) != tuple(served[k].shape))
    if wrong:
        shown = ", ".join(f"{k} {tuple(weights[k].shape) if k in weights else 'absent'} (served "
                          f"{tuple(served[k].shape) if k in served else 'absent'})" for k in wrong[:5])
        raise refuse(f"{str(where)!r} does not fit the served model", shown,
                     "the served model's parameter names and shapes")
    return weights
