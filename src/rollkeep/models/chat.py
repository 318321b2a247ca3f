"""A model tokenizer's chat template, as rollkeep renders prompts and episodes with it
(`data.chat_template`; `engine.chat_template` renders the prompt alone).

The prompt. A prompt is the conversation [user: prompt] rendered with the generation
prompt and encoded without special tokens (the template writes its own): `prompt_ids`.
Every path that encodes a prompt with the template on goes through it: the hf engine, the
remote engine's tokenizer, the warm start's examples and held-out evaluation
(`models.hf.greedy_texts`), so the policy is trained and evaluated on the prompt it
generates from.

An episode. With `data.chat_template` a multi-turn episode is a conversation: the prompt
(role `user`), then alternately the model's turns (role `assistant`, each its text as
decoded) and the environment's responses (role `user`: a `Step.response` is plain text
for the other side of the conversation). What follows the model's turn k in the
trajectory is a difference of two renders of it, so any template works that renders a
conversation's prefix the same way every time:

    before = render(conversation through response k-1, generation prompt)   turn k's context
    after  = render(conversation through response k, generation prompt)
    tokens(after) must start with tokens(before)                             the prefix property
    new    = tokens(after)[len(tokens(before)):], which must start with the model's tokens of
             turn k as it generated them (its text and the end-of-turn token it wrote)
    the response's tokens = the rest of `new`

that is: what the template writes after the model's end of turn (the newline after
`<|im_end|>`; the end-of-turn token itself when a length cap cut the turn), the response
as a chat turn with its role markers, and the generation prompt of the next assistant
turn. All of them are environment tokens (ENV_VERSION: context, masked out of the loss);
the model's tokens, its end-of-turn token included, are the completion's. (When the model
wrote its turn in other tokens than the tokenizer would, the two are compared as text and
the rest is encoded on its own.)

A template that does not re-render a conversation's prefix identically (one that strips
the reasoning of earlier turns, or numbers turns from the end), or renders the model's
turn otherwise than the model wrote it (trims it, closes it with another token than the
tokenizer's EOS), cannot be continued token by token. `ChatTemplate.probe` refuses it at
start-up on a sample conversation (UserInputError, exit 2); an episode that meets it
anyway is a data failure of its attempt (`ChatTemplateError`, a DataError) that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.errors import UserInputError
from ..core.rollout.generation import DataError

__all__ = ["ChatTemplate", "ChatTemplateError", "chat_episodes", "prompt_ids"]

FIELD = "data.chat_template"
ENV_ROLE = "user"  # the role of an environment's response
_SENTINEL = "\u27e8rollkeep-response\u27e9"  # stands in for a response whose text is sought (`response_text`)
_PROBE = ("What is 2+3?", "5", "Right. And 4+4?", "8", "Right.")  # prompt, turn, response, turn, response


class ChatTemplateError(DataError):
    """The template cannot render this conversation so that it continues token by token."""

    def __init__(self, what: str, found: str) -> None:
        super().__init__(f"chat template: {what}; found {found} (data.chat_template needs a template that "
                         "renders a conversation's prefix the same way every time and the model's turn as "
                         "the model wrote it)")
        self.what, self.found = what, found


def messages(conversation: Sequence[str]) -> list[dict[str, str]]:
    """The prompt, then the model's turns (assistant) and the environment's responses, alternately."""
    return [{"role": "assistant" if i % 2 else (ENV_ROLE if i else "user"), "content": str(text)}
            for i, text in enumerate(conversation)]


def prompt_ids(tok: Any, prompt: str) -> list[int]:
    """The prompt rendered as the conversation [user: prompt] with the generation prompt,
    encoded without special tokens (the template writes its own)."""
    text = tok.apply_chat_template(messages([prompt]), add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


class ChatTemplate:
    """A transformers tokenizer with a chat template: prompts (`prompt_ids`) and, as an
    episode's tokenizer, environment responses rendered as chat turns (`response_ids`,
    `response_text`); `encode`/`decode` as `engines.base.EpisodeTokenizer`'s."""

    def __init__(self, tok: Any, *, field: str = FIELD) -> None:
        if getattr(tok, "chat_template", None) is None:
            raise UserInputError(
                f"{field} is true but the model's tokenizer has no chat template", field=field,
                expected="a tokenizer with a chat template (`chat_template` in tokenizer_config.json, or "
                "chat_template.jinja)", found="none",
                remedy=f"set {field}=false, or add a chat template to the tokenizer")
        self.tok = tok
        self.eos_id = tok.eos_token_id

    # ------------------------------------------------------------ the episode tokenizer's part

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=bos))

    def decode(self, ids: Any) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    # ------------------------------------------------------------ rendering

    def render(self, conversation: Sequence[str], *, generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(messages(conversation), add_generation_prompt=generation_prompt,
                                            tokenize=False)

    def prompt_ids(self, prompt: str) -> list[int]:
        return prompt_ids(self.tok, prompt)

    def response_ids(self, conversation: Sequence[str], model_ids: Sequence[int], response: str) -> list[int]:
        """The tokens after the model's turn: `conversation` is the prompt, then the model's
        turns and the responses alternately, ending with the model's turn, whose tokens are
        `model_ids`; `response` is the environment's answer to it (module docstring)."""
        before, after = self._renders(conversation, response)
        head, tail = self.encode(before), self.encode(after)
        if tail[: len(head)] != head:
            at = next((i for i, (a, b) in enumerate(zip(head, tail, strict=False)) if a != b), len(tail))
            raise ChatTemplateError(
                f"the tokens of the conversation through turn {len(conversation) // 2} are not a prefix of "
                "the tokens of the conversation one response longer (the tokenizer merges across the turn "
                "boundary)", f"a difference at token {at} of {len(head)}")
        new, model = tail[len(head):], [int(t) for t in model_ids]
        if new[: len(model)] == model:
            return new[len(model):]
        return self.encode(self._after_model(after[len(before):], model, conversation))

    def response_text(self, conversation: Sequence[str], model_ids: Sequence[int], recorded: Sequence[int]) -> str:
        """The response whose tokens (`response_ids`) are `recorded`, after the model's turn
        `model_ids` of `conversation`: for a restored episode, whose responses are known
        only as tokens. ChatTemplateError when no response renders to exactly them."""
        before, after = self._renders(conversation, _SENTINEL)
        rest = self._after_model(after[len(before):], [int(t) for t in model_ids], conversation)
        lead, _, trail = rest.partition(_SENTINEL)
        text = self.tok.decode([int(t) for t in recorded], skip_special_tokens=False)
        if _SENTINEL in rest and text.startswith(lead) and text.endswith(trail) \
                and len(text) >= len(lead) + len(trail):
            content = text[len(lead): len(text) - len(trail)]
            if self.response_ids(conversation, model_ids, content) == [int(t) for t in recorded]:
                return content
        raise ChatTemplateError(f"the recorded tokens after turn {len(conversation) // 2 - 1} are no response "
                                "rendered with this template (was the episode recorded with another one?)",
                                f"{text[:120]!r}")

    def probe(self, *, field: str = FIELD) -> None:
        """Refuse (UserInputError) a template that cannot be continued token by token, on a
        sample conversation of two turns, each ending with the tokenizer's EOS."""
        def turn(text: str) -> list[int]:
            return self.encode(text) + ([] if self.eos_id is None else [self.eos_id])

        try:
            for k in (2, 4):
                self.response_ids(_PROBE[:k], turn(_PROBE[k - 1]), _PROBE[k])
        except ChatTemplateError as e:
            raise UserInputError(
                f"{field} is true but the tokenizer's chat template cannot render a multi-turn episode "
                f"token by token: {e.what}", field=field,
                expected="a template that renders a conversation's prefix the same way every time, and "
                "the assistant's turn as the model writes it (its text, then the tokenizer's EOS)",
                found=e.found, remedy=f"fix the template, or set {field}=false (engine.chat_template "
                "renders the prompt alone)") from None

    # ------------------------------------------------------------ internals

    def _renders(self, conversation: Sequence[str], response: str) -> tuple[str, str]:
        if not conversation or len(conversation) % 2:
            raise ValueError(f"a conversation ends with the model's turn; got {len(conversation)} texts")
        before = self.render(conversation[:-1])
        after = self.render([*conversation, response])
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), len(after))
            raise ChatTemplateError(
                f"the template does not re-render the conversation through turn {len(conversation) // 2 - 1}'s "
                "context identically once a turn and a response are added (it rewrites earlier turns)",
                f"{before[at:at + 40]!r} re-rendered as {after[at:at + 40]!r} at character {at}")
        return before, after

    def _after_model(self, part: str, model: list[int], conversation: Sequence[str]) -> str:
        """`part` (what the template adds after turn k's context) less the model's turn, as text."""
        written = self.tok.decode(model, skip_special_tokens=False)
        if not part.startswith(written):
            raise ChatTemplateError(
                f"the template does not render the model's turn {len(conversation) // 2 - 1} as the model wrote "
                "it (it trims or rewrites it, or ends it with another token than the tokenizer's EOS)",
                f"{written[:60]!r} rendered as {part[: max(len(written), 20) + 20]!r}")
        return part[len(written):]


def chat_episodes(episode_tokenizer: Any, *, engine: str) -> ChatTemplate:
    """The engine's episode tokenizer (`engines.base.EpisodeTokenizer`, over a transformers
    tokenizer) rendering responses with the chat template."""
    tok = getattr(episode_tokenizer, "tok", None)
    if tok is None or not hasattr(tok, "apply_chat_template"):
        raise UserInputError(
            f"{FIELD} is true but engine {engine} has no Hugging Face tokenizer to render episodes with",
            field=FIELD, expected="engine.name hf, vllm or remote", found=f"engine.name {engine}",
            remedy=f"set {FIELD}=false, or use a Hugging Face model")
    return ChatTemplate(tok)
