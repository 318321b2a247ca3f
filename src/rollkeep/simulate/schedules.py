"""Random schedules of whole runs, and the check of each (`rollkeep simulate`).

A schedule is a `Plan` drawn from its seed: a small run (a few steps of a few groups) with
every sampler x recovery mode x deterministic on/off, random latencies, infra and data
failures and hangs past the deadline, random checkpoint cadence and retention, disk faults,
and 0-3 crashes -- at a random ledger event or at the n-th hit of a named crash point (the
first schedules walk through every point in turn, the journal's and the row log's flushes
among them), each a kill or a power cut; the journal on in most schedules, off in the
rest; calls to the outside (a judge, `simulate.effects`) in half of them, of either policy,
with one more crash at an effect's event in half of those. After the run: exactly-once
from the trace and the final checkpoint, the restore chain and audit on it, the effects'
invariant (each key called once but where a lost outcome allows a resend, every reward the
judge's), and in deterministic mode the same trainer digest as the same plan run without
crashes or faults. A violation is shrunk to the fewest crashes and faults that still show it
(FoundationDB's and SQLite's way of testing themselves; docs/design.md §10).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from ..core import crashpoints
from ..core.rollout.effects import POLICIES
from ..core.rollout.samplers import check_limits
from ..core.schedule import RetryPolicy, Settings
from .world import Crash, Outcome, Plan, Script, World

# Crash points a simulated run reaches (the runner-only trace flushes have no twin here).
_POINT_PREFIXES = ("publish.", "checkpoint.", "train.", "ledger.", "journal.", "rowlog.")
_JOURNAL_PREFIXES = ("journal.", "rowlog.")  # reached only with Plan.journal
EFFECT_POINTS = ("ledger.effect_done", "ledger.effect_intent")  # reached only with Plan.effects


def crash_points() -> list[str]:
    return sorted(p for p in crashpoints.POINTS if p.startswith(_POINT_PREFIXES))


def plan(seed: int, index: int = 0) -> Plan:
    """The schedule of `seed`; `index` < the number of crash points pins its first crash
    to point `index`, so a sweep of that many schedules reaches every one."""
    rng = random.Random(seed)
    sampler = rng.choice(["in_order", "in_order", "weight_fifo", "windowed"])
    deterministic = sampler == "in_order" and rng.random() < 0.4
    p, window, group = rng.randint(1, 4), rng.randint(0, 2), rng.randint(1, 3)
    limits = check_limits(sampler, num_prompts_per_step=p, window=window, max_inflight_prompts=None,
                          max_buffered_rollouts=None, min_step_batch_fraction=1.0 / p)
    settings = Settings(
        seed=seed % 2**31, group_size=group, total_steps=rng.randint(2, 7),
        checkpoint_every=rng.randint(1, 3), checkpoint_on_shutdown=True, deterministic=deterministic,
        # cursor_only loses work by design: it is checked for exactly-once, not for equal weights
        recovery_mode=rng.choice(["sibling", "sibling", "prompt_group"] + ([] if deterministic else ["cursor_only"])),
        on_dropped_prompt="shrink" if deterministic else rng.choice(["replace", "shrink"]),
        on_stale=rng.choice(["regenerate", "drop"]), spare_prompts=rng.choice([0, 0, 1, 2]),
        timeout_s=0.5, retry=RetryPolicy(rng.randint(2, 4), rng.randint(2, 3), 5.0, 50.0),
        scale_rewards=rng.choice(["group_population", "group", "batch", "none"]),
        # From a stream of its own, as `turns` below: every other draw stays what it was.
        lost_versions=random.Random(f"{seed}/lost").choice(["keep", "regenerate"]),
    )
    # Multi-turn episodes in half the schedules, drawn from a stream of their own so every
    # other draw of a seed stays what it was before episodes existed.
    turns = random.Random(f"{seed}/turns").choice([1, 1, 2, 3])
    script = Script(infra_fail_rate=rng.choice([0.0, 0.05, 0.15]), data_fail_rate=rng.choice([0.0, 0.05]),
                    hang_rate=rng.choice([0.0, 0.0, 0.03]), turns=turns)
    points = crash_points()
    crashes = []
    for k in range(rng.choice([0, 1, 1, 2, 3])):
        power = rng.random() < 0.3
        if k == 0 and index < len(points):
            crashes.append(Crash(at=rng.randint(1, 3), point=points[index], power=power))
        elif rng.random() < 0.5:
            crashes.append(Crash(at=rng.randint(1, 150), power=power))
        else:
            crashes.append(Crash(at=rng.randint(1, 4), point=rng.choice(points), power=power))
    faults = rng.choice([0, 0, 0, 1, 2])
    n_rows, epochs, keep_last = rng.randint(4, 20), rng.randint(1, 2), rng.randint(1, 3)
    effects = _effects(seed, crashes)
    # The journal mostly on (the runner's default), off in a fifth so both restores stay
    # covered; on whenever a crash is pinned inside it. Flushes every 5-60 ms of simulated
    # time, or at once when a few records wait (a small flush_events).
    pinned = any(c.point is not None and c.point.startswith(_JOURNAL_PREFIXES) for c in crashes)
    journal = pinned or rng.random() < 0.8
    if crashes and index < len(points) and crashes[0].point == points[index] == "ledger.evicted":
        # Only windowed evicts, and only a straggler it overtakes (samplers.Windowed): the
        # schedule pinned at the eviction runs it with a window to fall out of and uneven
        # generations (after every draw, so the other draws stay what they were).
        sampler, window = "windowed", max(window, 1)
        limits = check_limits(sampler, num_prompts_per_step=p, window=window, max_inflight_prompts=None,
                              max_buffered_rollouts=None, min_step_batch_fraction=1.0 / p)
        settings = dataclasses.replace(settings, deterministic=False, on_stale="regenerate")
        script = dataclasses.replace(script, latency=(0.001, 0.3))
        crashes[0] = dataclasses.replace(crashes[0], at=1)  # a short run may evict once
    return Plan(seed=seed, settings=settings, sampler=sampler, limits=limits, n_rows=n_rows,
                epochs=epochs, keep_last=keep_last, script=script,
                crashes=tuple(crashes), fault_rate=0.05 if faults else 0.0, max_faults=faults, index=index,
                journal=journal, journal_ms=rng.choice([5.0, 10.0, 10.0, 60.0]),
                flush_events=rng.choice([4096, 4096, 8, 1]), **effects)


def _effects(seed: int, crashes: list[Crash]) -> dict:
    """The plan's calls to the outside, from a stream of their own (every other draw of a
    seed stays what it was before effects existed): on in half the schedules, and whenever a
    crash is pinned at an effect's event; each policy in half of them; in half of them one
    more crash at an effect's event (appended to `crashes`), so kills land between an intent
    and its call, between a call and its outcome, and before either is durable."""
    er = random.Random(f"{seed}/effects")
    if not (er.random() < 0.5 or any(c.point in EFFECT_POINTS for c in crashes)):
        return {}
    if er.random() < 0.5:
        crashes.append(Crash(at=er.randint(1, 8), point=er.choice(EFFECT_POINTS), power=er.random() < 0.3))
    return {"effects": True, "on_unknown": er.choice(POLICIES), "judge_calls": er.choice([1, 1, 2]),
            "judge_errors": er.choice([0.0, 0.0, 0.03])}


def check(p: Plan) -> Outcome:
    """Run `p` and check it; in deterministic mode also against the plan run clean."""
    out = World(p).run()
    if not out.problems and out.failed_by_design is None and p.settings.deterministic and out.digest:
        clean = World(dataclasses.replace(p, crashes=(), fault_rate=0.0, max_faults=0)).run()
        # An attempt failed as effect_unknown (on_unknown=fail, by design) gives its sibling a
        # new sampling seed, as every data failure does: what it trains on differs.
        if clean.failed_by_design is None and clean.digest != out.digest and not (out.effect_unknown
                                                                                  or clean.effect_unknown):
            out.problems.append(f"deterministic run: trainer digest {out.digest[:12]} differs from the "
                                f"uninterrupted run's {clean.digest and clean.digest[:12]}")
    return out


def shrink(p: Plan) -> tuple[Plan, Outcome]:
    """The plan with the fewest crashes and faults that still shows a violation."""
    best, best_out = p, check(p)
    if best.max_faults:
        trial = dataclasses.replace(best, fault_rate=0.0, max_faults=0)
        trial_out = check(trial)
        if trial_out.problems:
            best, best_out = trial, trial_out
    changed = True
    while changed:
        changed = False
        for i in range(len(best.crashes)):
            trial = dataclasses.replace(best, crashes=best.crashes[:i] + best.crashes[i + 1:])
            trial_out = check(trial)
            if trial_out.problems:
                best, best_out, changed = trial, trial_out, True
                break
    return best, best_out


@dataclass
class Summary:
    schedules: int = 0
    crashes: int = 0
    faults: int = 0
    failed_by_design: int = 0
    fired: Counter = field(default_factory=Counter)  # crash point (or "ledger event") → crashes
    journal_restores: int = 0  # restores that replayed a journal tail
    journal_replayed: int = 0  # the events they replayed
    effects: int = 0  # schedules with calls to the outside
    effect_calls: int = 0  # calls the judge received
    effect_resent: int = 0  # of them sent again with a recorded key
    effect_answered: int = 0  # calls answered from the record
    effect_unknown: int = 0  # attempts failed as effect_unknown
    violations: list[tuple[Plan, Outcome]] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return (f"{self.schedules} schedules, {self.crashes} crashes, {self.faults} faults, "
                f"{len(self.violations)} violations")

    def effects_line(self) -> str:
        """The calls to the outside of the sweep (the log's last line)."""
        at_points = sum(self.fired[p] for p in EFFECT_POINTS)
        return (f"simulate: effects in {self.effects} schedules: {self.effect_calls} calls, {self.effect_resent} "
                f"sent again, {self.effect_answered} answered from the record, {self.effect_unknown} "
                f"effect_unknown; {at_points} crashes at effect events")


def schedule_seed(seed: int, i: int) -> int:
    return xxhash.xxh3_64_intdigest(f"rollkeep-simulate/{seed}/{i}".encode()) % 2**63


def simulate(n: int, seed: int, *, stop_at_first: bool = True, log: Callable[[str], None] | None = None) -> Summary:
    """Run `n` schedules from `seed`; shrink and collect violations."""
    out = Summary()
    t0 = time.perf_counter()
    for i in range(n):
        p = plan(schedule_seed(seed, i), index=i)
        result = check(p)
        out.schedules += 1
        out.crashes += result.crashes
        out.fired.update(result.fired)
        out.journal_restores += result.journal_restores
        out.journal_replayed += result.journal_replayed
        out.effects += p.effects
        out.effect_calls += result.effect_calls
        out.effect_resent += result.effect_resent
        out.effect_answered += result.effect_answered
        out.effect_unknown += result.effect_unknown
        out.faults += result.faults
        out.failed_by_design += result.failed_by_design is not None
        if result.problems:
            out.violations.append(shrink(p))
            if stop_at_first:
                break
        if log is not None and (i + 1) % 500 == 0:
            log(f"simulate: {i + 1}/{n} schedules, {time.perf_counter() - t0:.1f} s")
    out.seconds = time.perf_counter() - t0
    if log is not None:
        log(out.effects_line())
    return out


def report(p: Plan, outcome: Outcome) -> str:
    """A violation, as the shortest history that reproduces it."""
    lines = [f"VIOLATION in schedule seed {p.seed}: {p.describe()}",
             "  injections: " + (", ".join(map(str, p.crashes)) or "none")
             + (f"; {p.max_faults} disk fault(s)" if p.max_faults else ""),
             *(f"  problem: {x}" for x in outcome.problems),
             f"  reproduce the unshrunk schedule: rollkeep simulate --replay {p.seed} --index {p.index}",
             "  last trace lines:"]
    for line in outcome.trace_tail[-25:]:
        fields = {k: v for k, v in line.items() if k not in ("t", "run_id")}
        lines.append(f"    {line['t']:.4f} {line['run_id']} {fields}")
    return "\n".join(lines)
