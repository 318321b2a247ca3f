"""The vllm engine. Everywhere: its guards, its pure functions and its whole control flow
against a fake `vllm` with the real one's shapes (fake_vllm.py). The GPU smoke test at the
end needs vllm and CUDA (scripts/gpu_check.sh checks much more there); neither has run."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import sys
import threading
import types
from types import SimpleNamespace

import fake_vllm
import msgspec
import numpy as np
import pytest
import torch

from rollkeep.config import load_config
from rollkeep.core.custody.keys import Key
from rollkeep.core.errors import ConfigError, CustodyError, UserInputError
from rollkeep.core.rollout.source import Prompt
from rollkeep.engines import DataError, GenRequest, InfraError
from rollkeep.engines import vllm as vl
from rollkeep.engines.vllm import Prefix, VLLMEngine

ARGS = dict(model_path="unused", temperature=1.0, top_p=1.0, max_new_tokens=8,
            gpu_memory_utilization=0.2, tensor_parallel_size=1)


def _vllm_on_cuda() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    return torch.cuda.is_available()


def request(seed: int = 7, *, text: str = "12+34=", gid: str = "g", version: int | None = None) -> GenRequest:
    prompt = Prompt(key=Key(0, 0), group_id=gid, idx=0, task="default", row={}, row_fingerprint=0, prompt=text)
    return GenRequest(group_id=gid, generation=0, attempt=0, prompt=prompt, seed=seed, pinned_version=version)


@pytest.fixture
def env(monkeypatch):
    # The engine sets VLLM_ENABLE_V1_MULTIPROCESSING unless set; undo that after each test.
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return monkeypatch


@pytest.fixture
def fake(env, tmp_path):
    engine_cls = fake_vllm.install(env)
    (tmp_path / "config.json").write_text("{}")
    engine_cls.model_dir = str(tmp_path)
    return engine_cls


def build(fake, **overrides) -> VLLMEngine:
    return VLLMEngine(**(ARGS | {"model_path": fake.model_dir} | overrides))


def run(coro):
    return asyncio.run(coro)


async def closing(eng: VLLMEngine, coro):
    try:
        return await coro
    finally:
        await eng.close()


# --------------------------------------------------------------------------------- guards


def test_without_vllm_construction_names_the_install_remedy(env):
    env.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(UserInputError, match=r"pip install 'rollkeep\[vllm\]' on a machine with a CUDA GPU"):
        VLLMEngine(**ARGS)


def bare_vllm(version: str = fake_vllm.VERSION) -> types.ModuleType:
    """A `vllm` module with a version and nothing else: what must not be reached stays unreached."""
    module = types.ModuleType("vllm")
    module.__version__ = version
    return module


def test_without_cuda_construction_names_the_install_remedy(env):
    env.setitem(sys.modules, "vllm", bare_vllm())
    env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserInputError, match="needs a CUDA GPU") as e:
        VLLMEngine(**ARGS)
    assert "rollkeep[vllm]" in e.value.remedy


@pytest.mark.parametrize("overrides, message", [
    (dict(model_path="/no/such/model"), "/no/such/model"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size 1 only"),
    (dict(top_p=0.9), "top_p = 1 only"),
])
def test_bad_settings_are_refused_before_vllm_starts(env, tmp_path, overrides, message):
    env.setitem(sys.modules, "vllm", bare_vllm())  # has no LLMEngine: must not be reached
    env.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserInputError, match=message):
        VLLMEngine(**(ARGS | {"model_path": str(tmp_path)} | overrides))


def test_multiprocess_vllm_is_refused(env, tmp_path):
    env.setitem(sys.modules, "vllm", bare_vllm())
    env.setattr(torch.cuda, "is_available", lambda: True)
    env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserInputError, match="needs vLLM in this process"):
        VLLMEngine(**(ARGS | {"model_path": str(tmp_path)}))


def test_config_refuses_top_p_below_one_for_the_vllm_engine():
    base = ["engine.name=vllm", "engine.model_path=/m", "trainer.name=hf", "trainer.model_path=/m"]
    with pytest.raises(ConfigError, match=r"`engine.top_p`: expected 1.0 with engine vllm") as e:
        load_config(None, [*base, "engine.top_p=0.9"])
    assert e.value.field == "engine.top_p"
    assert load_config(None, base).engine.top_p == 1.0
    # nucleus sampling stays available where the behaviour log-probs are full-vocabulary
    assert load_config(None, ["engine.name=hf", "engine.model_path=/m", "trainer.name=hf",
                              "trainer.model_path=/m", "engine.top_p=0.9"]).engine.top_p == 0.9


def test_extra_pins_the_supported_range():
    text = (vl.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'vllm = ["vllm{vl.SUPPORTED}"]' in text


# ------------------------------------------------------------------------- pure functions


def test_engine_args_turn_off_async_scheduling_and_ask_for_processed_logprobs():
    args = vl.engine_args(model="/m", gpu_memory_utilization=0.3, dtype="auto", enforce_eager=False)
    assert args["async_scheduling"] is False and args["stream_interval"] == 1
    assert args["logprobs_mode"] == "processed_logprobs" and args["enable_prefix_caching"] is True
    assert args["tensor_parallel_size"] == 1


def test_sampling_kwargs_keep_the_seed_a_pure_function_within_int64():
    kw = vl.sampling_kwargs(temperature=0.7, top_p=1.0, max_tokens=5, seed=2**64 - 1, output_kind="D")
    assert kw == dict(n=1, temperature=0.7, top_p=1.0, max_tokens=5, seed=(2**64 - 1) % 2**63,
                      logprobs=0, output_kind="D")
    with pytest.raises(ValueError):
        vl.sampling_kwargs(temperature=1.0, top_p=1.0, max_tokens=0, seed=1, output_kind="D")


def test_stale_kv_cache_regression_prompt_is_salted_with_the_weight_version():
    a, b = vl.engine_input([5, 6], [], 0), vl.engine_input([5, 6], [], 3)
    assert a == {"type": "token", "prompt_token_ids": [5, 6], "cache_salt": "w0"} and b["cache_salt"] == "w3"
    assert vl.engine_input([5, 6], [9], 3)["prompt_token_ids"] == [5, 6, 9]


@pytest.mark.parametrize("reason, outcome", [
    ("stop", "stop"), ("length", "length"),
    ("abort", InfraError), ("error", InfraError),
    ("repetition", RuntimeError), (None, RuntimeError), ("something new", RuntimeError),
])
def test_finish_reasons(reason, outcome):
    if isinstance(outcome, str):
        assert vl.finish_reason(reason) == outcome
    else:
        with pytest.raises(outcome) as e:
            vl.finish_reason(reason)
        assert outcome is InfraError or not isinstance(e.value, InfraError)  # a bug is not infra


@pytest.mark.parametrize("change, message", [
    (dict(async_scheduling=True), "async_scheduling"),
    (dict(async_scheduling=None), "async_scheduling"),
    (dict(stream_interval=2), "stream_interval"),
    (dict(logprobs_mode="raw_logprobs"), "logprobs_mode"),
])
def test_engine_config_resolved_otherwise_is_refused(change, message):
    ok = dict(async_scheduling=False, stream_interval=1, logprobs_mode="processed_logprobs") | change
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=ok["async_scheduling"],
                                                           stream_interval=ok["stream_interval"]),
                          model_config=SimpleNamespace(logprobs_mode=ok["logprobs_mode"]))
    with pytest.raises(UserInputError, match=message):
        vl.check_engine_config(cfg)


def test_weight_loading_path_is_a_feature_probe():
    def new(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True): ...

    def old(self): ...

    with_rpc = SimpleNamespace(collective_rpc=lambda *a, **k: None)
    assert vl.weight_loading_path(with_rpc, new) == "reload_weights"
    assert vl.weight_loading_path(with_rpc, old) == "load_weights"
    assert vl.weight_loading_path(with_rpc, None) == "load_weights"
    assert vl.weight_loading_path(SimpleNamespace(), new) == "load_weights"


def test_token_logprobs_reads_lists_and_refuses_missing_ones():
    steps = [{4: fake_vllm.Logprob(-0.5)}, {9: fake_vllm.Logprob(-1.5)}]
    assert vl.token_logprobs([4, 9], steps) == [-0.5, -1.5]
    assert vl.token_logprobs([], None) == []
    with pytest.raises(RuntimeError, match="log-probabilities"):
        vl.token_logprobs([4], None)


def test_preserve_global_rng_restores_every_generator():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    precision = torch.get_float32_matmul_precision()
    with vl.preserve_global_rng(cuda=False):
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
        torch.set_float32_matmul_precision("medium")
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    assert draws == (random.random(), np.random.rand(), torch.rand(1).item())
    assert torch.get_float32_matmul_precision() == precision


def test_shutdown_engine_calls_the_engine_core():
    calls = []
    vl.shutdown_engine(SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: calls.append(1))))
    vl.shutdown_engine(SimpleNamespace())  # nothing to call: no error
    assert calls == [1]


# ------------------------------------------------------------ the engine, on the fake vllm


def test_builds_in_process_with_the_settings_and_streams_a_completion(fake):
    eng = build(fake, max_new_tokens=4, temperature=0.7)
    c = run(closing(eng, eng.generate(request(seed=2**64 - 1))))
    e = fake.instances[0]
    assert e.args == vl.engine_args(model=fake.model_dir, gpu_memory_utilization=0.2, dtype="auto",
                                    enforce_eager=False)
    rid, prompt, params = e.added[0]
    tokens = fake_vllm.Tokenizer().encode("12+34=")
    assert prompt == {"type": "token", "prompt_token_ids": tokens, "cache_salt": "w0"}  # rendered, not raw
    assert e.raw_prompts == 0
    assert (params.seed, params.temperature, params.top_p, params.max_tokens, params.logprobs) == (
        (2**64 - 1) % 2**63, 0.7, 1.0, 4, 0)
    assert c.prompt_ids.tolist() == tokens
    want = [fake_vllm.token_at(params.seed, len(tokens) + i) for i in range(4)]
    assert c.completion_ids.tolist() == want and c.finish_reason == "length"
    assert c.versions.tolist() == [0] * 4 and c.text == "".join(chr(t + 60) for t in want)
    np.testing.assert_allclose(c.logprobs, [-1.0 - (len(tokens) + i) / 100 for i in range(4)], rtol=1e-6)
    assert eng.weight_loading == "reload_weights" and eng.continuation_token_identical
    assert e.shut_down == 1 and len(e.thread_ids) == 1  # built, driven and shut down on one thread


def test_update_in_flight_stamps_each_token_with_the_version_that_sampled_it(fake):
    eng = build(fake, max_new_tokens=4)
    e = fake.instances[0]
    e.gate = threading.Semaphore(0)
    got_two = threading.Event()
    deltas = []

    def on_delta(d):
        deltas.append(d)
        if len(deltas) == 2:
            got_two.set()

    async def body():
        task = asyncio.create_task(eng.generate(request(), on_delta=on_delta))
        e.gate.release(2)  # two steps run under version 0 ...
        assert await asyncio.to_thread(got_two.wait, 10)
        # ... and the worker is inside its third step(): the update lands after it returns.
        assert await asyncio.to_thread(e.wait_entered, 3)
        update = asyncio.create_task(eng.update_weights({"w": 1.0}, 5))
        await asyncio.sleep(0)  # let the update reach the worker's inbox
        e.gate.release(2)
        await update
        return await task

    c = run(closing(eng, body()))
    assert c.versions.tolist() == [0, 0, 0, 5]
    assert [d.version for d in deltas] == [0, 0, 0, 5] and all(len(d.token_ids) == 1 for d in deltas)
    lp = c.logprobs.tolist()
    assert lp[2] > -1.5 and lp[3] < -1.5  # the last token was sampled by the new "weights"
    assert eng.version == 5


def test_weights_load_through_collective_rpc_and_later_requests_get_the_new_salt(fake):
    eng = build(fake, max_new_tokens=2)

    async def body():
        await eng.generate(request())
        await eng.update_weights({"w": 2.0, "x": 0.0}, 3)
        return await eng.generate(request())

    c = run(closing(eng, body()))
    e = fake.instances[0]
    method, kwargs = e.rpc[0]
    assert method == "reload_weights" and kwargs["is_checkpoint_format"] is True
    assert kwargs["weights_iterator"] == [("w", 2.0), ("x", 0.0)]
    assert [p["cache_salt"] for _, p, _ in e.added] == ["w0", "w3"]
    assert c.versions.tolist() == [3, 3] and (c.logprobs < -2.5).all()


def test_without_reload_weights_the_driver_model_is_loaded_and_post_processed(env, tmp_path):
    fake = fake_vllm.install(env, reload_weights=False)
    (tmp_path / "config.json").write_text("{}")
    eng = VLLMEngine(**(ARGS | {"model_path": str(tmp_path)}))
    run(closing(eng, eng.update_weights({"w": 1.0}, 1)))
    e = fake.instances[0]
    assert eng.weight_loading == "load_weights" and e.rpc == []
    assert e.model.loaded == [{"w": 1.0}] and eng.version == 1
    assert fake_vllm.post_processed == [(e.model, e.model_config, "cuda:0")]


def test_fallback_refuses_a_quantized_model(env, tmp_path):
    fake = fake_vllm.install(env, reload_weights=False)
    fake.behaviour.quantization = "fp8"
    (tmp_path / "config.json").write_text("{}")
    eng = VLLMEngine(**(ARGS | {"model_path": str(tmp_path)}))
    with pytest.raises(UserInputError, match="quantized"):
        run(closing(eng, eng.update_weights({"w": 1.0}, 1)))
    assert eng.version == 0


def test_weights_that_do_not_fit_are_a_user_error_and_keep_the_version(fake):
    eng = build(fake)
    with pytest.raises(UserInputError, match="do not fit"):
        run(closing(eng, eng.update_weights({"nope": 1.0}, 1)))
    assert eng.version == 0


@pytest.mark.parametrize("reason, error", [("abort", InfraError), ("error", InfraError),
                                           ("repetition", RuntimeError)])
def test_abort_and_error_finishes_are_infra_failures_others_are_bugs(fake, reason, error):
    fake.behaviour.finish = {"bad/": reason}
    eng = build(fake, max_new_tokens=4)

    async def body():
        ok = asyncio.create_task(eng.generate(request(gid="ok")))
        with pytest.raises(error) as e:
            await eng.generate(request(gid="bad"))
        return e.value, await ok

    failure, ok = run(closing(eng, body()))
    assert isinstance(failure, InfraError) == (error is InfraError)
    assert ok.finish_reason == "length" and len(ok.completion_ids) == 4  # its batch mate is unharmed


def test_engine_config_that_vllm_resolved_otherwise_is_refused_and_shut_down(fake):
    fake.behaviour.resolved = {"async_scheduling": True}
    with pytest.raises(UserInputError, match="async_scheduling"):
        build(fake)
    assert fake.instances[0].shut_down == 1


def test_building_the_engine_leaves_the_global_generators_alone(fake):
    def reseed():  # what vLLM's set_random_seed does while the engine is built
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        torch.set_float32_matmul_precision("high")

    fake.behaviour.on_build = reseed
    random.seed(5)
    torch.manual_seed(5)
    np.random.seed(5)
    precision = torch.get_float32_matmul_precision()
    eng = build(fake)
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    run(eng.close())
    random.seed(5)
    torch.manual_seed(5)
    np.random.seed(5)
    assert draws == (random.random(), np.random.rand(), torch.rand(1).item())
    assert torch.get_float32_matmul_precision() == precision


def test_a_prefix_is_continued_from_exact_ids_with_the_same_seed(fake):
    eng = build(fake, max_new_tokens=6)

    async def body():
        full = await eng.generate(request(seed=11))
        cut = Prefix(full.completion_ids[:2].tolist(), full.logprobs[:2].tolist(), [0, 0])
        await eng.update_weights({"w": 1.0}, 1)
        return full, await eng.generate(request(seed=11), prefix=cut)

    full, cont = run(closing(eng, body()))
    e = fake.instances[0]
    _, prompt, params = e.added[1]
    tokens = fake_vllm.Tokenizer().encode("12+34=")
    assert prompt["prompt_token_ids"] == tokens + full.completion_ids[:2].tolist()
    assert params.seed == e.added[0][2].seed and params.max_tokens == 4
    # The fake draws like Model Runner V2 (seed, absolute position): the continuation is
    # token-identical; the prefix keeps its recorded log-probs and versions.
    assert cont.completion_ids.tolist() == full.completion_ids.tolist()
    assert cont.prompt_ids.tolist() == tokens
    assert cont.versions.tolist() == [0, 0, 1, 1, 1, 1]
    np.testing.assert_array_equal(cont.logprobs[:2], full.logprobs[:2])


@pytest.mark.parametrize(("ids", "reason"), [([5, 6], "length"), ([5, 2], "stop")])
def test_a_prefix_that_already_ends_the_completion_is_returned_as_is(fake, ids, reason):
    """Cut off between its last token and its seal: nothing is left to generate (it is
    max_new_tokens long, or ends with EOS), so vLLM is not asked."""
    eng = build(fake, max_new_tokens=2 if reason == "length" else 6)
    out = run(closing(eng, eng.generate(request(), prefix=Prefix(ids, [-0.5, -0.25], [0, 1]))))
    assert out.completion_ids.tolist() == ids and out.finish_reason == reason
    assert out.logprobs.tolist() == [-0.5, -0.25] and out.versions.tolist() == [0, 1]
    assert fake.instances[0].added == []


def test_the_engine_protocol_streams_chunks_to_the_loop_and_continues_req_prefix(fake):
    """`generate(req, progress)`: every new token reaches `progress` on the loop's thread
    as a Chunk before the result; `req.prefix` (the scheduler's Prefix) is continued."""
    import threading

    from rollkeep.core.rollout.generation import Tokens

    eng = build(fake, max_new_tokens=6)
    seen: list = []

    def progress(chunk):
        seen.append((threading.current_thread() is threading.main_thread(), chunk))

    async def body():
        full = await eng.generate(request(seed=11), progress)
        cut = Tokens(full.completion_ids[:2], full.logprobs[:2], full.versions[:2])
        streamed = list(seen)
        seen.clear()
        cont = await eng.generate(msgspec.structs.replace(request(seed=11), prefix=cut), progress)
        return full, streamed, cont

    full, streamed, cont = run(closing(eng, body()))
    assert all(on_loop for on_loop, _ in streamed + seen)
    assert np.concatenate([c.completion_ids for _, c in streamed]).tolist() == full.completion_ids.tolist()
    assert cont.completion_ids.tolist() == full.completion_ids.tolist()
    assert np.concatenate([c.completion_ids for _, c in seen]).tolist() == full.completion_ids[2:].tolist()


def test_a_prompt_that_does_not_fit_the_context_is_a_data_failure(fake):
    fake.behaviour.max_model_len = 6
    eng = build(fake)
    with pytest.raises(DataError, match="does not fit"):
        run(closing(eng, eng.generate(request(text="123456"))))
    assert fake.instances[0].added == []


def test_a_request_pinned_to_another_version_is_a_custody_error(fake):
    eng = build(fake)
    with pytest.raises(CustodyError, match="pinned"):
        run(closing(eng, eng.generate(request(version=1))))


def test_a_failing_step_fails_its_requests_as_infra_and_the_worker_lives_on(fake):
    eng = build(fake, max_new_tokens=2)

    async def body():
        fake.behaviour.fail_step = True
        with pytest.raises(InfraError, match="step failed: RuntimeError: CUDA error"):
            await eng.generate(request())
        fake.behaviour.fail_step = False
        return await eng.generate(request())

    assert len(run(closing(eng, body())).completion_ids) == 2


def test_cancelling_the_task_aborts_the_request_in_vllm(fake):
    eng = build(fake, max_new_tokens=8)
    e = fake.instances[0]
    e.gate = threading.Semaphore(0)
    first = threading.Event()

    async def body():
        task = asyncio.create_task(eng.generate(request(), on_delta=lambda d: first.set()))
        e.gate.release()
        assert await asyncio.to_thread(first.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        e.gate.release(100)  # the worker may step once more before it sees the abort
        return await eng.generate(request(gid="next"))

    after = run(closing(eng, body()))
    assert e.aborted and e.aborted[0].startswith("g/0/0/") and len(after.completion_ids) == 8


def test_close_fails_what_runs_and_shuts_the_engine_down(fake):
    eng = build(fake, max_new_tokens=8)
    e = fake.instances[0]
    e.gate = threading.Semaphore(0)
    first = threading.Event()

    async def body():
        task = asyncio.create_task(eng.generate(request(), on_delta=lambda d: first.set()))
        e.gate.release()
        assert await asyncio.to_thread(first.wait, 10)
        closer = asyncio.create_task(eng.close())
        await asyncio.sleep(0)
        e.gate.release(100)
        await closer
        with pytest.raises(InfraError, match="closed"):
            await task
        with pytest.raises(InfraError, match="after close"):
            await eng.generate(request())

    run(body())
    assert e.shut_down == 1 and not eng._worker.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_dies_fails_every_awaiter_instead_of_hanging(fake):
    eng = build(fake, max_new_tokens=8)
    e = fake.instances[0]
    e.gate = threading.Semaphore(0)
    both = threading.Event()
    seen = set()

    def on_delta(name):
        def f(d):
            seen.add(name)
            if len(seen) == 2:
                both.set()
        return f

    async def body():
        a = asyncio.create_task(eng.generate(request(gid="a"), on_delta=on_delta("a")))
        b = asyncio.create_task(eng.generate(request(gid="b"), on_delta=on_delta("b")))
        e.gate.release()
        assert await asyncio.to_thread(both.wait, 10)
        fake.behaviour.fail_abort = True
        a.cancel()  # the worker's abort_request will raise: a bug path
        with pytest.raises(asyncio.CancelledError):
            await a  # the abort is queued now, before the worker may step again
        e.gate.release(100)
        with pytest.raises(InfraError, match="worker died"):
            await b
        with pytest.raises(InfraError):
            await eng.generate(request(gid="c"))
        await eng.close()

    run(body())
    assert e.shut_down == 1 and not eng._worker.is_alive()


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not _vllm_on_cuda(), reason="needs vllm and a CUDA device")
def test_gpu_smoke_generate_and_update_weights(tmp_path):
    from hf_fixture import make_tiny_hf_model
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = make_tiny_hf_model(tmp_path / "model", n_embd=64, n_head=2, n_positions=128)
    eng = VLLMEngine(**(ARGS | {"model_path": str(model_dir)}))
    torch.manual_seed(1)
    new = GPT2LMHeadModel(GPT2Config.from_pretrained(model_dir)).state_dict()  # other random weights

    async def body():
        try:
            a = await eng.generate(request(7))
            b = await eng.generate(request(7))
            await eng.update_weights(new, 2)
            c = await eng.generate(request(7))
            return a, b, c
        finally:
            await eng.close()

    a, b, c = asyncio.run(body())
    assert 1 <= len(a.completion_ids) <= 8 and (a.logprobs <= 0).all()
    assert a.completion_ids.tolist() == b.completion_ids.tolist()
    assert a.versions.tolist() == [0] * len(a.versions)
    assert eng.version == 2 and c.versions.tolist() == [2] * len(c.versions)
    assert (c.completion_ids.tolist(), c.logprobs[0]) != (a.completion_ids.tolist(), a.logprobs[0])


def test_an_episode_runs_on_the_engine_and_continues_after_its_finished_turns(fake):
    """Multi-turn episodes (issue 12) through the vLLM engine: each turn continues the
    trajectory as a prefix, capped by env.max_turn_tokens; the responses are encoded by the
    engine's episode tokenizer, and an episode continued after its first turn ends as the
    uninterrupted one."""
    import episode_envs

    from rollkeep.controller.episodes import run_episode
    from rollkeep.controller.usercode import UserCode
    from rollkeep.envs import ENV_VERSION, EnvSpec

    spec = EnvSpec(episode_envs.CountEnv, "replay", 3, 5.0, 1024, "count", max_turn_tokens=3)

    def episode(req):
        eng, turns, code = build(fake, max_new_tokens=20), [], UserCode()
        try:
            c, _ = run(closing(eng, run_episode(eng, spec, req, None, lambda t, k, s: turns.append((t, k)),
                                                code=code)))
        finally:
            code.close()
        return c, turns

    whole, turns = episode(request())
    env = whole.versions == ENV_VERSION
    assert [k for _, k in turns] == [0, 1] and int((~env).sum()) == 9  # three turns of 3 tokens
    assert whole.completion_ids[env].tolist() == fake_vllm.Tokenizer().encode("=1;=2;", add_special_tokens=False)
    first = turns[0][0]
    continued, rest = episode(msgspec.structs.replace(request(), prefix=first, turns=(len(first),)))
    assert continued.completion_ids.tolist() == whole.completion_ids.tolist() and [k for _, k in rest] == [1]


# ------------------------------------------ the release check, the prompt's form, dtype, ties


@pytest.mark.parametrize("version, ok", [
    ("0.22.0", True), ("0.33.0", True), ("0.32.0+cpu", True), ("0.33.1.dev4+g1234abc", True),
    ("0.10.2", False), ("0.21.9", False), ("0.34.0", False), ("0.34.0rc1", False), ("0.34.0.dev2", False),
    ("1.0.0", False), (None, False), ("unknown", False),
])
def test_check_version_takes_exactly_the_supported_range(version, ok):
    if ok:
        vl.check_version(version)
        return
    with pytest.raises(UserInputError) as e:
        vl.check_version(version)
    assert e.value.expected == f"vllm {vl.SUPPORTED}" and "pip install 'rollkeep[vllm]'" in e.value.remedy


def test_a_vllm_outside_the_supported_range_is_refused_before_an_engine_is_built(env, tmp_path):
    """vllm 0.10.2 failed with a raw TypeError on `stream_interval`; now: exit 2, naming the
    release found, the range and the remedy, and nothing of vLLM is started."""
    from rollkeep.cli import exit_code

    fake = fake_vllm.install(env, version="0.10.2")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserInputError) as e:
        VLLMEngine(**(ARGS | {"model_path": str(tmp_path)}))
    message = str(e.value)
    assert "this is vllm 0.10.2" in message and ">=0.22,<0.34" in message and "rollkeep[vllm]" in message
    assert exit_code(e.value) == 2 and fake.instances == []


def test_requests_are_rendered_engine_inputs_never_raw_prompts(fake):
    """The non-deprecated form (`"type": "token"`), continuation and salt included."""
    eng = build(fake, max_new_tokens=3)

    async def body():
        full = await eng.generate(request(seed=5))
        await eng.update_weights({"w": 1.0}, 4)
        cut = Prefix(full.completion_ids[:1].tolist(), full.logprobs[:1].tolist(), [0])
        return full, await eng.generate(request(seed=5), prefix=cut)

    full, _ = run(closing(eng, body()))
    e = fake.instances[0]
    tokens = fake_vllm.Tokenizer().encode("12+34=")
    assert [p for _, p, _ in e.added] == [
        {"type": "token", "prompt_token_ids": tokens, "cache_salt": "w0"},
        {"type": "token", "prompt_token_ids": tokens + full.completion_ids[:1].tolist(), "cache_salt": "w4"},
    ]
    assert e.raw_prompts == 0


@pytest.mark.parametrize("dtype, want", [("auto", torch.bfloat16), ("float32", torch.float32),
                                         ("float16", torch.float16)])
def test_float32_master_weights_are_published_in_the_engines_dtype(fake, dtype, want):
    """`auto` is what vLLM resolved (the fake: bfloat16, as vLLM for a float32 or bf16
    checkpoint); a tensor shared by two names is cast once, so the names still share it;
    integer tensors are left alone."""
    eng = build(fake, dtype=dtype)
    shared = torch.randn(4, 3)
    weights = {"w": torch.tensor(0.5), "a": shared, "b": shared, "steps": torch.arange(3)}
    run(closing(eng, eng.update_weights(weights, 1)))
    e = fake.instances[0]
    assert e.args["dtype"] == dtype and eng.dtype is want
    got = e.loaded[0]
    assert {k: v.dtype for k, v in got.items()} == {"w": want, "a": want, "b": want, "steps": torch.int64}
    assert got["a"] is got["b"] and torch.equal(got["a"], shared.to(want))
    assert weights["a"].dtype == torch.float32  # the trainer's copy is untouched


def test_tied_embedding_regression_reload_always_sends_the_head_as_the_embedding(fake):
    """A tied model (vLLM 0.32's layerwise reload keeps the old head when it is not sent:
    the model half-updated). The head goes with the embedding's values whether it comes as
    the embedding's very tensor (the trainer's `weights()`), as an equal copy (pickled for
    Ray), or not at all (then it is added, as the embedding's tensor)."""
    fake.behaviour.tied = True
    eng = build(fake, dtype="float32")
    embed = torch.randn(5, 3)
    head = "lm_head.weight"

    async def body():
        await eng.update_weights({"w": torch.tensor(1.0), fake_vllm.EMBED: embed, head: embed}, 1)
        await eng.update_weights({"w": torch.tensor(2.0), fake_vllm.EMBED: embed, head: embed.clone()}, 2)
        await eng.update_weights({"w": torch.tensor(3.0), fake_vllm.EMBED: embed}, 3)

    run(closing(eng, body()))
    e = fake.instances[0]
    assert eng.tied_embeddings and eng.version == 3 and not e.stale_head
    assert [sorted(s) for s in e.loaded] == [[head, fake_vllm.EMBED, "w"]] * 3
    assert all(torch.equal(s[head], embed) and torch.equal(s[fake_vllm.EMBED], embed) for s in e.loaded)
    assert e.loaded[2][head] is e.loaded[2][fake_vllm.EMBED]


def test_an_untied_head_for_a_tied_model_is_refused_and_nothing_is_loaded(fake):
    fake.behaviour.tied = True
    eng = build(fake, dtype="float32")
    weights = {"w": torch.tensor(1.0), fake_vllm.EMBED: torch.zeros(5, 3), "lm_head.weight": torch.ones(5, 3)}
    with pytest.raises(UserInputError, match="output head is not its input embedding"):
        run(closing(eng, eng.update_weights(weights, 1)))
    assert fake.instances[0].rpc == [] and eng.version == 0


def test_a_tied_model_without_head_or_known_embedding_is_refused(fake):
    fake.behaviour.tied = True
    eng = build(fake, dtype="float32")
    with pytest.raises(UserInputError, match="no lm_head.weight and no embedding"):
        run(closing(eng, eng.update_weights({"w": torch.tensor(1.0), "emb.weight": torch.zeros(5, 3)}, 1)))
    assert fake.instances[0].rpc == [] and eng.version == 0


def test_an_untied_model_gets_its_weights_as_they_are(fake):
    eng = build(fake, dtype="float32")
    weights = {"w": torch.tensor(1.0), fake_vllm.EMBED: torch.zeros(5, 3), "lm_head.weight": torch.ones(5, 3)}
    run(closing(eng, eng.update_weights(weights, 1)))
    assert not eng.tied_embeddings and fake.instances[0].loaded == [weights]
    assert vl.tied_embeddings(SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=True)))
    assert not vl.tied_embeddings(SimpleNamespace(hf_config=SimpleNamespace()))


def test_chat_template_renders_the_prompt_and_adds_no_special_tokens_again(fake):
    fake.behaviour.chat_template = "{{ messages }}"  # the fake tokenizer renders <role>content
    eng = build(fake, max_new_tokens=2, chat_template=True)
    c = run(closing(eng, eng.generate(request(text="2+2="))))
    want = fake_vllm.Tokenizer().encode("<user>2+2=<assistant>", add_special_tokens=False)
    assert c.prompt_ids.tolist() == want and want[0] != 1  # no BOS in front of the template's own text
    assert fake.instances[0].added[0][1]["prompt_token_ids"] == want


def test_without_chat_template_the_prompt_gets_the_special_tokens(fake):
    eng = build(fake, max_new_tokens=2)
    c = run(closing(eng, eng.generate(request(text="2+2="))))
    assert c.prompt_ids.tolist() == fake_vllm.Tokenizer().encode("2+2=") and c.prompt_ids[0] == 1


def test_chat_template_with_a_tokenizer_without_one_is_refused_and_vllm_shut_down(fake):
    with pytest.raises(UserInputError, match="has no chat template") as e:
        build(fake, chat_template=True)
    assert e.value.field == "engine.chat_template" and fake.instances[0].shut_down == 1


# ------------------------------------------------------------------ config keys, wiring


VLLM_BASE = ["engine.name=vllm", "engine.model_path=/m", "trainer.name=hf", "trainer.model_path=/m"]


def test_engine_dtype_enforce_eager_and_chat_template_config_keys():
    cfg = load_config(None, VLLM_BASE)
    assert (cfg.engine.dtype, cfg.engine.enforce_eager, cfg.engine.chat_template) == ("auto", False, False)
    cfg = load_config(None, [*VLLM_BASE, "engine.dtype=bfloat16", "engine.enforce_eager=true",
                             "engine.chat_template=true"])
    assert (cfg.engine.dtype, cfg.engine.enforce_eager, cfg.engine.chat_template) == ("bfloat16", True, True)
    hf = ["engine.name=hf", "engine.model_path=/m", "trainer.name=hf", "trainer.model_path=/m"]
    assert load_config(None, [*hf, "engine.dtype=float16"]).engine.dtype == "float16"
    with pytest.raises(ConfigError) as e:
        load_config(None, [*VLLM_BASE, "engine.dtype=float64"])
    assert e.value.field == "engine.dtype"


def test_deterministic_hf_engine_needs_engine_dtype_auto():
    hf = ["engine.name=hf", "engine.model_path=/m", "trainer.name=hf", "trainer.model_path=/m", "deterministic=true",
          "rollout.on_dropped_prompt=shrink"]
    assert load_config(None, hf).engine.dtype == "auto"
    with pytest.raises(ConfigError, match=r"needs `engine.dtype: auto`; found `bfloat16`") as e:
        load_config(None, [*hf, "engine.dtype=bfloat16"])
    assert e.value.field == "engine.dtype"


def test_engine_dtype_is_semantic_enforce_eager_is_not():
    from rollkeep.config import ADDED_KEYS, is_semantic

    assert is_semantic("engine.dtype") and not is_semantic("engine.enforce_eager")
    assert ADDED_KEYS["engine.dtype"] == "auto"  # what a run did before the key existed


def test_the_config_section_reaches_the_engine(fake):
    """`make_engine` hands the vllm section's dtype, enforce_eager and chat_template over."""
    from rollkeep.engines import make_engine

    fake.behaviour.chat_template = "{{ messages }}"
    cfg = load_config(None, ["engine.name=vllm", f"engine.model_path={fake.model_dir}", "trainer.name=hf",
                             "trainer.model_path=/m", "engine.dtype=float32", "engine.enforce_eager=true",
                             "engine.chat_template=true", "engine.gpu_memory_utilization=0.2"])
    eng = make_engine(cfg.engine)
    run(eng.close())
    args = fake.instances[0].args
    assert (args["dtype"], args["enforce_eager"], eng.chat_template) == ("float32", True, True)
    assert args == vl.engine_args(model=fake.model_dir, gpu_memory_utilization=0.2, dtype="float32",
                                  enforce_eager=True)
