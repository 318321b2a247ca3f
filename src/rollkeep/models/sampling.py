"""Sampling for the built-in engine, and greedy decoding for evaluation.

Reproducibility (docs/design.md §2, §7): a sampled token is a pure function of its logits row,
the request's seed and the token's position in the completion. Nothing here reads a
global RNG, and each row is computed only from its own logits row, so the result does not
depend on what else was in the batch. Two values are part of that contract and must never
change, or regenerated rollouts stop reproducing the lost ones: the formula of
`counter_uniform` (tests pin values of it) and the inverse-CDF rule of `sample`.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch
from torch.nn import functional as F

from .gpt import GPT
from .tokenizer import EOS

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment, 2**64 / golden ratio


def _mix64(z: int) -> int:
    """splitmix64's finaliser (Stafford's "Mix13"), on Python ints masked to 64 bits."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def counter_uniform(seeds: Sequence[int], position: int | Sequence[int]) -> torch.Tensor:
    """A uniform number in [0, 1) per seed, a pure function of (seed, position).

    The formula (part of reproducibility; never change it):

        state = mix64(seed mod 2**64)
        z     = mix64((state + (position + 1) * 0x9E3779B97F4A7C15) mod 2**64)
        u     = (z >> 11) / 2**53

    i.e. the output number `position` of a splitmix64 generator whose state starts at
    mix64(seed); `mix64` is splitmix64's finaliser. Mixing the seed first keeps
    (seed, position) and (seed + increment, position - 1) from colliding. The top 53 bits
    make u an exact float64 in [0, 1).

    `position` is one int for every seed, or one per seed (rows continuing prefixes of
    different lengths sit at different completion positions); either way row b's number
    depends only on (seeds[b], its position). Returns float64 [B].
    """
    positions = _positions(position, len(seeds))
    out = [
        (_mix64((_mix64(int(s) & _MASK64) + (((p + 1) * _GOLDEN) & _MASK64)) & _MASK64) >> 11) / 2.0**53
        for s, p in zip(seeds, positions, strict=True)
    ]
    return torch.tensor(out, dtype=torch.float64)


def _positions(position: int | Sequence[int], n: int) -> list[int]:
    """`position` as one int per row: repeated if it is one int, checked if it is a list."""
    if isinstance(position, Integral):
        return [int(position)] * n
    positions = [int(p) for p in position]
    if len(positions) != n:
        raise ValueError(f"sampling: {len(positions)} positions for {n} rows")
    return positions


def sample(
    logits: torch.Tensor,
    seeds: Sequence[int],
    position: int | Sequence[int],
    *,
    temperature: float,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by nucleus sampling with counter-based randomness.

    logits (B, V) of any float dtype; seeds: B ints; position: the index of the token in
    its completion (0 for the first generated token), one int for all rows or one per row
    (a row continuing a prefix of k tokens samples its first new token at k). All math is
    float64:

        probs  = softmax(logits / temperature)
        sort probs descending (stable: ties keep vocabulary order); keep the smallest
        prefix whose cumulative mass is >= top_p (always at least one token)
        u      = counter_uniform(seeds, position)   (row b: its own position)
        token  = the first kept token (in sorted order) whose cumulative kept mass
                 exceeds u * (kept mass)  -- inverse CDF of the renormalised nucleus

    Returns (tokens int64 [B], logprobs float32 [B]). The log-probability is
    `log_softmax(logits / temperature)[token]` over the FULL vocabulary, not the truncated
    and renormalised nucleus: it is the same quantity the trainer computes from its own
    forward pass (log_softmax of its logits over the temperature), so the importance ratio
    of an untouched policy is exactly 1 even with top_p < 1.
    """
    if logits.dim() != 2 or logits.size(0) != len(seeds):
        raise ValueError(f"sample: logits {tuple(logits.shape)} do not match {len(seeds)} seeds")
    positions = _positions(position, len(seeds))
    x = logits.to(torch.float64) / temperature  # (B, V)
    logp = F.log_softmax(x, dim=-1)  # (B, V): the reported log-probabilities
    probs = F.softmax(x, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # (B, V)
    cum = sorted_p.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass before each token
    keep = before < top_p  # the smallest prefix reaching top_p; token 0 always (top_p > 0)
    kept_cum = (sorted_p * keep).cumsum(dim=-1)  # (B, V), constant past the nucleus
    mass = kept_cum[:, -1:]  # (B, 1)
    u = counter_uniform(seeds, positions).unsqueeze(1)  # (B, 1)
    idx = (kept_cum <= u * mass).sum(dim=-1, keepdim=True)  # first index with kept_cum > u * mass
    # u * mass can round up to mass itself: fall back to the last kept token of non-zero mass.
    last = (keep & (sorted_p > 0)).sum(dim=-1, keepdim=True) - 1
    idx = torch.minimum(idx, last)
    tokens = order.gather(1, idx)  # (B, 1)
    return tokens.squeeze(1), logp.gather(1, tokens).squeeze(1).to(torch.float32)


def greedy(model: GPT, tokenizer, prompts: list[str], *, max_new_tokens: int) -> list[str]:
    """Argmax decoding with the KV cache; prompts of equal token length run as one batch.

    Returns the decoded completion of each prompt, in order (EOS ends it and is not part
    of the text). A completion also ends where prompt + completion would exceed
    `block_size`. Runs in the model's own dtype and mode is restored afterwards."""
    ids = greedy_ids(model, [tokenizer.encode(p) for p in prompts], max_new_tokens=max_new_tokens)
    return [tokenizer.decode(x) for x in ids]


def greedy_ids(model: GPT, contexts: Sequence[Sequence[int]], *,
               max_new_tokens: int | Sequence[int]) -> list[list[int]]:
    """Argmax continuation of token-id contexts (a prompt, or a multi-turn trajectory so
    far) with the KV cache; contexts of equal length and budget run as one batch.

    `max_new_tokens`: one bound for all, or one per context. Returns each context's new
    ids, in order: up to and including the first EOS, at most its bound, and never past
    `block_size` (context + new ids fit it; no room: no ids). Runs in the model's own dtype
    and mode is restored afterwards."""
    block = model.cfg.block_size
    budgets = _positions(max_new_tokens, len(contexts))  # one int per context
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (ctx, budget) in enumerate(zip(contexts, budgets, strict=True)):
        n_new = min(budget, block - len(ctx))
        if n_new > 0 and len(ctx) > 0:  # else no room (or no context) for a single token
            groups.setdefault((len(ctx), n_new), []).append(i)
    out_ids: list[list[int]] = [[] for _ in contexts]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for (_, n_new), members in groups.items():
                rows = members if len(members) > 1 else members * 2  # see TorchEngine: B=1 kernels differ
                device = next(model.parameters()).device
                x = torch.tensor([list(contexts[i]) for i in rows], dtype=torch.long, device=device)  # (B, P)
                cache = model.new_cache()
                out = torch.empty(len(rows), n_new, dtype=torch.long, device=device)
                done = torch.zeros(len(rows), dtype=torch.bool, device=device)
                start = 0
                for step in range(n_new):
                    logits = model(x, cache, start)[:, -1, :]  # (B, V)
                    nxt = logits.argmax(dim=-1)  # (B,)
                    out[:, step] = nxt
                    done |= nxt == EOS
                    if step + 1 == n_new or bool(done.all()):
                        out = out[:, : step + 1]
                        break
                    start += x.size(1)
                    x = nxt.unsqueeze(1)  # (B, 1)
                for i, ids in zip(members, out.tolist(), strict=False):
                    out_ids[i] = ids[: ids.index(EOS) + 1] if EOS in ids else ids  # rows that ended ran on
    finally:
        model.train(was_training)
    return out_ids
