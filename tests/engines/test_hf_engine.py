"""The hf engine on a tiny offline GPT-2: reproducible sampling, exact behaviour log-probs,
chat templates, weight updates, cancellation, failures and bad paths.

Ordering is controlled, never timed: a forward pre-hook can hold the worker inside a
batch (`Gate`) while the test queues or cancels requests behind it."""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_fixture import make_tiny_hf_model  # noqa: E402

from rollkeep.core.custody.keys import Key  # noqa: E402
from rollkeep.core.errors import UserInputError  # noqa: E402
from rollkeep.core.rollout.source import Prompt  # noqa: E402
from rollkeep.engines import GenRequest, InfraError  # noqa: E402
from rollkeep.engines.hf import HFEngine  # noqa: E402

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-hf") / "model")


def engine(model_dir, **overrides) -> HFEngine:
    args = dict(model_path=str(model_dir), temperature=TEMPERATURE, top_p=1.0, max_new_tokens=12,
                chat_template=False, max_batch_size=8, device="cpu")
    return HFEngine(**(args | overrides))


def request(text: str, seed: int, *, generation: int = 0, version: int | None = None) -> GenRequest:
    prompt = Prompt(key=Key(0, 0), group_id="g", idx=0, task="default", row={}, row_fingerprint=0, prompt=text)
    return GenRequest(group_id="g", generation=generation, attempt=0, prompt=prompt, seed=seed, pinned_version=version)


class Gate:
    """Records every forward's input shape; holds the worker in the first one until released."""

    def __init__(self, model) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.entered = threading.Event()
        self.released = threading.Event()
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))
        if not self.entered.is_set():
            self.entered.set()
            assert self.released.wait(30), "test never released the gate"

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30)


def run(eng: HFEngine, body):
    async def main():
        try:
            return await body()
        finally:
            await eng.close()

    return asyncio.run(main())


def test_generates_offline_and_refuses_after_close(model_dir):
    eng = engine(model_dir)

    async def body():
        c = await eng.generate(request("12+34=", seed=1))
        await eng.close()
        with pytest.raises(InfraError, match="after close"):
            await eng.generate(request("12+34=", seed=1))
        return c

    c = run(eng, body)
    n = len(c.completion_ids)
    assert 1 <= n <= 12
    assert c.prompt_ids.dtype == np.int32 and c.completion_ids.dtype == np.int32
    assert c.logprobs.dtype == np.float32 and c.logprobs.shape == (n,) and (c.logprobs < 0).all()
    assert c.versions.tolist() == [0] * n
    assert c.prompt_ids.tolist() == eng.tokenizer.encode("12+34=")
    eos = eng.tokenizer.eos_token_id
    assert c.finish_reason == ("stop" if c.completion_ids[-1] == eos else "length")
    assert eos not in c.completion_ids[:-1].tolist()
    assert c.text == eng.tokenizer.decode(c.completion_ids.tolist(), skip_special_tokens=True)


def test_same_seed_same_completion_alone_and_in_a_batch(model_dir):
    eng = engine(model_dir)

    async def body():
        alone = await eng.generate(request("12+34=", seed=7))
        again = await eng.generate(request("12+34=", seed=7))
        gate = Gate(eng.model)
        blocker = asyncio.create_task(eng.generate(request("9", seed=1)))
        await gate.wait_entered()  # the worker is inside the blocker's batch
        batch = [asyncio.create_task(eng.generate(request(p, seed=s)))
                 for p, s in [("12+34=", 7), ("56+78=", 8), ("12+34=", 9)]]
        await asyncio.sleep(0)  # a yield, not a wait: each task queues its request
        gate.released.set()
        await blocker
        return alone, again, await asyncio.gather(*batch), gate.shapes

    alone, again, (same, other, other_seed), shapes = run(eng, body)
    assert (4, 6) in shapes  # the three equal-length prompts were prefilled as one batch (+1 pad row)
    for c in (again, same):
        assert c.completion_ids.tolist() == alone.completion_ids.tolist()
        np.testing.assert_array_equal(c.logprobs, alone.logprobs)
        assert c.text == alone.text
    assert other_seed.completion_ids.tolist() != alone.completion_ids.tolist()


def test_logprobs_are_the_full_vocabulary_log_softmax_at_the_temperature(model_dir):
    from transformers import AutoModelForCausalLM

    eng = engine(model_dir, top_p=0.9)  # truncation changes what is sampled, not the log-prob

    async def body():
        return await asyncio.gather(*[eng.generate(request(p, seed=s))
                                      for p, s in [("1+1=", 3), ("abc", 4), ("7*8=?", 5)]])

    completions = run(eng, body)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    for c in completions:
        P, C = len(c.prompt_ids), len(c.completion_ids)
        ids = torch.tensor(np.concatenate([c.prompt_ids, c.completion_ids]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, P - 1 : P + C - 1]  # (C, V): predicts each token
        expected = torch.log_softmax(logits.double() / TEMPERATURE, dim=-1)
        expected = expected.gather(1, torch.from_numpy(c.completion_ids).long()[:, None])[:, 0]
        np.testing.assert_allclose(c.logprobs, expected.numpy(), atol=1e-4)


def test_chat_template_wraps_the_prompt(model_dir):
    plain, chat = engine(model_dir), engine(model_dir, chat_template=True)
    p = run(plain, lambda: plain.generate(request("12+34=", seed=1)))
    c = run(chat, lambda: chat.generate(request("12+34=", seed=1)))
    assert p.prompt_ids.tolist() != c.prompt_ids.tolist()
    assert chat.tokenizer.decode(c.prompt_ids.tolist()) == "User: 12+34=\nAssistant:"


def test_update_weights_changes_outputs_and_version(model_dir):
    from transformers import GPT2LMHeadModel

    eng = engine(model_dir)
    torch.manual_seed(1)
    new = GPT2LMHeadModel(eng.model.config).state_dict()

    async def body():
        before = await eng.generate(request("12+34=", seed=7))
        await eng.update_weights(new, 3)
        after = await eng.generate(request("12+34=", seed=7))
        with pytest.raises(UserInputError, match="do not fit") as bad:
            await eng.update_weights({"not.a.parameter": torch.zeros(1)}, 4)
        return before, after, bad.value, await eng.generate(request("12+34=", seed=7))

    before, after, bad, still = run(eng, body)
    assert eng.version == 3  # the refused update changed nothing
    assert "not.a.parameter" in bad.found
    assert before.versions.tolist() == [0] * len(before.versions)
    assert after.versions.tolist() == [3] * len(after.versions)
    assert (after.completion_ids.tolist(), after.logprobs[0]) != (before.completion_ids.tolist(), before.logprobs[0])
    assert still.completion_ids.tolist() == after.completion_ids.tolist()
    for name, tensor in new.items():
        assert torch.equal(eng.model.state_dict()[name], tensor), name


def test_a_failing_batch_fails_its_requests_and_the_worker_survives(model_dir):
    eng = engine(model_dir)
    calls = []

    def fail_once(module, args, kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated device failure")

    handle = eng.model.register_forward_pre_hook(fail_once, with_kwargs=True)

    async def body():
        with pytest.raises(InfraError, match="simulated device failure"):
            await eng.generate(request("12+34=", seed=1))
        with pytest.raises(InfraError, match="pinned to another weight version"):
            await eng.generate(request("12+34=", seed=1, version=5))
        handle.remove()
        return await eng.generate(request("12+34=", seed=1))

    assert len(run(eng, body).completion_ids) >= 1


def test_a_request_cancelled_while_queued_is_never_run(model_dir):
    eng = engine(model_dir)

    async def body():
        gate = Gate(eng.model)
        blocker = asyncio.create_task(eng.generate(request("9", seed=1)))
        await gate.wait_entered()
        doomed = asyncio.create_task(eng.generate(request("12345678", seed=2)))
        await asyncio.sleep(0)  # a yield: the request is queued behind the held batch
        doomed.cancel()
        gate.released.set()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await doomed
        await eng.generate(request("1+1=", seed=3))  # the worker still serves
        return gate.shapes

    shapes = run(eng, body)
    assert all(shape[1] != 8 for shape in shapes)  # no prefill of the cancelled 8-token prompt
    assert any(shape[1] == 4 for shape in shapes)  # the next request ran


def test_bad_model_path_is_a_user_input_error_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(UserInputError, match="no-such-model") as e:
        engine(missing)
    assert e.value.path == str(missing) and e.value.found == "nothing at that path"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hi")
    with pytest.raises(UserInputError, match="without config.json") as e:
        engine(tmp_path / "empty")
    assert "notes.txt" in e.value.found


def test_broken_model_directory_is_a_user_input_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserInputError, match="could not load") as e:
        engine(tmp_path)
    assert e.value.path == str(tmp_path)


def test_missing_transformers_names_the_extra(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(UserInputError, match=r"pip install 'rollkeep\[hf\]'"):
        engine(model_dir)


def test_chat_template_without_one_in_the_tokenizer_is_refused(model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    bare = shutil.copytree(model_dir, tmp_path / "bare")
    (bare / "chat_template.jinja").unlink(missing_ok=True)  # transformers >= 4.50 keeps it here
    tokenizer = AutoTokenizer.from_pretrained(bare, local_files_only=True)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(bare)
    with pytest.raises(UserInputError, match="no chat template"):
        engine(bare, chat_template=True)
