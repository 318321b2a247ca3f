"""The built-in torch engine and its sampling: counter-based randomness, nucleus sampling,
reproducibility of a request whatever shares its batch, KV-cache correctness, stopping,
cancellation, failure isolation, weight updates when idle and in flight (a newer one
superseding a queued one), and close().

No test sleeps: ordering comes from a forward hook that blocks the worker thread on a
`threading.Event` (`Gate`), from `asyncio.to_thread(event.wait)`, and from asyncio's
FIFO scheduling of callbacks (`loop.call_soon` runs after tasks created before it took
their first step, i.e. queued their request)."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rollkeep.core.custody.keys import Key
from rollkeep.core.errors import CustodyError
from rollkeep.core.rollout.source import Prompt
from rollkeep.engines.base import Completion, DataError, GenRequest, InfraError
from rollkeep.engines.torch_gpt import TorchEngine
from rollkeep.models.gpt import GPT, ROW_CHUNK, GPTConfig
from rollkeep.models.sampling import counter_uniform, greedy, sample
from rollkeep.models.tokenizer import EOS, CharTokenizer

TOK = CharTokenizer()


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=TOK.vocab_size, n_layer=2, n_head=4, n_embd=64, block_size=64))


def make_engine(model: GPT | None = None, **kw) -> TorchEngine:
    args = dict(temperature=1.0, top_p=1.0, max_new_tokens=24, max_batch_size=64, update_weights_in_flight=False)
    args.update(kw)
    return TorchEngine(model=model if model is not None else make_model(), tokenizer=TOK, **args)


def req(text: str, seed: int, *, version: int | None = None, gid: str = "e0.0", generation: int = 0) -> GenRequest:
    prompt = Prompt(key=Key(0, 0), group_id=gid, idx=0, task="default", row={}, row_fingerprint=0, prompt=text)
    return GenRequest(group_id=gid, generation=generation, attempt=0, prompt=prompt, seed=seed, pinned_version=version)


def same(a: Completion, b: Completion) -> bool:
    """Bitwise equal completions."""
    return (
        np.array_equal(a.prompt_ids, b.prompt_ids)
        and np.array_equal(a.completion_ids, b.completion_ids)
        and a.logprobs.tobytes() == b.logprobs.tobytes()
        and np.array_equal(a.versions, b.versions)
        and a.finish_reason == b.finish_reason
        and a.text == b.text
    )


class Pause:
    """Blocks the worker inside the first forward call for which `when(idx, start)` holds,
    until `release` is set; `entered` is set once it is blocked there."""

    def __init__(self, when: Callable[[torch.Tensor, int], bool]) -> None:
        self.when = when
        self.entered = threading.Event()
        self.release = threading.Event()


class Gate:
    """Wraps the engine model's forward: records each call's batch size, can block the
    worker at chosen calls (`pause`), fail every call (`raise_error`), and change the
    logits a call returns (`edit`, e.g. to force or forbid EOS)."""

    def __init__(self, engine: TorchEngine, *, edit: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.sizes: list[int] = []
        self.edit = edit
        self.raise_error = False
        self._pauses: list[Pause] = []
        self._orig = engine.model.forward
        engine.model.forward = self._forward

    def pause(self, when: Callable[[torch.Tensor, int], bool]) -> Pause:
        p = Pause(when)
        self._pauses.append(p)
        return p

    def _forward(self, idx, cache=None, start=0):
        self.sizes.append(idx.size(0))
        for p in list(self._pauses):
            if p.when(idx, start):
                self._pauses.remove(p)
                p.entered.set()
                p.release.wait()
        if self.raise_error:
            raise RuntimeError("boom: injected forward failure")
        logits = self._orig(idx, cache, start)
        return logits if self.edit is None else self.edit(logits)


def no_eos(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.clone()
    logits[..., EOS] = float("-inf")
    return logits


BLOCKER = "#" * 40  # 41 tokens with BOS: a prompt length no other test prompt has


async def generate_together(engine: TorchEngine, gate: Gate, reqs: list[GenRequest]) -> list:
    """Queue all of `reqs` while the worker is blocked in a blocker request, then release:
    the batches the worker forms afterwards are determined by the queue alone (oldest
    first, grouped by prompt length)."""
    p = gate.pause(lambda idx, start: idx.size(1) == len(BLOCKER) + 1)
    blocker = asyncio.create_task(engine.generate(req(BLOCKER, 999)))
    await asyncio.to_thread(p.entered.wait)
    tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
    asyncio.get_running_loop().call_soon(p.release.set)  # after every task queued its request
    out = await asyncio.gather(*tasks, return_exceptions=True)
    await blocker
    return out


# ====================================================================== counter_uniform


def test_counter_uniform_is_a_pure_function_in_unit_interval():
    seeds = list(range(500)) + [2**64 - 1, 2**63, 12345678901234567890]
    a = counter_uniform(seeds, 3)
    assert a.dtype == torch.float64 and a.shape == (len(seeds),)
    assert torch.equal(a, counter_uniform(seeds, 3))
    assert bool(((a >= 0) & (a < 1)).all())
    assert len(set(a.tolist())) == len(seeds)  # differs across seeds
    assert not torch.equal(a, counter_uniform(seeds, 4))  # and across positions
    b = torch.stack([counter_uniform(seeds[:50], p) for p in range(50)])
    assert len(set(b.flatten().tolist())) == 2500
    assert 0.45 < float(a.mean()) < 0.55


def test_counter_uniform_pinned_values():
    # Changing these values (the formula) breaks reproducibility of regenerated rollouts:
    # a sibling lost in a crash would no longer be sampled the same way again.
    # Seed 0, position 0 is the first output of the reference splitmix64 seeded with 0
    # (mix64(0) = 0): 0xE220A8397B1DCDAF >> 11 / 2**53.
    assert counter_uniform([0], 0).item() == (0xE220A8397B1DCDAF >> 11) / 2**53 == 0.8833108082136426
    assert counter_uniform([12345678901234567890], 7).item() == 0.7316497124911497


# ====================================================================== sample


def _seed_with_u(lo: float, hi: float, position: int = 0) -> int:
    return next(s for s in range(10_000) if lo <= counter_uniform([s], position).item() < hi)


def test_sample_inverse_cdf_by_hand():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    # sorted: token 0 (0.5), token 1 (0.3), token 2 (0.2); cumulative 0.5, 0.8, 1.0
    for lo, hi, expected in [(0.0, 0.5, 0), (0.5, 0.8, 1), (0.8, 1.0, 2)]:
        seed = _seed_with_u(lo + 0.01, hi - 0.01)
        tok, lp = sample(logits, [seed], 0, temperature=1.0, top_p=1.0)
        assert tok.tolist() == [expected]
        assert lp.dtype == torch.float32
        assert lp.item() == pytest.approx(math.log([0.5, 0.3, 0.2][expected]), abs=1e-6)
    # ties keep vocabulary order (stable sort): uniform over 4 tokens picks floor(4u)
    seeds = list(range(200))
    toks, _ = sample(torch.zeros(200, 4), seeds, 0, temperature=1.0, top_p=1.0)
    assert torch.equal(toks, (counter_uniform(seeds, 0) * 4).floor().long())
    # the order of the vocabulary does not matter: sorting is by probability
    perm = torch.tensor([[math.log(0.2), math.log(0.5), math.log(0.3)]])
    seed = _seed_with_u(0.81, 0.99)
    assert sample(perm, [seed], 0, temperature=1.0, top_p=1.0)[0].tolist() == [0]


def test_sample_top_p_excludes_the_tail_and_reports_the_full_distribution_logprob():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    seeds = list(range(400))
    toks, lps = sample(logits.expand(400, 3), seeds, 0, temperature=1.0, top_p=0.6)
    assert set(toks.tolist()) == {0, 1}  # 0.5 < 0.6, so the nucleus is {0, 1}; token 2 never
    # renormalised nucleus: P(0) = 0.5 / 0.8; inverse CDF picks token 1 iff u >= 0.625
    u = counter_uniform(seeds, 0)
    assert torch.equal(toks, (u >= 0.625).long())
    full = F.log_softmax(logits.double(), dim=-1)[0]
    assert torch.equal(lps, full[toks].float())  # log-prob over the FULL vocabulary
    toks, _ = sample(logits.expand(400, 3), seeds, 0, temperature=1.0, top_p=0.45)
    assert set(toks.tolist()) == {0}  # at least one token is always kept


def test_sample_temperature_and_row_independence():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(33, 98, generator=g, dtype=torch.float32) * 3
    seeds = [7 * i + 1 for i in range(33)]
    toks, lps = sample(logits, seeds, 5, temperature=0.7, top_p=0.9)
    expected = F.log_softmax(logits.double() / 0.7, dim=-1).gather(1, toks[:, None]).squeeze(1).float()
    assert torch.equal(lps, expected)
    for i in (0, 17, 32):  # each row depends only on its own logits, seed and position
        t, lp = sample(logits[i : i + 1], seeds[i : i + 1], 5, temperature=0.7, top_p=0.9)
        assert t.item() == toks[i].item() and lp.item() == lps[i].item()
    assert not torch.equal(toks, sample(logits, seeds, 6, temperature=0.7, top_p=0.9)[0])


def test_greedy_matches_uncached_argmax():
    model = make_model().eval()
    prompts = ["12+34=", "9+9=", "12+35=", "x"]
    texts = greedy(model, TOK, prompts, max_new_tokens=6)
    for p, text in zip(prompts, texts, strict=True):
        ids = TOK.encode(p)
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
                ids.append(nxt)
                if nxt == EOS:
                    break
        assert text == TOK.decode(ids[len(TOK.encode(p)) :])


# ====================================================================== reproducibility


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_same_request_same_completion_whatever_shares_the_batch(dtype, threads):
    target = req("12+34=", 4242)  # 7 tokens with BOS
    same_len = [req(f"{a:02d}+{b:02d}=", 100 + a) for a, b in zip(range(10, 40), range(40, 70), strict=True)]
    other_len = [req("1+2=", 7), req("123+456=", 8), req("5+5=", 9), req("77+8=", 10), req("1234+1=", 11)]

    async def main():
        engine = make_engine(dtype=dtype, max_new_tokens=40)
        gate = Gate(engine)
        try:
            alone = (await generate_together(engine, gate, [target]))[0]
            sizes_alone = gate.sizes[-1]
            in4 = await generate_together(engine, gate, [same_len[0], same_len[1], target, same_len[2]])
            in20 = await generate_together(engine, gate, [*same_len[:17], target, *same_len[17:19]])
            mixed = await generate_together(
                engine, gate, [other_len[0], same_len[3], other_len[1], same_len[4], other_len[2],
                               target, other_len[3], same_len[5], other_len[4], same_len[6]])
            small = make_engine(dtype=dtype, max_new_tokens=40, max_batch_size=3)  # splits the queue
            try:
                split = await generate_together(small, Gate(small), [same_len[7], *other_len, same_len[8], target])
            finally:
                await small.close()
        finally:
            await engine.close()
        return alone, sizes_alone, in4, in20, mixed, split

    alone, sizes_alone, in4, in20, mixed, split = asyncio.run(main())
    assert sizes_alone == 4  # a batch of one runs padded to 4 rows
    assert len(alone.completion_ids) > 10
    assert same(alone, in4[2])
    assert same(alone, in20[17])
    assert same(alone, mixed[5])
    assert same(alone, split[-1])
    # the batch shrank as rows stopped: the reproducibility covers rows leaving too
    assert {c.finish_reason for c in in20} == {"stop", "length"}
    # and the other rows are reproducible too
    assert same(in4[0], in20[0]) and same(in4[1], in20[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_the_engine_model_gives_a_row_the_same_logits_bits_whatever_the_batch_size(dtype, threads):
    # The op level under the test above: MKL picks its matmul kernel by row count (on
    # AVX-512 the bits change below 11-16 rows, not only for counts that are not multiples of
    # 4), so the engine's model runs its linear layers in fixed-size calls (GPT.row_chunk).
    # On AMD EPYC (float64) the attention's batched matmuls gave row 0 other bits at B = 2
    # than at B = 1 while q, k and v were strided views (passed as they were at B = 1, copied
    # at B > 1): the model copies them into their own memory at every B.
    model = make_model().to(dtype).eval()
    model.row_chunk = ROW_CHUNK
    torch.manual_seed(1)
    target = torch.tensor(TOK.encode("12+34="))  # 7 tokens
    others = torch.randint(4, TOK.vocab_size, (63, 7))
    steps = torch.randint(4, TOK.vocab_size, (4, 64))  # decode inputs; row 0's are the same for every B

    def row0(B: int) -> torch.Tensor:
        x = torch.cat([target[None], others[: B - 1]])
        cache, start, out = model.new_cache(), 0, []
        with torch.inference_mode():
            for s in range(len(steps) + 1):
                out.append(model(x, cache, start)[0, -1])
                start += x.size(1)
                x = steps[s, :B, None] if s < len(steps) else None
        return torch.stack(out)

    alone = row0(1)
    for B in [*range(2, 25), 33, 40, 64]:  # past ROW_CHUNK rows the calls are split
        assert row0(B).numpy().tobytes() == alone.numpy().tobytes(), B
    with torch.inference_mode():  # the chunked layers compute the same function
        model.row_chunk = None
        x = torch.cat([target[None], others[:20]])
        plain = model(x)[0, -1]
    torch.testing.assert_close(alone[0], plain, rtol=0, atol=1e-5)


# ====================================================================== KV cache, stopping


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_logprobs_match_an_uncached_forward(dtype):
    model = make_model()
    T = 0.7

    async def main():
        engine = make_engine(model, dtype=dtype, temperature=T, max_new_tokens=40)
        Gate(engine, edit=no_eos)
        try:
            return await engine.generate(req("12+34=", 3))
        finally:
            await engine.close()

    c = asyncio.run(main())
    assert len(c.completion_ids) == 40 and c.finish_reason == "length"
    ids = torch.tensor([np.concatenate([c.prompt_ids, c.completion_ids]).tolist()])
    P = len(c.prompt_ids)
    with torch.no_grad():
        logits = model.to(dtype)(ids[:, :-1])[0, P - 1 :]  # (C, V): predicts each completion token
    logits[:, EOS] = float("-inf")  # what the engine saw
    expected = F.log_softmax(logits.double() / T, dim=-1).gather(1, ids[0, P:, None]).squeeze(1)
    np.testing.assert_allclose(c.logprobs, expected.numpy(), rtol=0, atol=1e-5)


def test_eos_stops_and_is_part_of_the_completion_but_not_the_text():
    calls = []

    def force_eos_on_third(logits: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        logits = logits.clone()
        logits[..., EOS] = 1e4 if len(calls) == 3 else float("-inf")
        return logits

    async def main():
        engine = make_engine()
        Gate(engine, edit=force_eos_on_third)
        try:
            return await engine.generate(req("12+34=", 1))
        finally:
            await engine.close()

    c = asyncio.run(main())
    assert c.finish_reason == "stop"
    assert len(c.completion_ids) == 3 and c.completion_ids[-1] == EOS
    assert c.completion_ids.dtype == np.int32 and c.prompt_ids.dtype == np.int32
    assert c.logprobs.dtype == np.float32 and c.versions.dtype == np.int32
    assert c.logprobs[-1] == 0.0
    assert c.text == TOK.decode(c.completion_ids[:2]) and len(c.text) == 2
    assert c.prompt_ids.tolist() == TOK.encode("12+34=")


def test_length_limits_max_new_tokens_and_block_size():
    async def main():
        engine = make_engine(max_new_tokens=5)
        Gate(engine, edit=no_eos)
        try:
            short = await engine.generate(req("1+1=", 1))
            near_end = await engine.generate(req("9" * 60, 2))  # 61 tokens: room for 3 in 64
            with pytest.raises(DataError, match="no room"):
                await engine.generate(req("9" * 63, 3))
            return short, near_end
        finally:
            await engine.close()

    short, near_end = asyncio.run(main())
    assert (len(short.completion_ids), short.finish_reason) == (5, "length")
    assert (len(near_end.completion_ids), near_end.finish_reason) == (3, "length")


# ====================================================================== failures


def test_cancelling_requests_drops_their_rows_and_leaves_the_others_untouched():
    reqs = [req(f"{10 + i}+{20 + i}=", 50 + i, generation=i) for i in range(8)]  # 7 tokens each
    cancelled = {1, 2, 4, 5, 6}

    async def uncancelled():
        engine = make_engine(max_new_tokens=12)
        try:
            return await generate_together(engine, Gate(engine, edit=no_eos), reqs)
        finally:
            await engine.close()

    async def with_cancel():
        engine = make_engine(max_new_tokens=12)
        gate = Gate(engine, edit=no_eos)
        loop = asyncio.get_running_loop()
        try:
            pb = gate.pause(lambda idx, start: idx.size(1) == len(BLOCKER) + 1)
            blocker = asyncio.create_task(engine.generate(req(BLOCKER, 999)))
            await asyncio.to_thread(pb.entered.wait)
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            pc = gate.pause(lambda idx, start: start == 8)  # the 2nd decode step of the 8-row batch
            loop.call_soon(pb.release.set)
            await asyncio.to_thread(pc.entered.wait)
            for i in cancelled:
                tasks[i].cancel()
            loop.call_soon(pc.release.set)  # after the cancelled tasks marked their requests
            out = await asyncio.gather(*tasks, return_exceptions=True)
            await blocker
            return out, gate.sizes[-12:]  # our batch: prefill + 11 decode steps
        finally:
            await engine.close()

    full = asyncio.run(uncancelled())
    out, sizes = asyncio.run(with_cancel())
    for i, c in enumerate(out):
        if i in cancelled:
            assert isinstance(c, asyncio.CancelledError)
        else:
            assert same(c, full[i])
    # 8 rows for the prefill and the 1st and 2nd decode steps; then 3 live rows padded to 4
    assert sizes == [8, 8, 8] + [4] * 9


def test_a_failing_batch_fails_its_requests_and_the_engine_keeps_serving():
    async def main():
        engine = make_engine(max_new_tokens=4)
        gate = Gate(engine)
        try:
            gate.raise_error = True
            failed = await asyncio.gather(*(engine.generate(req(t, i)) for i, t in enumerate(["1+2=", "3+4=", "5+66="])),
                                          return_exceptions=True)
            gate.raise_error = False
            ok = await engine.generate(req("1+2=", 1))
            return failed, ok, engine._thread.is_alive()
        finally:
            await engine.close()

    gate_failures, ok, alive = asyncio.run(main())
    assert all(isinstance(e, InfraError) and "boom" in str(e) for e in gate_failures)
    assert isinstance(ok, Completion) and len(ok.completion_ids) >= 1
    assert alive


def test_pinned_request_at_another_version_fails_as_a_controller_bug():
    async def main():
        engine = make_engine(max_new_tokens=4)
        try:
            ok = await engine.generate(req("1+2=", 1, version=0))
            with pytest.raises(CustodyError, match="bug in the controller") as err:
                await engine.generate(req("1+2=", 1, version=3))
            return ok, err.value
        finally:
            await engine.close()

    ok, err = asyncio.run(main())
    assert ok.versions.tolist() == [0] * len(ok.versions)
    assert err.expected.startswith("version 3") and "version 0" in err.found


# ====================================================================== weights


def perturbed_state(model: GPT, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.05 * torch.randn(v.shape, generator=g)).clone() for k, v in model.state_dict().items()}


def test_update_weights_when_idle_changes_version_and_outputs_and_copies():
    model = make_model()
    new = perturbed_state(model)
    reference_model = make_model()
    reference_model.load_state_dict(new)

    async def main():
        engine = make_engine(model)
        reference = make_engine(reference_model)
        try:
            before = await engine.generate(req("12+34=", 5))
            await engine.update_weights(new, 1)
            assert engine.version == 1  # loaded before update_weights returned
            for t in new.values():  # the engine copied: the caller's snapshot is its own
                t.zero_()
            after = await engine.generate(req("12+34=", 5))
            expected = await reference.generate(req("12+34=", 5))
            return before, after, expected
        finally:
            await engine.close()
            await reference.close()

    before, after, expected = asyncio.run(main())
    assert before.versions.tolist() == [0] * len(before.versions)
    assert after.versions.tolist() == [1] * len(after.versions)
    assert not same(before, after)
    assert np.array_equal(after.completion_ids, expected.completion_ids)
    assert after.logprobs.tobytes() == expected.logprobs.tobytes()


def test_update_weights_rejects_a_mismatched_state_dict_and_changes_nothing():
    model = make_model()
    bad = dict(perturbed_state(model))
    bad.pop("ln_f.weight")

    async def main():
        engine = make_engine(model)
        try:
            with pytest.raises(Exception, match="do not fit"):
                await engine.update_weights(bad, 1)
            return engine.version, engine.model.ln_f.weight.clone()
        finally:
            await engine.close()

    version, w = asyncio.run(main())
    assert version == 0 and torch.equal(w, model.ln_f.weight)


@pytest.mark.parametrize("in_flight", [True, False], ids=["in_flight", "between_batches"])
def test_update_weights_while_a_batch_runs(in_flight):
    model = make_model()
    new = perturbed_state(model)
    N = 10

    async def main():
        engine = make_engine(model, max_new_tokens=N, update_weights_in_flight=in_flight)
        gate = Gate(engine, edit=no_eos)
        try:
            baseline = await engine.generate(req("12+34=", 8))
            p = gate.pause(lambda idx, start: start == 8)  # the 2nd decode step (3rd forward)
            task = asyncio.create_task(engine.generate(req("12+34=", 8)))
            await asyncio.to_thread(p.entered.wait)
            update = asyncio.create_task(engine.update_weights(new, 1))
            asyncio.get_running_loop().call_soon(p.release.set)  # after `update` stored it as pending
            await update
            version_after_update = engine.version
            c = await task
            later = await engine.generate(req("12+34=", 8))
            return baseline, c, later, version_after_update
        finally:
            await engine.close()

    baseline, c, later, version_after_update = asyncio.run(main())
    assert version_after_update == 1
    assert later.versions.tolist() == [1] * N
    if in_flight:
        # tokens 0-2 come from the prefill and the first two decode steps (the 2nd was
        # already running when the update came); the update lands before the 3rd.
        assert c.versions.tolist() == [0, 0, 0] + [1] * (N - 3)
        assert np.array_equal(c.completion_ids[:3], baseline.completion_ids[:3])
        assert c.logprobs[:3].tobytes() == baseline.logprobs[:3].tobytes()
        assert c.logprobs[3:].tobytes() != baseline.logprobs[3:].tobytes()
    else:
        assert same(c, baseline)  # the whole batch ran under version 0


def test_newer_updates_queued_during_a_batch_supersede_older_ones():
    model = make_model()
    w1, w2 = perturbed_state(model, 1), perturbed_state(model, 2)
    reference_model = make_model()
    reference_model.load_state_dict(w2)

    async def main():
        engine = make_engine(model)
        reference = make_engine(reference_model)
        gate = Gate(engine)
        try:
            p = gate.pause(lambda idx, start: idx.size(1) == len(BLOCKER) + 1)
            blocker = asyncio.create_task(engine.generate(req(BLOCKER, 999)))
            await asyncio.to_thread(p.entered.wait)
            u1 = asyncio.create_task(engine.update_weights(w1, 1))  # busy worker: both queue
            u2 = asyncio.create_task(engine.update_weights(w2, 2))
            asyncio.get_running_loop().call_soon(p.release.set)  # after both queued
            await u1
            version_when_the_older_returned = engine.version
            await u2
            await blocker
            after = await engine.generate(req("12+34=", 5))
            expected = await reference.generate(req("12+34=", 5))
            return version_when_the_older_returned, after, expected
        finally:
            await engine.close()
            await reference.close()

    version_when_the_older_returned, after, expected = asyncio.run(main())
    assert version_when_the_older_returned == 2  # it returned once the newer was loaded
    assert after.versions.tolist() == [2] * len(after.versions)
    assert np.array_equal(after.completion_ids, expected.completion_ids)  # the newer weights
    assert after.logprobs.tobytes() == expected.logprobs.tobytes()


def test_an_update_cancelled_while_queued_is_not_loaded():
    model = make_model()

    async def main():
        engine = make_engine(model)
        gate = Gate(engine)
        loop = asyncio.get_running_loop()
        try:
            p = gate.pause(lambda idx, start: idx.size(1) == len(BLOCKER) + 1)
            blocker = asyncio.create_task(engine.generate(req(BLOCKER, 999)))
            await asyncio.to_thread(p.entered.wait)
            update = asyncio.create_task(engine.update_weights(perturbed_state(model), 1))
            loop.call_soon(update.cancel)  # after it queued its refit
            with pytest.raises(asyncio.CancelledError):
                await update  # done: its future was cancelled before the task finished
            p.release.set()
            await blocker
            c = await engine.generate(req("12+34=", 5))
            return engine.version, c, engine.model.ln_f.weight.clone()
        finally:
            await engine.close()

    version, c, w = asyncio.run(main())
    assert version == 0 and c.versions.tolist() == [0] * len(c.versions)
    assert torch.equal(w, model.ln_f.weight)


def test_a_weight_load_that_fails_is_an_infra_error_idle_or_busy():
    model = make_model()
    bad = dict(model.state_dict())
    bad["ln_f.weight"] = torch.empty(bad["ln_f.weight"].shape, device="meta")  # fits, but has no data

    async def main():
        engine = make_engine(model)
        gate = Gate(engine)
        try:
            with pytest.raises(InfraError, match="loading weights of version 1 failed") as idle:
                await engine.update_weights(bad, 1)  # idle worker: loaded on the loop
            p = gate.pause(lambda idx, start: idx.size(1) == len(BLOCKER) + 1)
            blocker = asyncio.create_task(engine.generate(req(BLOCKER, 999)))
            await asyncio.to_thread(p.entered.wait)
            busy = asyncio.create_task(engine.update_weights(bad, 2))  # busy: the worker loads it
            asyncio.get_running_loop().call_soon(p.release.set)
            busy_error = (await asyncio.gather(busy, return_exceptions=True))[0]
            await blocker
            ok = await engine.generate(req("1+2=", 1))  # the worker lives on
            return idle.value, busy_error, engine.version, ok
        finally:
            await engine.close()

    idle, busy, version, ok = asyncio.run(main())
    assert isinstance(idle.__cause__, NotImplementedError)
    assert isinstance(busy, InfraError) and "version 2" in str(busy) and isinstance(busy.__cause__, NotImplementedError)
    assert version == 0 and ok.versions.tolist() == [0] * len(ok.versions)


# ====================================================================== queue and close


def test_a_request_cancelled_while_queued_is_never_run():
    doomed_prompt = "1234567+1="  # 11 tokens with BOS: no other prompt here has that length

    async def main():
        engine = make_engine(max_new_tokens=4)
        gate = Gate(engine)
        lengths = []
        gate.pause(lambda idx, start: lengths.append(idx.size(1)) and False)  # records, never blocks
        loop = asyncio.get_running_loop()
        try:
            p = gate.pause(lambda idx, start: idx.size(1) == len(BLOCKER) + 1)
            blocker = asyncio.create_task(engine.generate(req(BLOCKER, 999)))
            await asyncio.to_thread(p.entered.wait)
            doomed = asyncio.create_task(engine.generate(req(doomed_prompt, 2)))
            loop.call_soon(doomed.cancel)  # after it queued its request
            with pytest.raises(asyncio.CancelledError):
                await doomed
            p.release.set()
            await blocker
            ok = await engine.generate(req("1+1=", 3))  # the worker still serves
            return lengths, ok
        finally:
            await engine.close()

    lengths, ok = asyncio.run(main())
    assert len(doomed_prompt) + 1 not in lengths  # never prefilled
    assert len("1+1=") + 1 in lengths and len(ok.completion_ids) >= 1


def test_close_fails_what_is_queued_lets_the_running_batch_finish_and_joins_the_worker():
    model = make_model()

    async def main():
        engine = make_engine(model, max_new_tokens=4)
        gate = Gate(engine)
        try:
            p = gate.pause(lambda idx, start: idx.size(1) == len(BLOCKER) + 1)
            running = asyncio.create_task(engine.generate(req(BLOCKER, 999)))
            await asyncio.to_thread(p.entered.wait)
            queued = asyncio.create_task(engine.generate(req("12+34=", 1)))
            update = asyncio.create_task(engine.update_weights(perturbed_state(model), 1))
            closing = asyncio.create_task(engine.close())
            asyncio.get_running_loop().call_soon(p.release.set)  # after close() shut the inbox
            out = await asyncio.gather(running, queued, update, closing, return_exceptions=True)
            with pytest.raises(InfraError, match="used after close"):
                await engine.generate(req("1+2=", 2))
            return out, engine._thread.is_alive(), engine.version
        finally:
            await engine.close()  # a second close is harmless

    (running, queued, update, closed), alive, version = asyncio.run(main())
    assert isinstance(running, Completion) and len(running.completion_ids) >= 1
    assert isinstance(queued, InfraError) and "closed before generating" in str(queued)
    assert isinstance(update, InfraError) and "closed before loading pending weights" in str(update)
    assert closed is None and not alive and version == 0
