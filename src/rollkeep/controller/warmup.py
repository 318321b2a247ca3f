"""The supervised warm start: `warmup.sft_steps` steps of cross-entropy on the dataset's
answers before RL, so the policy starts with some signal.

It is its own checkpointed phase, in `RUN_DIR/warmup/checkpoints` (same store, same
atomic publication): a run killed during warmup resumes it; a run killed during RL before
its first checkpoint starts RL again from the finished warmup; once RL has a checkpoint
(which holds the trainer state) warmup is never looked at again. Batches are a pure
function of (seed, step), so a resumed warmup ends with the same weights.

Every step logs its loss to the run's metrics (`MetricsLog.write_warmup`: `warmup/step`,
`warmup/loss`, `warmup/seconds`, ...), on lines of their own that no RL reader takes for
a step.

With an environment (`make_env`), a row's `turns` is its demonstration: the model's turn
texts of one episode. Running a fresh environment through them gives each turn's context
(`demonstration`), and every turn is an SFT example: the prompt, the earlier turns and
the environment's responses as context, the turn (and EOS) as target. A step samples
`sft_batch_size` rows, as without an environment, and trains on all of their turns. A row
without `turns` is the one-turn demonstration of its `answer`. The environments are the
run's bounded ones (`episodes.bounded`: each call within env.timeout_s); one that fails on
a demonstration is the user's code at fault, UserCodeError (exit 2) naming the row.

With the chat template on (`chat`, a `models.chat.ChatTemplate`: `data.chat_template` or
`engine.chat_template`) the prompt is the engine's, rendered by the template; with
`data.chat_template` every response joins the context as the engine's episodes render it
(`ChatTemplate.response_ids`), so an example is token for token the trajectory the
engine would have given the demonstrated turns.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ADDED_KEYS, Config, semantic
from ..core.checkpoint.cut import TRAINER_DIR
from ..core.checkpoint.store import CheckpointStore
from ..core.errors import CheckpointError, ConfigError, DatasetError
from ..core.restore.configdiff import check_compatible
from ..core.rollout.datasets import Dataset
from ..core.rollout.generation import DataError
from .metrics import MetricsLog
from .usercode import UserCodeError


@contextlib.contextmanager
def _graceful_signals() -> Iterator[list[str]]:
    """SIGINT/SIGTERM during the warm start only note the signal (the list it yields); the
    loop checkpoints and returns at the end of the step, as the RL phase does. The previous
    handlers come back however the warm start ends."""
    got: list[str] = []
    previous = {}

    def note(sig: int, _frame: object) -> None:
        got.append(signal.Signals(sig).name)

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: signals stay as they are
                previous[sig] = signal.signal(sig, note)
        yield got
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_warmup(cfg: Config, *, dataset: Dataset, trainer: Any, tokenizer: Any, log=print,
               metrics: Callable[[], MetricsLog] | None = None,
               make_env: Callable[[], Any] | None = None, chat: Any = None) -> tuple[int, str | None]:
    """Run the warm start (or resume it). Call only before RL has a checkpoint. Returns the
    warm-start step reached and the signal that stopped it (None when it finished); a
    stopped warm start has checkpointed that step. `metrics` opens the log its steps are
    written to (called only when a step is left to take; closed when the warm start ends).
    `make_env` (a fresh Environment per call): rows are multi-turn demonstrations; `chat`:
    the chat template prompts are rendered with (module docstring)."""
    steps = cfg.warmup.sft_steps
    run_dir = Path(cfg.run_dir)
    if steps == 0:
        if hasattr(trainer, "set_reference"):
            trainer.set_reference()
        return 0, None
    if not hasattr(trainer, "sft_step"):
        raise ConfigError(
            f"warmup.sft_steps is {steps} but the {trainer.name} trainer has no supervised step",
            field="warmup.sft_steps",
            expected="0, or a trainer that supports it (torch, hf)",
            found=str(steps),
            remedy="set warmup.sft_steps=0",
        )
    need = ("answer",) if make_env is None else ("turns", "answer")  # with an env: a demonstration
    missing = [i for i in range(len(dataset)) if not any(k in dataset[i] for k in need)]
    if missing:
        fields, what = ("an `answer`", "answers") if make_env is None else ("a `turns` or `answer`",
                                                                          "demonstrations (`turns`)")
        raise ConfigError(
            f"warmup needs {fields} field in every row; {len(missing)} row(s) have none (e.g. row {missing[0]})",
            field="warmup.sft_steps",
            expected=f"rows with {fields[fields.index('`'):]}",
            found=f"{len(missing)} row(s) without",
            remedy=f"add {what} to the dataset or set warmup.sft_steps=0",
        )
    store = CheckpointStore(run_dir / "warmup" / "checkpoints")
    store.cleanup_tmp()
    done = 0
    if store.latest() is not None:
        ck = store.open()
        check_compatible(ck.meta.config, semantic(cfg), path=str(ck.path / "MANIFEST.json"),
                         added=ADDED_KEYS)
        trainer.load(ck.path / TRAINER_DIR, step=0)  # verified by `open`; the warm start takes no RL step
        done = ck.meta.step
        if getattr(trainer, "sft_steps", done) != done:  # the trainer file is of another step
            raise CheckpointError(
                f"warm-start checkpoint {ck.name} holds trainer state of another step",
                path=str(ck.path),
                field="sft_steps",
                expected=f"{done} supervised steps",
                found=f"{trainer.sft_steps}",
                remedy=f"remove {store.root} to redo the warm start (RL has not started yet)",
            )
        log(f"warmup: resumed from {ck.name}")
    opened = metrics() if metrics is not None and done < steps else None
    with contextlib.closing(opened) if opened is not None else contextlib.nullcontext():
        with _graceful_signals() as stopped_by:
            step = _train(cfg, store, done, stopped_by, dataset=dataset, trainer=trainer, tokenizer=tokenizer,
                          log=log, metrics=opened, make_env=make_env, chat=chat)
    if stopped_by:
        return step, stopped_by[0]
    trainer.set_reference()
    return steps, None


def demonstration(row: Any, make_env: Callable[[], Any], tokenizer: Any, *, seed: int = 0,
                  where: str = "row", chat: Any = None,
                  chat_responses: bool = False) -> list[tuple[list[int], list[int]]]:
    """The SFT examples of one row's demonstration: for turn k, (prompt + turns < k with
    EOS + the environment's responses to them, turn k + EOS), token ids. The environment
    is reset with `seed` and must not end the episode before the last turn (a
    DatasetError names the row, `where`, and the turn). `chat`: the prompt is rendered with
    its template; `chat_responses` (data.chat_template): the responses too, as chat turns."""
    turns = [str(t) for t in row["turns"]] if "turns" in row else [str(row["answer"])]
    if not turns:
        raise DatasetError(f"warmup: {where} has an empty `turns` demonstration", field="turns",
                             expected="at least one turn", found="[]",
                             remedy="give the row its turns or drop `turns` to use its `answer`")
    try:
        env = make_env()
        env.reset(row, seed)
    except DataError as e:
        raise _failed(e, where, "the reset") from None
    context = tokenizer.encode(str(row["prompt"])) if chat is None else chat.prompt_ids(str(row["prompt"]))
    conversation = [str(row["prompt"])]  # as the episode's chat template sees it
    out = []
    for k, turn in enumerate(turns):
        target = tokenizer.encode(turn, bos=False) + [tokenizer.eos_id]
        out.append((list(context), target))
        if k == len(turns) - 1:
            break
        try:
            step = env.step(turn)
        except DataError as e:
            raise _failed(e, where, f"turn {k + 1}") from None
        if step.done:
            raise DatasetError(
                f"warmup: the environment ended the demonstration of {where} at turn {k + 1} of {len(turns)}",
                field="turns", expected=f"an episode of {len(turns)} turns", found=f"done after turn {k + 1} {turn!r}",
                remedy="fix the row's `turns` (every turn but the last must get a response)",
            )
        if chat_responses:
            conversation.append(tokenizer.decode(target))  # the turn as the engine's episodes decode it
            try:
                response = chat.response_ids(conversation, target, step.response)
            except DataError as e:
                raise DatasetError(f"warmup: the demonstration of {where} does not render with the chat template "
                                   f"at turn {k + 1}: {e}", field="turns", expected="a conversation the template "
                                   "renders token by token", found=f"turn {turn!r}, response {step.response!r}",
                                   remedy="fix the row's `turns`, or the template (data.chat_template)") from None
            conversation.append(step.response)
        else:
            response = tokenizer.encode(step.response, bos=False)
        context += target + response
    return out


def _failed(e: DataError, where: str, what: str) -> UserCodeError:
    return UserCodeError(
        f"warmup: the environment failed on the demonstration of {where} ({what})", field="env",
        expected="reset and step to return within env.timeout_s, a step a Step within env.max_response_bytes",
        found=str(e), remedy="fix the environment (or the row's `turns`), or raise env.timeout_s")


def _train(cfg: Config, store: CheckpointStore, done: int, stopped_by: list[str], *, dataset: Dataset,
           trainer: Any, tokenizer: Any, log, metrics: MetricsLog | None,
           make_env: Callable[[], Any] | None = None, chat: Any = None) -> int:
    """Supervised steps `done + 1 ..`, each checkpointed on schedule, the last one and the
    one a signal stopped after always. Returns the last step taken."""
    steps = cfg.warmup.sft_steps
    step = done
    t0 = time.perf_counter()
    for step in range(done + 1, steps + 1):
        rng = np.random.default_rng([cfg.seed, 0x5F7, step])
        idx = rng.integers(0, len(dataset), cfg.warmup.sft_batch_size)
        if make_env is None:
            seqs = [
                (tokenizer.encode(dataset[int(i)]["prompt"]) if chat is None
                 else chat.prompt_ids(str(dataset[int(i)]["prompt"])),
                 tokenizer.encode(str(dataset[int(i)]["answer"]), bos=False) + [tokenizer.eos_id])
                for i in idx
            ]
        else:  # a row's every turn: sft_batch_size counts rows
            seqs = [ex for i in idx for ex in demonstration(dataset[int(i)], make_env, tokenizer,
                                                             seed=cfg.seed, where=f"row {int(i)}", chat=chat,
                                                             chat_responses=cfg.data.chat_template)]
        result = trainer.sft_step(seqs, lr=cfg.warmup.sft_lr)
        if step % cfg.checkpoint.warmup_every_steps == 0 or step == steps or stopped_by:
            store.publish(step, {}, {"phase": "warmup", "config": semantic(cfg)}, keep_last=1,
                          saved={TRAINER_DIR: trainer.snapshot().save})
            log(f"warmup: step {step}/{steps}, loss {result['loss']:.3f}, "
                f"{(step - done) / (time.perf_counter() - t0):.1f} steps/s")
        if metrics is not None:  # seconds: this process's warm start so far, its checkpoint included
            metrics.write_warmup(step, {"warmup/seconds": time.perf_counter() - t0,
                                        **{f"warmup/{k}": float(v) for k, v in result.items()}})
        if stopped_by:
            break
    return step
