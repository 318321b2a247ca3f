"""A tiny transformers model and tokenizer, built fully offline: for tests, benchmarks and
a first look at server mode (`rollkeep bench --suite remote`), where no model can be
downloaded.

The tokenizer is character-level (a BPE model with no merges: every character is a token)
over digits, arithmetic signs, letters and a little punctuation, with <pad>/<bos>/<eos>/<unk>
and a plain-text chat template (`User:` and `Assistant:` turns). The model is a randomly
initialised two-layer GPT-2.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = string.digits + "+-*=" + string.ascii_letters + " :.,?!\n"
#: "User: {prompt}\nAssistant:" for a prompt; an assistant turn is "Assistant:{text}<eos>\n", so a
#: multi-turn conversation renders with the prefix property `models.chat` needs.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}Assistant:{{ m['content'] }}{{ eos_token }}\n"
    "{% else %}User: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def make_tiny_hf_model(
    path: Path, *, n_embd: int = 32, n_head: int = 2, n_positions: int = 64, seed: int = 0
) -> Path:
    """Write a tokenizer and a random tiny GPT-2 (safetensors) into `path`; return `path`.
    (vLLM's attention kernels want a head size n_embd / n_head of at least 32.) Another `seed`
    gives the same architecture with other weights (a second checkpoint to reload)."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # join characters without spaces
    tok.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    config = GPT2Config(
        n_layer=2,
        n_head=n_head,
        n_embd=n_embd,
        n_positions=n_positions,
        vocab_size=len(vocab),
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(path, safe_serialization=True)
    return path
