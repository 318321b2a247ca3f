"""One attempt's awaits (the runner's `Dispatch`): the generation and its reward, or the
multi-turn episode, under the attempt's effect scope (`controller.effects`). It only waits;
what the attempt ends in is reported to the scheduler by the runner.

Only the engine's declared failures are failures (`classify`); anything else is a bug and
stops the run, never a silent retry. An attempt whose call to the outside decided
`effect_unknown` (or found its attempt gone) fails as data whatever its user code made of
the error.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..core.custody.events import DATA
from ..core.rollout.effects import REWARD_TURN
from ..core.schedule import Dispatch, Failure, Generated, Outcome, classify
from ..effects import bind as bind_effects
from .effects import Effects, run_key
from .episodes import run_episode
from .usercode import UserCode, UserStop, score

__all__ = ["Attempts"]


class Attempts:
    def __init__(self, cfg: Any, *, engine: Any, env: Any, sched: Any, code: UserCode, trace: Any, journal: Any,
                 leases: Any = None) -> None:
        self.cfg, self.engine, self.env, self.sched, self.code, self.leases = cfg, engine, env, sched, code, leases
        # The run's calls to the outside: their scopes, and what their records cost (the metrics).
        self.effects = Effects(sched, run=run_key(cfg.run_dir, cfg.seed), code=code,
                               max_result_bytes=cfg.effects.max_result_bytes, journal=journal, flush=trace.flush,
                               emit=trace.emit)
        self.reward_slots = asyncio.Semaphore(cfg.reward.max_concurrent)
        # Under reward.fns: each function's value for a sibling's last scored completion,
        # (group, generation) -> {name: value}; read (and forgotten) when its step trains.
        self.reward_parts: dict[tuple[str, int], dict[str, float | None]] = {}

    async def run(self, cmd: Dispatch) -> tuple[Outcome, list] | None:
        """(what the attempt ends in, the episode's environment if one was built), or None if
        user code stopped the run (UserStop: the stop abandons the attempt)."""
        req, key = cmd.request, cmd.key
        loop, sched = asyncio.get_running_loop(), self.sched
        progress = (lambda c: sched.on_progress(key, c, loop.time())) if cmd.stream else None
        effects = self.effects.scope(key, timeout=self.cfg.reward.timeout_s)
        bind_effects(effects)  # this task's context: its user code's `rollkeep.effects` calls are this attempt's
        built: list = []  # the episode's environment, once built
        try:
            if self.env is not None:  # a multi-turn episode: the environment gives the reward
                completion, reward = await run_episode(
                    self.engine, self.env, req, progress,
                    lambda traj, turn, snapshot: sched.on_turn(key, traj, turn, snapshot), code=self.code,
                    effects=effects, built=built, gate=None if self.leases is None else self.leases.gate(key))
            else:
                completion = await (self.engine.generate(req, progress) if progress is not None
                                    else self.engine.generate(req))
                effects.at(REWARD_TURN, self.cfg.reward.timeout_s)
                reward = await score(self.code, self.cfg.reward, req.prompt, completion, self.reward_slots,
                                     parts=lambda v: self.reward_parts.__setitem__((req.group_id, req.generation), v))
            outcome: Outcome = Generated(completion, reward, completion.replica)
        except UserStop:
            return None
        except Exception as e:
            if (failure := classify(e)) is None:
                raise
            outcome = failure
        if effects.failed is not None:  # whatever the user code made of it (it may have caught the error)
            outcome = Failure(DATA, effects.failed, getattr(outcome, "replica", 0))
        return outcome, built

    def reward_metrics(self, batch: Any) -> dict[str, float]:
        """`reward/<name>`: the mean of each `reward.fns` function over the batch's
        completions (those this process scored; a function's None is left out, and a
        function with no value in the batch has no metric that step)."""
        sums: dict[str, list[float]] = {}
        for group in batch.groups:
            for g in range(len(group.rows)):
                for name, v in self.reward_parts.pop((group.group_id, g), {}).items():
                    acc = sums.setdefault(name, [0.0, 0])
                    if v is not None:
                        acc[0] += v
                        acc[1] += 1
        return {f"reward/{name}": s / n for name, (s, n) in sums.items() if n}
