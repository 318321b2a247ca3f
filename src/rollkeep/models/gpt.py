"""A small GPT (after nanoGPT's model.py): token and position embeddings, pre-norm
transformer blocks, a tied output head. It serves both sides of RL:

  training    `forward(idx)` over whole sequences (causal), logits for every position
  generation  `forward(idx, cache=..., start=...)`: a prefill, then one token at a time
              with a key/value cache

Attention is written with plain matmul and softmax (no fused kernel), so the engine's
result for one sequence does not depend on what else is in its batch. Sequences in one
batch have equal length (the engine buckets prompts by length), so there is no padding.
The linear layers need more for that: see `row_chunk` and `_linear`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0


# Rows per matmul call with `GPT.row_chunk` set (the engine sets it; a call gets 16 or 32
# rows): a multiple of 4 (MKL on AVX2 computes remainder rows of other counts with tail
# kernels), >= 16 (on AVX-512, MKL 2024.2 gives a row other bits below 11 rows (float32,
# 256 inputs) or 16 (float64, 2 threads)), and <= 32 (with 2 threads, float32, 2048 inputs,
# it switches kernels again at 64 rows). Measured on Sapphire Rapids, 1 and 2 threads, 32
# to 2048 inputs.
ROW_CHUNK = 32
_ROW_PAD = 16


def _linear(m: nn.Linear, x: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """`m(x)`; with `chunk`, row by row bit-identical whatever the number of rows: the BLAS
    picks its kernel by the row count, and the last bits of a row depend on that kernel, so
    every call gets `chunk` rows, or (the last) a multiple of 16 rows, padded with zeros."""
    if chunk is None:
        return m(x)
    *lead, K = x.shape
    x2 = x.reshape(-1, K)
    M = x2.size(0)
    if M % _ROW_PAD:
        x2 = F.pad(x2, (0, 0, 0, -M % _ROW_PAD))
    wt = m.weight.t()
    if x2.size(0) <= chunk:  # one call (decode steps of up to `chunk` rows)
        out = x2 @ wt if m.bias is None else torch.addmm(m.bias, x2, wt)
    else:
        out = x2.new_empty(x2.size(0), m.weight.size(0))
        for i in range(0, x2.size(0), chunk):
            if m.bias is None:
                torch.mm(x2[i : i + chunk], wt, out=out[i : i + chunk])
            else:
                torch.addmm(m.bias, x2[i : i + chunk], wt, out=out[i : i + chunk])
    return out[:M].view(*lead, -1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: list | None, layer: int, chunk: int | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = _linear(self.qkv, x, chunk).split(C, dim=2)
        # (B, nh, T, hs), each copied into its own memory: a strided view goes to the batched
        # matmuls as it is when B is 1 and is copied when B > 1, and on some CPUs (AMD EPYC,
        # float64) the two paths give other bits, so a row's result would depend on its batch.
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2).contiguous()
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2).contiguous()
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2).contiguous()
        if cache is not None:
            if cache[layer] is not None:  # append to the keys and values of earlier tokens
                k = torch.cat([cache[layer][0], k], dim=2)
                v = torch.cat([cache[layer][1], v], dim=2)
            cache[layer] = (k, v)
        S = k.size(2)  # keys: earlier tokens (cache) + these T
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, S)
        # Query i (absolute position S - T + i) sees keys 0 .. S - T + i.
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        att = att.masked_fill(~mask, float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return _linear(self.proj, y, chunk)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, cache: list | None, layer: int, chunk: int | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, chunk)
        if chunk is None:
            return x + self.mlp(self.ln_2(x))
        fc, act, out, drop = self.mlp
        return x + drop(_linear(out, act(_linear(fc, self.ln_2(x), chunk)), chunk))


class GPT(nn.Module):
    # Rows per matmul call (`_linear`), or None: plain nn.Linear. The engine sets ROW_CHUNK on
    # its copy so a row's logits are bitwise independent of the batch; training leaves None.
    row_chunk: int | None = None

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def new_cache(self) -> list:
        return [None] * self.cfg.n_layer

    def forward(self, idx: torch.Tensor, cache: list | None = None, start: int = 0) -> torch.Tensor:
        """idx (B, T) token ids at positions start .. start+T-1 → logits (B, T, vocab)."""
        B, T = idx.shape
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i, self.row_chunk)
        return _linear(self.head, self.ln_f(x), self.row_chunk)

