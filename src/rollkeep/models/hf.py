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
