"""`data.chat_template` on the tiny offline model (`models.tiny_hf`, whose tokenizer is built
with a `User:`/`Assistant:` template): the prompt is the template's, the same ids in the hf
engine, the warm start and evaluation; a completion starts right after the generation
prompt and the loss covers exactly the model's tokens; in an episode, the template's tokens
around each environment turn are the environment's (masked), the model's, its EOS
included, are not; and a template that cannot be continued token by token is refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import episode_envs
import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_fixture import make_tiny_hf_model  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rollkeep.controller.episodes import run_episode  # noqa: E402
from rollkeep.controller.usercode import UserCode  # noqa: E402
from rollkeep.controller.warmup import demonstration  # noqa: E402
from rollkeep.core.errors import UserInputError  # noqa: E402
from rollkeep.core.rollout.generation import Completion, GenRequest  # noqa: E402
from rollkeep.core.rollout.source import Prompt  # noqa: E402
from rollkeep.engines.base import Capabilities, CompletionLimit, EpisodeTokenizer  # noqa: E402
from rollkeep.engines.hf import HFEngine  # noqa: E402
from rollkeep.envs import ENV_VERSION, EnvSpec  # noqa: E402
from rollkeep.models.chat import ChatTemplate, prompt_ids  # noqa: E402
from rollkeep.models.hf import greedy_texts  # noqa: E402
from rollkeep.trainers.batching import collate  # noqa: E402
from rollkeep.trainers.hf import HFTokenizer  # noqa: E402

PROMPT = "12+34="


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny-chat") / "model", n_positions=128)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def engine(model_dir, **kw) -> HFEngine:
    args = dict(model_path=str(model_dir), temperature=1.0, top_p=1.0, max_new_tokens=24, chat_template=True,
                max_batch_size=8, device="cpu")
    return HFEngine(**(args | kw))


def request(text: str = PROMPT, **kw) -> GenRequest:
    row = {"prompt": text, "answer": "46"}
    prompt = Prompt(key=(0, 0), group_id="g", idx=0, task="default", row=row, row_fingerprint=0, prompt=text)
    return GenRequest(group_id="g", generation=0, attempt=0, prompt=prompt, seed=5, pinned_version=None, **kw)


def generate(e: HFEngine, req: GenRequest) -> Completion:
    async def body():
        try:
            return await e.generate(req)
        finally:
            await e.close()
    return asyncio.run(body())


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def trained_positions(prompt: list[int], completion: list[int], versions) -> tuple[list[int], list[int]]:
    """The sequence positions whose token the loss trains on, and those tokens."""
    batch = collate([prompt], [completion], pad_id=0, versions=[versions])
    at = batch.loss_mask[0].nonzero()[:, 0].tolist()  # logits at t predict token t + 1
    return [t + 1 for t in at], batch.targets[0, at].tolist()


# ====================================================================== one turn


def test_a_completion_starts_right_after_the_generation_prompt_and_only_it_is_trained_on(model_dir, tok) -> None:
    c = generate(engine(model_dir), request())
    prompt = c.prompt_ids.tolist()
    assert prompt == ids(tok, "User: 12+34=\nAssistant:") == prompt_ids(tok, PROMPT)
    # the prompt ends with the generation prompt, the template's last tokens
    no_gen = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False)
    assert prompt[len(ids(tok, no_gen)):] == ids(tok, "Assistant:")
    assert len(c.completion_ids) and (c.versions >= 0).all()
    positions, targets = trained_positions(prompt, c.completion_ids.tolist(), c.versions.tolist())
    assert positions == list(range(len(prompt), len(prompt) + len(c.completion_ids)))
    assert targets == c.completion_ids.tolist()


def test_the_engine_the_warm_start_and_evaluation_encode_a_prompt_alike(model_dir, tok) -> None:
    engine_ids = generate(engine(model_dir, max_new_tokens=1), request()).prompt_ids.tolist()
    chat = ChatTemplate(tok)
    # the warm start: a one-turn demonstration (no environment turns) and the answer's target
    hf = HFTokenizer(tok)
    (context, target), = demonstration({"prompt": PROMPT, "answer": "46"}, episode_envs.CountEnv, hf, chat=chat)
    assert context == engine_ids and target == [*ids(tok, "46"), tok.eos_token_id]
    # held-out evaluation: what greedy decoding feeds the model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    fed = []
    model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"][0].tolist()), with_kwargs=True)
    greedy_texts(model, tok, [PROMPT], max_new_tokens=1, chat_template=True)
    assert fed[0] == engine_ids
    fed.clear()
    greedy_texts(model, tok, [PROMPT], max_new_tokens=1)  # the template off: the plain prompt
    assert fed[0] == tok.encode(PROMPT, add_special_tokens=True) != engine_ids


# ====================================================================== episodes


def episode(e, req: GenRequest, *, factory=episode_envs.CountEnv, recovery="replay", chat=True):
    spec = EnvSpec(factory, recovery, 3, 5.0, 1024, "count", max_turn_tokens=3, chat_template=chat)
    turns, code = [], UserCode()

    async def body():
        try:
            return await run_episode(e, spec, req, None, lambda t, k, s: turns.append((t, k, s)), code=code)
        finally:
            await e.close()
    try:
        completion, _ = asyncio.run(body())
    finally:
        code.close()
    return completion, turns


def runs(c: Completion) -> list[tuple[bool, list[int]]]:
    """The trajectory as runs of the model's tokens (True) and the environment's (False)."""
    out: list[tuple[bool, list[int]]] = []
    for t, v in zip(c.completion_ids.tolist(), c.versions.tolist(), strict=True):
        if out and out[-1][0] == (v >= 0):
            out[-1][1].append(t)
        else:
            out.append((v >= 0, [t]))
    return out


def test_an_hf_episode_renders_each_environment_turn_with_the_template_and_masks_it(model_dir, tok) -> None:
    """A random model: env.max_turn_tokens=3 cuts a turn it does not end with EOS itself, and
    then the template closes it (that `<eos>` is the template's, so the environment's)."""
    c, turns = episode(engine(model_dir, max_new_tokens=100), request())
    prompt, traj = c.prompt_ids.tolist(), c.completion_ids.tolist()
    assert [k for _, k, _ in turns] == [0, 1] and set(c.versions.tolist()) == {0, ENV_VERSION}
    parts = runs(c)
    assert [is_model for is_model, _ in parts] == [True, False, True, False, True]
    m = [t for is_model, t in parts if is_model]  # the model's three turns
    texts = [tok.decode(t, skip_special_tokens=True) for t in m]
    # The trajectory is the template's rendering of the conversation, turn by turn.
    conversation = [PROMPT, texts[0], "=1;", texts[1], "=2;"]
    rendered = ids(tok, tok.apply_chat_template(
        [{"role": "assistant" if i % 2 else "user", "content": x} for i, x in enumerate(conversation)],
        add_generation_prompt=True, tokenize=False))
    assert prompt + traj == rendered + m[2]
    for k, (turn, (_, response)) in enumerate(zip(m, parts[1::2], strict=False)):
        closed = "" if turn[-1] == tok.eos_token_id else "<eos>"  # the model's own EOS, or the template's
        assert tok.decode(response) == f"{closed}\nUser: ={k + 1}<unk>\nAssistant:"
    # The loss: exactly the model's tokens.
    positions, targets = trained_positions(prompt, traj, c.versions.tolist())
    assert positions == [len(prompt) + i for i in np.flatnonzero(c.versions >= 0)] and targets == sum(m, [])


class Scripted:
    """An engine whose model writes `turns[k]` and EOS as its turn k (continuing the prefix)."""

    name = "scripted"

    def __init__(self, tok, turns: list[str]) -> None:
        self.tok, self.turns = tok, turns
        self.capabilities = Capabilities(continues=True, episode_tokenizer=EpisodeTokenizer(tok),
                                         completion_limit=CompletionLimit(200, None))

    async def generate(self, req: GenRequest) -> Completion:
        p = req.prefix
        old = [] if p is None else p.completion_ids.tolist()
        new = [*ids(self.tok, self.turns[len(req.turns)]), self.tok.eos_token_id]
        v = [] if p is None else p.versions.tolist()
        return Completion(prompt_ids=np.asarray(prompt_ids(self.tok, req.prompt.prompt), np.int32),
                          completion_ids=np.asarray(old + new, np.int32),
                          logprobs=np.zeros(len(old) + len(new), np.float32),
                          versions=np.asarray(v + [3] * len(new), np.int32), finish_reason="stop", text="")

    async def close(self) -> None:
        pass


TURNS = ["7", "8", "9"]


def test_the_models_end_of_turn_is_its_own_and_the_template_around_a_response_is_the_environments(tok) -> None:
    c, _ = episode(Scripted(tok, TURNS), request())
    traj, eos = c.completion_ids.tolist(), tok.eos_token_id
    model = (c.versions >= 0).tolist()
    assert [(is_model, tok.decode(t, skip_special_tokens=False)) for is_model, t in runs(c)] == [
        (True, "7<eos>"), (False, "\nUser: =1<unk>\nAssistant:"), (True, "8<eos>"),
        (False, "\nUser: =2<unk>\nAssistant:"), (True, "9<eos>")]
    assert traj.count(eos) == 3 and all(model[i] for i, t in enumerate(traj) if t == eos)
    # The warm start demonstrates these turns with exactly the engine's contexts.
    hf = HFTokenizer(tok)
    examples = demonstration({"prompt": PROMPT, "turns": TURNS}, episode_envs.CountEnv, hf, chat=ChatTemplate(tok),
                             chat_responses=True)
    prompt = c.prompt_ids.tolist()
    ends = [i + 1 for i, t in enumerate(traj) if t == eos]
    for k, (context, target) in enumerate(examples):
        start = 0 if k == 0 else next(i for i in range(ends[k - 1], len(traj)) if model[i])
        assert context == prompt + traj[:start] and target == traj[start:ends[k]]


@pytest.mark.parametrize("factory, recovery", [(episode_envs.CountEnv, "replay"),
                                               (episode_envs.SnapCountEnv, "snapshot")])
def test_an_episode_with_the_template_continued_after_a_turn_ends_as_one_never_interrupted(tok, factory,
                                                                                         recovery) -> None:
    whole, turns = episode(Scripted(tok, TURNS), request(), factory=factory, recovery=recovery)
    for traj, _, snap in turns:
        ends = tuple(len(t) for t, _, _ in turns if len(t) <= len(traj))
        c, _ = episode(Scripted(tok, TURNS), request(prefix=traj, turns=ends, snapshot=snap), factory=factory,
                       recovery=recovery)
        assert np.array_equal(c.completion_ids, whole.completion_ids) and np.array_equal(c.versions, whole.versions)


# ====================================================================== templates that cannot be continued


@pytest.mark.parametrize("template, problem", [
    # numbers the conversation by its length: a longer one re-renders its start differently
    ("{{ messages | length }}:{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
     "{% if add_generation_prompt %}A:{% endif %}", "does not re-render the conversation"),
    # the assistant's turn without the EOS the model ends it with
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
     "{% if add_generation_prompt %}assistant:{% endif %}", "does not render the model's turn"),
])
def test_a_template_that_cannot_be_continued_token_by_token_is_refused(tok, template, problem) -> None:
    bad = SimpleNamespace(chat_template=template, eos_token_id=tok.eos_token_id, encode=tok.encode,
                          decode=tok.decode,
                          apply_chat_template=lambda msgs, **kw: tok.apply_chat_template(msgs, chat_template=template,
                                                                                         **kw))
    with pytest.raises(UserInputError, match=problem) as e:
        ChatTemplate(bad).probe()
    assert e.value.field == "data.chat_template" and e.value.remedy and e.value.found
    ChatTemplate(tok).probe()  # the tiny model's own template passes


def test_a_tokenizer_without_a_template_is_refused(tok) -> None:
    with pytest.raises(UserInputError, match="no chat template"):
        ChatTemplate(SimpleNamespace(chat_template=None, eos_token_id=2))

