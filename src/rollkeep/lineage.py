"""The surviving lineage of a run directory, read from its trace.

A run that resumes from checkpoint step N redoes every step after N, so the steps a killed
run committed after N are not part of what the final model was trained on. Walking the
runs in order and forgetting, at each `run_started`, the steps after its
`resumed_from_step`, leaves exactly the steps that count. Exactly-once training is a
property of that lineage.

Drops survive the same way, by time rather than by step (a drop in a group stamped for
step N+1 can already be in checkpoint N): a resumed run forgets the drops traced after its
checkpoint's cut (`restored.cut_time`), a fresh run forgets them all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Lineage:
    steps: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # step → [epoch, idx]
    runs: list[dict[str, Any]] = field(default_factory=list)  # run_started lines, in order
    finished: dict[str, Any] | None = None  # the last run_finished, if the last run finished
    dropped: dict[tuple[int, int], float] = field(default_factory=dict)  # [epoch, idx] → trace time

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
        if ev == "run_started":
            current_run = line.get("run_id")
            out.runs.append(line)
            out.finished = None
            resumed = line.get("resumed_from_step") or 0
            for step in [s for s in out.steps if s > resumed]:
                del out.steps[step]
            if line.get("resumed_from_step") is None:
                out.dropped.clear()
        elif ev == "restored" and line.get("run_id") == current_run and line.get("cut_time") is not None:
            cut = float(line["cut_time"])
            out.dropped = {p: t for p, t in out.dropped.items() if t <= cut}
        elif ev == "dropped" and line.get("run_id") == current_run and "prompt" in line:
            out.dropped[tuple(line["prompt"])] = float(line["t"])
        elif ev == "step_committed" and line.get("run_id") == current_run:
            out.steps[int(line["step"])] = [tuple(p) for p in line["prompts"]]
        elif ev == "run_finished" and line.get("run_id") == current_run:
            out.finished = line
    return out
