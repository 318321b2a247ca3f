"""User code, contained: the run's calls into reward functions (`reward.fn`), environments
(`env.factory` and its methods) and a custom trainer's `save` (docs/design.md §6).

    UserCode            the run's worker threads for user code: `await code.call(...)`
                        runs one call on a daemon thread within a deadline
    Overdue             raised out of `call` past its deadline (the call abandoned)
    UserStop            raised out of `call` when the code raised SystemExit or
                        KeyboardInterrupt: the attempt unwinds, the run stops (`on_stop`)
    score(...)          a completion's reward: `reward.fn` through `call`, within
                        `reward.timeout_s`; a built-in reward inline
    Stopped             why user code stopped the run; `.error(...)` is what `train` raises
    UserCodeError       exit 2: the user's code, not the data, is at fault
    call_sync           one call at start-up (building the sample environment), bounded alike
    guarded_save        a custom trainer's `save`, its failures named (exit 2)
    guarded_step        a custom trainer's `train_step`, the same

Why threads of its own. User code may never return (a sandbox that does not answer, a
`while True`), and a deadline cannot stop a thread. So a call that misses its deadline
is *abandoned*: its thread is left to finish or hang, never waited for (it is a daemon:
the interpreter does not join it at exit), and the next call gets another thread. The
loop's shared default executor could not do this: a hung call would hold one of its few
threads for good, and every later call (the trainer's step and the checkpoint writer
too) would queue behind it. A pure-Python busy loop gives up the GIL every 5 ms
(`sys.getswitchinterval`), so it slows the run but cannot stop it; a C extension that
never releases the GIL cannot be abandoned by any thread (only a process boundary could
stop it). At most `MAX_HUNG` abandoned calls may be still running at once: past that the
run stops, as for a signal (final checkpoint), and `train` raises UserCodeError (exit 2),
so a leak of hung threads cannot grow without limit.

What a call's outcome means: a result is returned; an Exception is raised as itself (the
caller makes it a data failure of the attempt); Overdue past the deadline; SystemExit
or KeyboardInterrupt ("stop the process", which a library calling `sys.exit` says) calls
`on_stop` and raises UserStop, and the run stops gracefully with exit 2. (A real Ctrl-C
never reaches a worker thread: Python delivers signals to the main thread, where the
loop's handler turns them into a graceful stop.)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import RollkeepError, UserInputError
from ..core.rollout.generation import DataError

__all__ = ["MAX_HUNG", "Overdue", "Stopped", "UserCode", "UserCodeError", "UserStop", "call_sync",
           "failed_alike", "guarded_save", "guarded_step", "score", "shown"]

MAX_HUNG = 64  # abandoned calls still running at once before the run stops (exit 2)

_PENDING, _RUNNING, _DONE, _ABANDONED = "pending", "running", "done", "abandoned"


class UserCodeError(UserInputError):
    """The user's code (a reward function, an environment, a custom trainer) misbehaved in a
    way no retry can fix; exit 2. What the run had written stays as it was."""


class Overdue(Exception):
    """A call past its deadline; its thread was abandoned. (Not TimeoutError: the user's
    code may raise that itself, and that is an ordinary failure of the call.)"""


class UserStop(BaseException):
    """User code raised SystemExit or KeyboardInterrupt. A BaseException, like
    CancelledError, so that no `except Exception` turns it into a data failure: it unwinds
    the attempt, which reports nothing (the stop abandons it)."""


@dataclass(frozen=True)
class Stopped:
    """Why user code stopped the run: `what` says it, `expected` and `remedy` for the error."""

    what: str
    expected: str
    remedy: str

    def error(self, step: int, checkpoint: str | None) -> UserCodeError:
        where = (f"checkpoint {checkpoint} (LATEST) stands: the same command resumes from it once the code is fixed"
                 if checkpoint else "no checkpoint was written: the same command starts the run again")
        return UserCodeError(f"{self.what}, so the run stopped at step {step}", expected=self.expected,
                             remedy=f"{self.remedy}; {where}")


def shown(e: BaseException) -> str:
    """`SystemExit(7)`, `KeyboardInterrupt()`: the exception as one would raise it."""
    return f"{type(e).__name__}({', '.join(repr(a) for a in e.args)[:200]})"


def _asked_to_stop(who: str, e: BaseException) -> Stopped:
    return Stopped(f"{who} raised {shown(e)}: user code asked the process to stop",
                   expected="user code that returns, or raises an Exception (a data failure of that attempt, "
                   "retried within rollout.max_data_attempts); SystemExit and KeyboardInterrupt stop the run",
                   remedy=f"fix {who} (a library that calls sys.exit on an error: catch SystemExit around it "
                   "and raise an ordinary exception)")


def fail_fast_stop(sched: Any) -> Stopped | None:
    """What stopped the run if the scheduler's fail-fast tripped (`failed_alike`), else None."""
    return None if sched.user_code_failure is None else failed_alike(sched.fail_fast.n, sched.user_code_failure)


def failed_alike(n: int, error: str) -> Stopped:
    """The core's fail-fast tripped (core/schedule/failfast.py): the run's first `n` attempts
    all failed with `error`, which names the user's function and its exception."""
    return Stopped(f"the first {n} attempts of the run all failed with the same error: {error}; "
                   "no prompt was dropped",
                   expected="user code that works on at least some rows (a failure on some rows only is a data "
                   "failure: retried within rollout.max_data_attempts, then dropped)",
                   remedy="fix the function (rollout.fail_fast_attempts=0 turns this check off)")


class _Job:
    __slots__ = ("args", "context", "fn", "fut", "loop", "state")

    def __init__(self, fn: Callable[..., Any], args: tuple, loop: asyncio.AbstractEventLoop,
                 fut: asyncio.Future) -> None:
        self.fn, self.args, self.loop, self.fut = fn, args, loop, fut
        # The caller's context variables (the attempt's `rollkeep.effects` scope) go with the call.
        self.context = contextvars.copy_context()
        self.state = _PENDING


class UserCode:
    """Daemon worker threads for one run's user code. Each call takes an idle worker or
    starts one, so a call starts at once (its deadline is its own, never a queue's); a
    worker whose call was abandoned ends with that call, whenever it ends. `close()` ends
    the idle ones (the run is over); abandoned ones are never waited for."""

    def __init__(self, on_stop: Callable[[Stopped], None] | None = None, *, max_hung: int = MAX_HUNG) -> None:
        self.on_stop, self.max_hung = on_stop, max_hung
        self._lock = threading.Lock()
        self._queue: list[_Job | None] = []  # guarded by _ready (its lock is _lock)
        self._ready = threading.Condition(self._lock)
        self._idle = 0  # workers waiting for a job and not yet claimed by one
        self._hung = 0  # abandoned calls still running
        self._stopped = False  # on_stop was called (once per run)
        self._closed = False
        self._started = 0  # worker threads started (tests read it)

    @property
    def hung(self) -> int:
        return self._hung

    async def call(self, who: str, timeout: float, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a worker thread, within `timeout` seconds (Overdue past it; a
        cancelled call is abandoned too). `who` names the code for a stop's message."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop, loop.create_future())
        self._submit(job)
        try:
            async with asyncio.timeout(timeout):
                ok, value = await job.fut
        except TimeoutError:  # (only the deadline's: the call's own errors come as values)
            self._abandon(job, who)
            raise Overdue(f"{who} took longer than {timeout:g} s") from None
        except BaseException:  # the attempt was cancelled: nobody waits for the call now
            self._abandon(job, who)
            raise
        if ok:
            return value
        if isinstance(value, SystemExit | KeyboardInterrupt):
            self._stop(_asked_to_stop(who, value))
            raise UserStop(f"{who} raised {shown(value)}") from None
        if isinstance(value, Exception):
            raise value
        raise RuntimeError(shown(value)) from None  # another BaseException (GeneratorExit, ...)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.extend([None] * self._idle)  # one sentinel per idle worker
            self._idle = 0
            self._ready.notify_all()

    # ------------------------------------------------------------------ threads

    def _submit(self, job: _Job) -> None:
        with self._lock:
            self._queue.append(job)
            if self._idle:
                self._idle -= 1  # that worker is this job's
                self._ready.notify()
                return
            self._started += 1
            n = self._started
        threading.Thread(target=self._work, name=f"rollkeep-user-code-{n}", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._ready.wait()
                job = self._queue.pop(0)
                if job is None:
                    return
                if job.state == _ABANDONED:  # abandoned before it started: nothing ran
                    self._idle += 1
                    continue
                job.state = _RUNNING
            try:
                outcome = (True, job.context.run(job.fn, *job.args))
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: the loop decides
                outcome = (False, e)
            with self._lock:
                if job.state == _ABANDONED:
                    self._hung -= 1
                    return  # this thread was replaced when its call was abandoned
                job.state = _DONE
                closed = self._closed
                if not closed:
                    self._idle += 1
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                job.loop.call_soon_threadsafe(_deliver, job.fut, outcome)
            if closed:
                return
            del job, outcome  # drop the references while idle

    def _abandon(self, job: _Job, who: str) -> None:
        with self._lock:
            if job.state == _DONE:
                return  # it finished as the deadline passed: its worker is idle again
            running = job.state == _RUNNING
            job.state = _ABANDONED
            if running:
                self._hung += 1
            hung = self._hung
        if running and hung >= self.max_hung:
            self._stop(Stopped(
                f"{hung} calls of user code are still running past their deadlines (the latest: {who})",
                expected="every environment and reward call to return or raise within its deadline (env.timeout_s, "
                "reward.timeout_s, rollout.timeout_s); a call past it is abandoned and its thread left running, at "
                f"most {self.max_hung} at once",
                remedy=f"fix what hangs in {who} (give the calls it waits on a timeout of their own)"))

    def _stop(self, why: Stopped) -> None:
        if not self._stopped and self.on_stop is not None:
            self._stopped = True
            self.on_stop(why)


def _deliver(fut: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    if not fut.done():
        fut.set_result(outcome)


def call_sync(timeout: float, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a daemon thread, waited for at most `timeout` seconds (for start-up,
    before any loop runs). Returns its result; raises TimeoutError past the deadline (the
    thread abandoned), an Exception it raised as itself, and UserStop("SystemExit(7)") for
    SystemExit or KeyboardInterrupt (a real Ctrl-C while waiting stays KeyboardInterrupt)."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn(*args)))
        except BaseException as e:
            box.append((False, e))

    t = threading.Thread(target=run, name="rollkeep-user-code-start", daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"no result within {timeout:g} s")
    ok, value = box[0]
    if ok:
        return value
    if isinstance(value, Exception):
        raise value
    raise UserStop(shown(value)) from None


def guarded_save(save: Callable[[Path], None], trainer: Any, step: int) -> Callable[[Path], None]:
    """A trainer snapshot's `save`; a custom trainer's (`trainer`: the config's section) is
    the user's code, and its own failure a UserCodeError (exit 2) rather than a traceback.
    A full disk stays a filesystem error (exit 5) and rollkeep's own errors stay themselves;
    the store undoes the unpublished checkpoint on any of them. A built-in trainer's save
    is rollkeep's: an error in it is a bug, and stays one."""
    return _guarded(save, trainer, f"save the checkpoint of step {step}",
                    "its snapshot's save(dir) to write the trainer's files into dir (or raise OSError for a "
                    "failing disk)", f"fix the trainer's save(); nothing of step {step} was published and the "
                    "previous checkpoint stands: the same command resumes from it")


def guarded_step(train_step: Callable[[Any], dict], trainer: Any, step: int) -> Callable[[Any], dict]:
    """A trainer's `train_step` for step `step`, guarded as `guarded_save` is: a custom
    trainer's failure is a UserCodeError (exit 2); the last checkpoint and the journal
    stand, so the same command resumes once the trainer is fixed."""
    return _guarded(train_step, trainer, f"take step {step} (train_step)",
                    "train_step(batch) to return its metrics (or raise OSError for a failing disk)",
                    "fix the trainer's train_step(); the same command resumes from the last checkpoint "
                    "and the journal")


def _guarded(fn: Callable[..., Any], trainer: Any, what: str, expected: str, remedy: str) -> Callable[..., Any]:
    if trainer.name != "custom":
        return fn
    factory = trainer.factory

    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except (OSError, RollkeepError):
            raise
        except BaseException as e:  # SystemExit too: on a worker thread it would end nothing cleanly
            raise UserCodeError(
                f"the custom trainer {factory} failed to {what}", field="trainer.factory", expected=expected,
                found=f"{type(e).__name__}: {e}"[:500], remedy=remedy) from None

    return run


async def score(code: UserCode, reward: Any, prompt: Any, completion: Any,
                slots: asyncio.Semaphore | None = None,
                parts: Callable[[dict[str, float | None]], None] | None = None) -> float:
    """The reward of a single-turn completion (`reward` is the config's `reward` section,
    `prompt` the attempt's): the row's `reward.fn` within `reward.timeout_s`, at most
    `reward.max_concurrent` at once (`slots`) -- awaited on the loop if it is `async def`,
    else on a worker thread; a built-in reward (rollkeep's own code, cheap and total)
    inline. Under `reward.fns`, each of its functions so, one after the other, and their
    weighted sum; `parts(values)` gets each one's value (its metric). A failure is a
    DataError of the attempt naming the function; UserStop passes through."""
    from ..tasks import reward_fn
    from ..tasks.weighted import Weighted

    label = reward.fn if reward.fn is None or isinstance(reward.fn, str) else reward.fn.get(prompt.task)
    fn = None
    try:
        fn = reward_fn(prompt.task)  # `reward.fn`'s for the task if it names one (label), else the built-in
        if isinstance(fn, Weighted):
            async with slots if slots is not None else contextlib.nullcontext():
                values: dict[str, float | None] = {}
                for part in fn.parts:
                    label = part.spec
                    values[part.name] = part.value(await _user_call(code, reward, label, part.is_async, part.call,
                                                                    completion.text, prompt.row))
            if parts is not None:
                parts(values)
            return fn.total(values)
        if label is None:
            return float(fn(completion.text, prompt.row))
        async with slots if slots is not None else contextlib.nullcontext():
            value = float(await _user_call(code, reward, label, inspect.iscoroutinefunction(fn), fn, completion.text,
                                           prompt.row))
        if math.isfinite(value):
            return value
        why = f"reward function {label} returned {value}, not a finite number"  # (the core refuses it anyway)
    except Overdue:
        why = f"reward function {label} took longer than reward.timeout_s={reward.timeout_s:g} s"
    except Exception as e:  # a reward function's error is a data failure (docs/design.md §6)
        who = label or (f"{fn.__module__}:{fn.__qualname__}" if fn is not None else "of the row's task")
        why = f"reward function {who} raised {type(e).__name__}: {e}"
    err = DataError(why)
    err.replica = completion.replica
    raise err


async def _user_call(code: UserCode, reward: Any, label: str, is_async: bool, fn: Callable[..., Any],
                     *args: Any) -> Any:
    """One call of a user's reward function within reward.timeout_s: awaited on the loop if
    it is `async def`, else on a worker thread (`code.call`); Overdue past the deadline."""
    if is_async:
        try:
            async with asyncio.timeout(reward.timeout_s):
                return await fn(*args)
        except TimeoutError:
            raise Overdue() from None
    return await code.call(f"reward function {label}", reward.timeout_s, fn, *args)
