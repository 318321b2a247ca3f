"""The surviving lineage of a run directory, read from its trace.

A run that resumes from checkpoint step N redoes every step after N, so the steps a killed
run committed after N are not part of what the final model was trained on. Walking the
runs in order and forgetting, at each `run_started`, the steps after its
`resumed_from_step`, leaves exactly the steps that count. Exactly-once training is a
property of that lineage.

Drops survive the same way, by time rather than by step (a drop in a group stamped for
step N+1 can already be in checkpoint N): a resumed run forgets the drops earlier runs
traced after its checkpoint's cut (`restored.cut_time`) except those its journal's tail
replayed (`restored.journal_dropped`), a fresh run forgets them all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .core.custody.trace_schema import DROPPED, RESTORED, RUN_FINISHED, RUN_STARTED, STEP_COMMITTED

#: The only events `lineage` reads (`trace.read_trace(..., events=EVENTS)` parses no other).
EVENTS = frozenset({RUN_STARTED, RESTORED, DROPPED, STEP_COMMITTED, RUN_FINISHED})


@dataclass
class Lineage:
    steps: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # step → [epoch, idx]
    runs: list[dict[str, Any]] = field(default_factory=list)  # run_started lines, in order
    finished: dict[str, Any] | None = None  # the last run_finished, if the last run finished
    dropped: dict[tuple[int, int], tuple[float, str]] = field(default_factory=dict)  # → (t, run_id)

    def trained(self) -> Counter:
        """(epoch, idx) → how many surviving steps trained it (1 is the only right answer)."""
        return Counter(p for prompts in self.steps.values() for p in prompts)

    def duplicates(self) -> list[tuple[int, int]]:
        return sorted(p for p, n in self.trained().items() if n > 1)


def lineage(lines: Iterable[dict[str, Any]]) -> Lineage:
    out = Lineage()
    current_run = None
    for line in lines:
        ev = line.get("event")
        if ev == RUN_STARTED:
            current_run = line.get("run_id")
            out.runs.append(line)
            out.finished = None
            resumed = line.get("resumed_from_step") or 0
            for step in [s for s in out.steps if s > resumed]:
                del out.steps[step]
            if line.get("resumed_from_step") is None:
                out.dropped.clear()
        elif ev == RESTORED and line.get("run_id") == current_run and line.get("cut_time") is not None:
            # Earlier runs' drops after the cut are undone, but those the journal's tail kept
            # (`journal_dropped`) and this run's own (a restore that drops, like cursor_only's
            # losses) stand.
            cut = float(line["cut_time"])
            listed = line.get("journal_dropped")
            kept = {tuple(p) for p in listed if isinstance(p, list)} if isinstance(listed, list) else set()
            out.dropped = {p: (t, r) for p, (t, r) in out.dropped.items()
                           if t <= cut or r == current_run or p in kept}
            for p in kept - out.dropped.keys():  # its trace line was lost with the process
                out.dropped[p] = (float(line["t"]), current_run)
        elif ev == DROPPED and line.get("run_id") == current_run and "prompt" in line:
            out.dropped[tuple(line["prompt"])] = (float(line["t"]), current_run)
        elif ev == STEP_COMMITTED and line.get("run_id") == current_run:
            out.steps[int(line["step"])] = [tuple(p) for p in line["prompts"]]
        elif ev == RUN_FINISHED and line.get("run_id") == current_run:
            out.finished = line
    return out


@dataclass
class Custody:
    """What `exactly_once` found: the problems (empty when it holds) and the counts."""

    problems: list[str] = field(default_factory=list)
    dropped: int = 0
    lost: list[tuple[int, int]] = field(default_factory=list)  # never trained nor dropped
    completed_epochs: list[int] = field(default_factory=list)


def exactly_once(lin: Lineage, state: Any, source: Any) -> Custody:
    """Check a finished run's surviving lineage against its final checkpoint (`state`, a
    restored LedgerState; `source` maps keys to dataset rows): no prompt trained twice, the
    checkpoint's TRAINED and DROPPED sets are the trace's, and every prompt of every
    completed epoch was trained or dropped, exactly once. `recovery.mode: cursor_only`
    records its losses as drops with a "lost" reason: they are reported as lost."""
    out = Custody()
    trained = lin.trained()
    if lin.duplicates():
        out.problems.append(f"{len(lin.duplicates())} prompt(s) trained twice: {lin.duplicates()[:5]}")
    if lin.finished is None:
        out.problems.append("the last run did not finish")
    if state.version != len(lin.steps):
        out.problems.append(f"final checkpoint is at step {state.version}, the lineage has {len(lin.steps)} steps")
    ckpt_trained = Counter((epoch, source.idx((epoch, o))) for epoch, bm in state.trained.items() for o in bm)
    if ckpt_trained != trained:
        out.problems.append("the final checkpoint's TRAINED set differs from the trace's lineage")
    dropped = {(k[0], source.idx(k)) for k in state.dropped}
    out.dropped = len(dropped)
    if lin.finished is not None and set(lin.dropped) != dropped:
        only_trace, only_ckpt = sorted(set(lin.dropped) - dropped), sorted(dropped - set(lin.dropped))
        out.problems.append(
            "the final checkpoint's DROPPED set differs from the trace's: "
            f"{len(only_trace)} dropped only per the trace (e.g. {only_trace[:3]}), "
            f"{len(only_ckpt)} only per the checkpoint (e.g. {only_ckpt[:3]})"
        )
    lost_in_flight = sorted((k[0], source.idx(k)) for k, (reason, _) in state.dropped.items()
                            if reason.startswith("lost"))
    if lost_in_flight:
        out.lost.extend(lost_in_flight)
        out.problems.append(f"{len(lost_in_flight)} prompt(s) in flight at a checkpoint were lost on "
                            f"restore: {lost_in_flight[:5]}")
    cursor_epoch = state.cursor[0]
    out.completed_epochs = [e for e in range(cursor_epoch)
                            if not any(r.epoch == e for r in state.groups.values())
                            and not any(k[0] == e for k in state.spare)]
    both = []
    for e in out.completed_epochs:
        for idx in range(source.n_rows):
            owners = trained.get((e, idx), 0) + ((e, idx) in dropped)
            if owners == 0:
                out.lost.append((e, idx))
            elif trained.get((e, idx)) and (e, idx) in dropped:
                both.append((e, idx))
    if both:
        out.problems.append(f"{len(both)} prompt(s) both trained and dropped: {both[:5]}")
    never = [k for k in out.lost if k not in set(lost_in_flight)]
    if never:
        out.problems.append(f"{len(never)} prompt(s) of completed epochs neither trained nor dropped: "
                            f"{never[:5]}")
    return out
