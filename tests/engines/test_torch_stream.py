"""The torch engine streams its tokens and continues from a prefix.

Streaming: the chunks a generation reports, in order, are its new tokens, log-probs and
versions; they reach the loop as they are sampled and all before `generate` returns; a
cancelled row reports nothing more. Continuing: a request with `prefix=` the first k tokens
of a completion gives that completion again -- bitwise in the deterministic mode (float64,
pinned: the prefix's cache is rebuilt token by token), token for token in the default mode
(one prefill of prompt + prefix; log-probs equal to rounding, the difference is printed).
A prefix that already ends the completion is returned as is, without the model.

No test sleeps: the worker is held in a forward call by `Gate` (test_torch_engine), and
ordering comes from asyncio's FIFO scheduling of callbacks (`call_soon_threadsafe` from the
worker included)."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch
from test_torch_engine import BLOCKER, Gate, make_engine, no_eos, req, same

from rollkeep.core.rollout.generation import Chunk, Completion, GenRequest, Prefix
from rollkeep.engines.torch_gpt import TorchEngine
from rollkeep.models.sampling import counter_uniform, sample
from rollkeep.models.tokenizer import EOS, CharTokenizer

TOK = CharTokenizer()


def with_prefix(r: GenRequest, c: Completion, k: int) -> GenRequest:
    """`r` continuing from the first k tokens of `c`."""
    return msgspec.structs.replace(
        r, prefix=Prefix(c.completion_ids[:k].copy(), c.logprobs[:k].copy(), c.versions[:k].copy())
    )


def joined(chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not chunks:
        return np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32)
    return (
        np.concatenate([c.completion_ids for c in chunks]),
        np.concatenate([c.logprobs for c in chunks]),
        np.concatenate([c.versions for c in chunks]),
    )


class Forwards:
    """Records (batch rows, tokens, start) of every forward call after it is installed."""

    def __init__(self, gate: Gate) -> None:
        self.calls: list[tuple[int, int, int]] = []
        gate.pause(lambda idx, start: self.calls.append((idx.size(0), idx.size(1), start)) and False)

    def prefills(self) -> list[tuple[int, int]]:
        return [(b, t) for b, t, start in self.calls if start == 0]


async def together(engine: TorchEngine, gate: Gate, reqs: list[GenRequest], progress=None) -> list:
    """Queue all of `reqs` while the worker is held in a blocker request, then release it:
    the batches it forms then are set by the queue alone (oldest first, grouped by prefill
    length). `progress`: one list per request that collects its chunks; each entry of the
    result is (completion, the chunks seen when `generate` returned)."""
    p = gate.pause(lambda idx, start: idx.size(1) == len(BLOCKER) + 1)
    blocker = asyncio.create_task(engine.generate(req(BLOCKER, 999)))
    await asyncio.to_thread(p.entered.wait)

    async def one(i: int, r: GenRequest):
        if progress is None:
            return await engine.generate(r)
        c = await engine.generate(r, progress[i].append)
        return c, list(progress[i])

    tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(reqs)]
    asyncio.get_running_loop().call_soon(p.release.set)  # after every task queued its request
    out = await asyncio.gather(*tasks)
    await blocker
    return out


def test_the_engine_streams():
    assert TorchEngine.streams is True


# ====================================================================== sampling positions


def test_sample_takes_one_position_per_row_and_keeps_the_one_position_form():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 50, generator=g, dtype=torch.float64) * 2
    seeds = [11 * i + 5 for i in range(9)]
    positions = [0, 3, 3, 7, 1, 0, 12, 5, 2]
    toks, lps = sample(logits, seeds, positions, temperature=0.8, top_p=0.95)
    for b in range(9):  # row b: its own seed and position only
        t, lp = sample(logits[b : b + 1], seeds[b : b + 1], positions[b], temperature=0.8, top_p=0.95)
        assert (t.item(), lp.item()) == (toks[b].item(), lps[b].item())
    same_pos = sample(logits, seeds, [4] * 9, temperature=0.8, top_p=0.95)
    one_pos = sample(logits, seeds, 4, temperature=0.8, top_p=0.95)
    assert torch.equal(same_pos[0], one_pos[0]) and torch.equal(same_pos[1], one_pos[1])
    assert torch.equal(counter_uniform(seeds, [4] * 9), counter_uniform(seeds, 4))
    assert counter_uniform([0], [0]).item() == 0.8833108082136426  # the pinned value
    with pytest.raises(ValueError, match="positions"):
        sample(logits, seeds, [0, 1], temperature=0.8, top_p=0.95)


# ====================================================================== streaming


def test_chunks_are_the_new_tokens_in_order_and_all_arrive_before_generate_returns():
    fresh = [req("12+34=", s) for s in (1, 2, 3)] + [req("1+2=", 4), req("123+456=", 5)]

    async def main():
        engine = make_engine(max_new_tokens=30)
        gate = Gate(engine)
        try:
            base = await together(engine, gate, fresh)
            resumed = [with_prefix(fresh[0], base[0], 2), with_prefix(fresh[3], base[3], 1),
                       with_prefix(msgspec.structs.replace(fresh[1], pinned_version=0), base[1], 3)]
            reqs = fresh + resumed
            chunks: list[list[Chunk]] = [[] for _ in reqs]
            out = await together(engine, gate, reqs, chunks)
        finally:
            await engine.close()
        return base, resumed, out, chunks

    base, resumed, out, chunks = asyncio.run(main())
    ks = [0] * len(fresh) + [len(r.prefix) for r in resumed]
    for (c, seen), final, k in zip(out, chunks, ks, strict=True):
        assert seen == final  # every chunk arrived before generate returned, none after
        assert all(len(ch) == 1 for ch in final)
        assert all(ch.completion_ids.dtype == np.int32 and ch.logprobs.dtype == np.float32
                   and ch.versions.dtype == np.int32 for ch in final)
        ids, lps, vs = joined(final)
        assert len(ids) == len(c.completion_ids) - k >= 1  # never a chunk for the prefix's tokens
        assert np.array_equal(ids, c.completion_ids[k:])
        assert lps.tobytes() == c.logprobs[k:].tobytes()
        assert np.array_equal(vs, c.versions[k:])
    for (c, _), b in zip(out[: len(fresh)], base, strict=True):  # streaming changes nothing
        assert same(c, b)


def test_chunks_reach_the_loop_while_the_row_is_still_generating():
    P = len("12+34=") + 1

    async def main():
        engine = make_engine(max_new_tokens=10)
        gate = Gate(engine, edit=no_eos)
        chunks: list[Chunk] = []
        try:
            p = gate.pause(lambda idx, start: start == P + 1)  # the 2nd decode step: 2 tokens sampled
            task = asyncio.create_task(engine.generate(req("12+34=", 7), chunks.append))
            # The worker scheduled both chunks before it entered the forward, and so before
            # the to_thread result: the loop has run them by the time this returns.
            await asyncio.to_thread(p.entered.wait)
            while_held = len(chunks)
            p.release.set()
            c = await task
        finally:
            await engine.close()
        return while_held, chunks, c

    while_held, chunks, c = asyncio.run(main())
    assert while_held == 2
    assert len(chunks) == len(c.completion_ids) == 10
    assert np.array_equal(joined(chunks)[0], c.completion_ids)


def test_a_cancelled_row_reports_nothing_more():
    P = len("12+34=") + 1

    async def main():
        engine = make_engine(max_new_tokens=12)
        gate = Gate(engine, edit=no_eos)
        loop = asyncio.get_running_loop()
        doomed_chunks: list[Chunk] = []
        other_chunks: list[Chunk] = []
        try:
            full = await engine.generate(req("12+34=", 7))
            p = gate.pause(lambda idx, start: start == P + 2)  # the 3rd decode step
            doomed = asyncio.create_task(engine.generate(req("12+34=", 7), doomed_chunks.append))
            other = asyncio.create_task(engine.generate(req("12+34=", 8), other_chunks.append))
            await asyncio.to_thread(p.entered.wait)
            at_cancel = len(doomed_chunks)
            doomed.cancel()
            loop.call_soon(p.release.set)  # after the cancellation reached the request's future
            with pytest.raises(asyncio.CancelledError):
                await doomed
            c = await other
        finally:
            await engine.close()  # the worker is done: nothing can come later
        return full, at_cancel, doomed_chunks, other_chunks, c

    full, at_cancel, doomed_chunks, other_chunks, c = asyncio.run(main())
    assert at_cancel == 3
    assert len(doomed_chunks) == 3  # nothing after the cancel
    ids, lps, _ = joined(doomed_chunks)
    assert np.array_equal(ids, full.completion_ids[:3]) and lps.tobytes() == full.logprobs[:3].tobytes()
    assert np.array_equal(joined(other_chunks)[0], c.completion_ids) and len(c.completion_ids) == 12


# ====================================================================== deterministic mode


def cut_points(n: int) -> list[int]:
    return sorted({1, n // 2, n - 1} - {0})


# float64 is how the deterministic mode runs. There, a one-pass prefill of prompt + prefix
# differs from token-by-token decoding only in the last float64 bits, which the float32
# log-probs almost never keep; in float32 the difference shows (~5e-7, the default-mode
# test), so the float32 case checks the token-by-token rebuild bit for bit.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_deterministic_resume_equals_the_uninterrupted_completion_bitwise(dtype):
    prompts = ["12+34="] * 6 + ["9+9=", "9+8=", "77+1234="]
    fresh = [req(p, 300 + i, version=0, gid=f"g{i}") for i, p in enumerate(prompts)]

    async def main():
        engine = make_engine(dtype=dtype, max_new_tokens=40)
        gate = Gate(engine)
        try:
            base = await together(engine, gate, fresh)
            alone = []  # each continuation in a batch of its own
            for r, c in zip(fresh, base, strict=True):
                for k in cut_points(len(c.completion_ids)):
                    alone.append((r, k, await engine.generate(with_prefix(r, c, k))))
            # every cut point of every request in flight at once, with the fresh requests
            # again; the requests of one prompt length share one batch whatever their prefix
            resumed = [(i, k) for i, c in enumerate(base) for k in cut_points(len(c.completion_ids))]
            reqs = [with_prefix(fresh[i], base[i], k) for i, k in resumed] + fresh
            forwards = Forwards(gate)
            mixed = await together(engine, gate, reqs)
        finally:
            await engine.close()
        return base, alone, resumed, mixed, forwards

    base, alone, resumed, mixed, forwards = asyncio.run(main())
    assert {c.finish_reason for c in base} == {"stop", "length"}  # both ways of ending are covered
    assert all(len(c.completion_ids) >= 3 for c in base)
    by_gid = {r.group_id: c for r, c in zip(fresh, base, strict=True)}
    for r, _k, c in alone:
        assert same(c, by_gid[r.group_id])
    for (i, _k), c in zip(resumed, mixed[: len(resumed)], strict=True):
        assert same(c, base[i])  # prompt, tokens, log-probs (bitwise), versions, reason, text
    for c, b in zip(mixed[len(resumed):], base, strict=True):
        assert same(c, b)
    # pinned prefixes are fed token by token: every prefill is of a prompt alone, and the
    # 12+34= rows (six fresh, their continuations) ran as one batch
    n_long = 6 + sum(1 for i, _ in resumed if i < 6)
    prefills = forwards.prefills()
    assert {t for _, t in prefills} == {len(BLOCKER) + 1, 7, 5, 9}
    assert (n_long + (-n_long % 4), 7) in prefills


# ====================================================================== default mode


def test_default_mode_resume_gives_the_same_tokens_and_logprobs_to_rounding():
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 30), range(50, 70), strict=True)]  # 20 requests
    fresh = [req(p, 700 + i, gid=f"d{i}") for i, p in enumerate(prompts)]

    async def main():
        engine = make_engine(dtype=torch.float32, max_new_tokens=40)
        gate = Gate(engine)
        try:
            base = await together(engine, gate, fresh)
            resumed = [(i, k) for i, c in enumerate(base) for k in cut_points(len(c.completion_ids))]
            forwards = Forwards(gate)
            out = await together(engine, gate, [with_prefix(fresh[i], base[i], k) for i, k in resumed] + fresh[:4])
        finally:
            await engine.close()
        return base, resumed, out, forwards

    base, resumed, out, forwards = asyncio.run(main())
    worst = 0.0
    for (i, k), c in zip(resumed, out[: len(resumed)], strict=True):
        b = base[i]
        assert np.array_equal(c.prompt_ids, b.prompt_ids)
        assert np.array_equal(c.completion_ids, b.completion_ids)
        assert np.array_equal(c.versions, b.versions)
        assert (c.finish_reason, c.text) == (b.finish_reason, b.text)
        assert c.logprobs[:k].tobytes() == b.logprobs[:k].tobytes()  # the prefix's, as given
        worst = max(worst, float(np.abs(c.logprobs[k:].astype(np.float64) - b.logprobs[k:]).max()))
    for c, b in zip(out[len(resumed):], base[:4], strict=True):
        assert same(c, b)
    print(f"\nfloat32 default-mode resume: max |continuation logprob - uninterrupted| = {worst:.3g} "
          f"over {len(resumed)} continuations of {len(base)} requests")
    assert worst < 1e-4
    # the default mode prefills prompt + prefix in one pass
    lengths = {t for _, t in forwards.prefills()}
    assert all(len(base[i].prompt_ids) + k in lengths for i, k in resumed)


# ====================================================================== prefixes that already end


def test_a_prefix_that_already_ends_the_completion_is_returned_as_is():
    eos_prefix = Prefix(np.array([15, 16, EOS], np.int32), np.array([-1.5, -0.25, -3.0], np.float32),
                        np.array([4, 4, 5], np.int32))
    full = Prefix(np.arange(10, 16, dtype=np.int32), np.linspace(-2, -1, 6).astype(np.float32), np.full(6, 3, np.int32))
    near_end = Prefix(np.full(3, 20, np.int32), np.full(3, -0.5, np.float32), np.zeros(3, np.int32))

    async def main():
        engine = make_engine(max_new_tokens=6)
        gate = Gate(engine)
        chunks: list[Chunk] = []
        try:
            out = []
            for version in (None, 0):
                for text, prefix in [("1+1=", eos_prefix), ("1+1=", full), ("9" * 60, near_end)]:
                    r = msgspec.structs.replace(req(text, 1, version=version), prefix=prefix)
                    out.append((prefix, await engine.generate(r, chunks.append)))
        finally:
            await engine.close()
        return out, gate.sizes, chunks

    out, sizes, chunks = asyncio.run(main())
    assert sizes == [] and chunks == []  # no model call, nothing streamed
    for n, (prefix, c) in enumerate(out):
        assert np.array_equal(c.completion_ids, prefix.completion_ids)
        assert c.logprobs.tobytes() == prefix.logprobs.tobytes()
        assert np.array_equal(c.versions, prefix.versions)
        assert c.text == TOK.decode(prefix.completion_ids)
        # EOS: stop; 6 = max_new_tokens; 3 = what block_size leaves after 61 prompt tokens
        assert c.finish_reason == ("stop" if n % 3 == 0 else "length")
    assert out[2][1].prompt_ids.tolist() == TOK.encode("9" * 60)


def test_a_continuation_keeps_the_prefix_versions_and_stamps_its_own():
    prefix = Prefix(np.array([15, 16], np.int32), np.array([-1.5, -0.25], np.float32), np.array([7, 8], np.int32))

    async def main():
        engine = make_engine(max_new_tokens=6)
        Gate(engine, edit=no_eos)
        chunks: list[Chunk] = []
        try:
            c = await engine.generate(msgspec.structs.replace(req("1+1=", 1), prefix=prefix), chunks.append)
            with pytest.raises(ValueError, match="2 tokens, 1 log-probs"):
                await engine.generate(msgspec.structs.replace(
                    req("1+1=", 1), prefix=Prefix(prefix.completion_ids, prefix.logprobs[:1], prefix.versions)))
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await engine.generate(msgspec.structs.replace(
                    req("1+1=", 1), prefix=Prefix(np.array([10_000], np.int32), prefix.logprobs[:1], prefix.versions[:1])))
        finally:
            await engine.close()
        return c, chunks

    c, chunks = asyncio.run(main())
    assert c.finish_reason == "length" and len(c.completion_ids) == 6  # the budget counts the prefix
    assert c.completion_ids[:2].tolist() == [15, 16] and c.logprobs[:2].tobytes() == prefix.logprobs.tobytes()
    assert c.versions.tolist() == [7, 8, 0, 0, 0, 0]
    assert c.prompt_ids.tolist() == TOK.encode("1+1=")  # the real prompt, not prompt + prefix
    assert c.text == TOK.decode(c.completion_ids)
    assert len(chunks) == 4 and np.array_equal(joined(chunks)[0], c.completion_ids[2:])
