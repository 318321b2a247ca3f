"""The servers' tokenizer, local (`engine.tokenizer_path`): prompts are encoded here and sent
as ids; completions are decoded here; the vocabulary bounds every id a server returns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.errors import UserInputError
from ..core.rollout.generation import DataError, GenRequest
from ..engines.base import EpisodeTokenizer
from ..models.chat import prompt_ids as chat_prompt_ids

_FIELD = "engine.tokenizer_path"


class RemoteTokenizer:
    def __init__(self, path: str, *, chat_template: bool) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise UserInputError("engine.name: remote needs the transformers library for its tokenizer",
                                 field=_FIELD, found=f"ImportError: {e}", remedy="pip install 'rollkeep[hf]'") from e
        p = Path(path).expanduser()
        if not p.is_dir():
            raise UserInputError(f"{_FIELD} {str(p)!r} is not a directory", path=str(p), field=_FIELD,
                                 expected="a local directory holding the servers' Hugging Face tokenizer",
                                 found="nothing there" if not p.exists() else "not a directory",
                                 remedy=f"point {_FIELD} at the model directory the servers serve (downloads are off)")
        try:
            self.tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        except Exception as e:
            raise UserInputError(f"{_FIELD} {str(p)!r}: transformers could not load a tokenizer from it",
                                 path=str(p), field=_FIELD, expected="tokenizer.json / tokenizer_config.json",
                                 found=f"{type(e).__name__}: {e}"[:300], remedy="check the directory") from None
        if chat_template and getattr(self.tok, "chat_template", None) is None:
            raise UserInputError(f"engine.chat_template (or data.chat_template) is true but the tokenizer in {p} "
                                 "has no chat template", field="engine.chat_template",
                                 expected="a tokenizer with a chat template", found="none",
                                 remedy="set engine.chat_template=false and data.chat_template=false")
        model = _model_config(p)
        self.chat_template = chat_template
        self.vocab = max(len(self.tok), int(model.get("vocab_size") or 0))
        ctx = model.get("max_position_embeddings") or model.get("n_positions")
        self.context: int | None = int(ctx) if isinstance(ctx, int) and ctx > 0 else None
        self.eos = self.tok.eos_token_id
        self.probe_id = next(t for t in (self.tok.bos_token_id, self.eos, 0) if t is not None)
        self.episode = EpisodeTokenizer(self.tok)

    def encode_prompt(self, req: GenRequest) -> list[int]:
        text = req.prompt.prompt
        if self.chat_template:  # the template writes its own special tokens (`models.chat`)
            ids = chat_prompt_ids(self.tok, text)
        else:
            ids = self.tok.encode(text, add_special_tokens=True)
        if not ids or (self.context is not None and len(ids) >= self.context):
            raise DataError(f"remote engine: prompt of {len(ids)} tokens does not fit the model's context of "
                            f"{self.context} with room to generate ({req.group_id}/{req.generation})")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _model_config(p: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # a tokenizer directory without the model's config: no context bound known
    return cfg if isinstance(cfg, dict) else {}
