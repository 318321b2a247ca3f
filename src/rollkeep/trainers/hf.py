"""GRPO on any local transformers causal LM (`trainer.name = hf`): the same algorithm as the
built-in trainer (`grpo.GRPOTrainer`), with the model and tokenizer loaded from
`trainer.model_path`. Single device (CUDA when available). Loads with
`local_files_only=True`: nothing is ever downloaded."""

from __future__ import annotations

from typing import Any

import torch

from ..config import HFTrainerConfig
from ..models.hf import load_pretrained
from .grpo import GRPOTrainer, hyperparameters


class HFTokenizer:
    """The two things rollkeep asks of a tokenizer (warm start, evaluation), over a
    transformers tokenizer."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.vocab_size = len(tok)

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """A prompt (`bos`) as the hf engine encodes it, with the tokenizer's own special
        tokens (a BOS only where the tokenizer adds one); a continuation without them."""
        return list(self.tok(text, add_special_tokens=bos)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class HFTrainer(GRPOTrainer):
    name = "hf"

    def __init__(
        self, cfg: HFTrainerConfig, *, temperature: float, seed: int,
        max_completion_length: int | None = None,
    ) -> None:
        """`temperature` and `max_completion_length` (dr_grpo's L_max) are the engine's
        `temperature` and `max_new_tokens`, handed over by the builder."""
        tok, model = load_pretrained(cfg.model_path, field="trainer.model_path", dtype=cfg.dtype)
        if torch.cuda.is_available():
            model = model.cuda()
        model.train()
        self.tokenizer = HFTokenizer(tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        super().__init__(
            model=model,
            # Right padding with an attention mask: a causal LM's earlier positions never
            # see the padding.
            logits_fn=lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).logits,
            pad_id=pad,
            temperature=temperature,
            seed=seed,
            max_completion_length=max_completion_length,
            **hyperparameters(cfg),
        )
