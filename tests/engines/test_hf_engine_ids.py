"""The hf engine's token-in entry point (`submit_ids`, what `rollkeep serve` runs) and its
weight reload from a directory: the same tokens and log-probs as `generate`, per-request
sampling settings that never share a batch, a callback per token, cancellation that stops
decoding, and reloads that change everything or nothing. Ordered by callbacks and events,
never by sleeping."""

from __future__ import annotations

import asyncio
import shutil
import threading

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_fixture import make_tiny_hf_model  # noqa: E402

from rollkeep.core.custody.keys import Key  # noqa: E402
from rollkeep.core.errors import UserInputError  # noqa: E402
from rollkeep.core.rollout.generation import Tokens  # noqa: E402
from rollkeep.core.rollout.source import Prompt  # noqa: E402
from rollkeep.engines import GenRequest  # noqa: E402
from rollkeep.engines.hf import HFEngine  # noqa: E402

T, TOP_P, M = 0.8, 0.9, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-hf-ids") / "model", n_positions=256)


@pytest.fixture
def eng(model_dir):
    e = HFEngine(model_path=str(model_dir), temperature=T, top_p=TOP_P, max_new_tokens=M, chat_template=False,
                 max_batch_size=8, device="cpu")
    yield e
    asyncio.run(e.close())


def request(text: str, seed: int, prefix: Tokens | None = None) -> GenRequest:
    prompt = Prompt(key=Key(0, 0), group_id="g", idx=0, task="default", row={}, row_fingerprint=0, prompt=text)
    return GenRequest(group_id="g", generation=0, attempt=0, prompt=prompt, seed=seed, pinned_version=None,
                      prefix=prefix)


def generate(eng: HFEngine, *reqs: GenRequest):
    async def body():
        return await asyncio.gather(*[eng.generate(r) for r in reqs])

    return asyncio.run(body())


def test_submit_ids_gives_exactly_what_generate_gives(eng):
    texts = [("12+34=", 1), ("7*8=?", 2), ("hello", 3), ("12+34=", 4)]
    completions = generate(eng, *[request(t, s) for t, s in texts])
    futures = [eng.submit_ids(c.prompt_ids.tolist(), seed=s, max_new_tokens=M)
               for c, (_, s) in zip(completions, texts, strict=True)]
    for c, f in zip(completions, futures, strict=True):
        r = f.result(timeout=60)
        assert r.token_ids == c.completion_ids.tolist() and r.finish_reason == c.finish_reason
        np.testing.assert_array_equal(r.logprobs, c.logprobs)
        assert r.logprobs.dtype == np.float32 and r.version == 0


def test_a_continuation_samples_at_its_completion_positions_as_generate_does(eng):
    (c,) = generate(eng, request("12+34=", 5))
    k = len(c.completion_ids) // 2
    prefix = Tokens(c.completion_ids[:k], c.logprobs[:k], c.versions[:k])
    (cont,) = generate(eng, request("12+34=", 5, prefix))
    r = eng.submit_ids(c.prompt_ids.tolist() + c.completion_ids[:k].tolist(), seed=5, max_new_tokens=M - k,
                       prompt_tokens=len(c.prompt_ids)).result(timeout=60)
    assert r.token_ids == cont.completion_ids[k:].tolist() == c.completion_ids[k:].tolist()
    np.testing.assert_array_equal(r.logprobs, cont.logprobs[k:])
    # Prefilled rather than decoded one by one: the same tokens, log-probs to float32 rounding.
    np.testing.assert_allclose(r.logprobs, c.logprobs[k:], atol=1e-5)


def test_sampling_settings_are_per_request_and_never_share_a_batch(eng):
    shapes, entered, release = [], threading.Event(), threading.Event()

    def hold_first(module, args, kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        if not entered.is_set():
            entered.set()
            assert release.wait(30)

    handle = eng.model.register_forward_pre_hook(hold_first, with_kwargs=True)
    ids = eng.tokenizer.encode("12+34=")
    blocker = eng.submit_ids([5], seed=0, max_new_tokens=1)
    assert entered.wait(30)  # the worker holds; the next three queue behind it
    hot = eng.submit_ids(ids, seed=9, max_new_tokens=M, temperature=1.5, top_p=1.0)
    cold = eng.submit_ids(ids, seed=9, max_new_tokens=M, temperature=0.5, top_p=1.0)
    cold2 = eng.submit_ids(ids, seed=10, max_new_tokens=M, temperature=0.5, top_p=1.0)
    release.set()
    blocker.result(timeout=60)
    hot, cold, cold2 = (f.result(timeout=60) for f in (hot, cold, cold2))
    handle.remove()
    prefills = [s for s in shapes if s[1] == len(ids)]
    assert prefills == [(4, len(ids)), (4, len(ids))]  # hot alone, the two cold together (rows padded to 4)
    alone = eng.submit_ids(ids, seed=9, max_new_tokens=M, temperature=0.5, top_p=1.0).result(timeout=60)
    assert alone.token_ids == cold.token_ids
    np.testing.assert_array_equal(alone.logprobs, cold.logprobs)
    assert (hot.token_ids, hot.logprobs[0]) != (cold.token_ids, cold.logprobs[0])


def test_on_token_reports_every_new_token_in_order_and_ignore_eos_runs_to_the_limit(eng):
    seen = []
    r = eng.submit_ids([5, 6, 7], seed=3, max_new_tokens=200, ignore_eos=True,
                       on_token=lambda t, lp, v: seen.append((t, lp, v))).result(timeout=60)
    assert len(r.token_ids) == 200 and r.finish_reason == "length"
    assert seen == [(t, float(lp), 0) for t, lp in zip(r.token_ids, r.logprobs, strict=True)]


def test_cancelling_stops_decoding_at_the_next_step(eng):
    seen, future = [], None

    def on_token(t, lp, v):
        seen.append(t)
        if len(seen) == 3:
            future.cancel()

    future = eng.submit_ids([5, 6, 7], seed=3, max_new_tokens=200, ignore_eos=True, on_token=on_token)
    # The worker finishes the cancelled batch at once and serves the next request.
    after = eng.submit_ids([5, 6, 7], seed=3, max_new_tokens=2).result(timeout=60)
    assert future.cancelled() and len(seen) == 3 and len(after.token_ids) >= 1


def test_submit_ids_refuses_what_does_not_fit(eng):
    for kw in ({"max_new_tokens": 256}, {"max_new_tokens": -1}, {"max_new_tokens": 1, "prompt_tokens": 0},
               {"max_new_tokens": 1, "prompt_tokens": 2}):
        with pytest.raises(ValueError, match="do not fit"):
            eng.submit_ids([5], seed=0, **kw)
    assert eng.submit_ids([5], seed=0, max_new_tokens=0).result().finish_reason == "length"
    eos = eng.tokenizer.eos_token_id
    assert eng.submit_ids([5, eos], seed=0, max_new_tokens=4, prompt_tokens=1).result().finish_reason == "stop"


def test_load_weights_from_a_directory_changes_all_or_nothing(eng, model_dir, tmp_path):
    from transformers import GPT2LMHeadModel

    other = shutil.copytree(model_dir, tmp_path / "other")
    torch.manual_seed(1)
    GPT2LMHeadModel(eng.model.config).save_pretrained(other, safe_serialization=True)
    wider = make_tiny_hf_model(tmp_path / "wider", n_embd=64)
    ids = eng.tokenizer.encode("12+34=")
    before = eng.submit_ids(ids, seed=7, max_new_tokens=M).result(timeout=60)
    asyncio.run(eng.load_weights(str(other), 1))
    after = eng.submit_ids(ids, seed=7, max_new_tokens=M).result(timeout=60)
    assert eng.version == after.version == 1
    assert (after.token_ids, after.logprobs[0]) != (before.token_ids, before.logprobs[0])
    loaded = {k: v.clone() for k, v in eng.model.state_dict().items()}
    for bad, match in ((tmp_path / "absent", "not a transformers model"), (wider, "does not fit")):
        with pytest.raises(UserInputError, match=match):
            asyncio.run(eng.load_weights(str(bad), 2))
    assert eng.version == 1
    assert all(torch.equal(v, loaded[k]) for k, v in eng.model.state_dict().items())
    again = eng.submit_ids(ids, seed=7, max_new_tokens=M).result(timeout=60)
    assert again.token_ids == after.token_ids
