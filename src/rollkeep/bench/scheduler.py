"""The sans-IO scheduler alone: siblings decided per CPU-second, no asyncio, no engine.

A driver carries out the scheduler's commands at once, as a runner would with an engine
and a trainer that take no time: every Dispatch is answered with the same completion
(64 tokens, reward 1), every Train with `on_trained`, every Refit with `on_refit`, every
Cut with `on_cut_written` (the cut's capture is the scheduler's; its write is not
measured here). `sinks`: the real trace writer (flushed once per poll, as the runner does)
and the real journal's loop side (`GroupCommit.sink`: rows appended to the row log,
records staged and released at each trace flush), its group commit (`cycle`, the journal
thread's work) run inline whenever `flush_events` records wait.

Measured as CPU seconds (`time.process_time`), not wall: the figure of merit is what one
core spends on bookkeeping per sibling.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from ..core.custody.ledger import Ledger
from ..core.rollout.datasets import SequenceDataset
from ..core.rollout.generation import Completion
from ..core.rollout.rowstore import RowStore
from ..core.rollout.samplers import Limits, make_sampler
from ..core.rollout.source import PromptSource
from ..core.rowlog.segments import ROWS_DIR, RowLogReader
from ..core.schedule import (
    Cut,
    Dispatch,
    Generated,
    Refit,
    Scheduler,
    Settings,
    Sinks,
    Stop,
    Train,
)


def run_scheduler(*, group_size: int = 16, prompts_per_step: int = 256, steps: int = 8, lookahead: int = 1,
                  sinks: bool = False, sampler: str = "in_order") -> dict:
    """One run of `steps` steps; returns siblings, CPU seconds and siblings per CPU-second."""
    n_rows = prompts_per_step * (steps + lookahead + 2)
    completion = Completion(prompt_ids=np.arange(16, dtype=np.int32), completion_ids=np.arange(64, dtype=np.int32),
                            logprobs=np.full(64, -1.0, np.float32), versions=np.zeros(64, np.int32),
                            finish_reason="stop", text="")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        rows = RowStore(reader=RowLogReader(run_dir / ROWS_DIR).read)
        source = PromptSource(SequenceDataset([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(n_rows)]),
                              seed=0, epochs=1)
        ledger = Ledger(n_rows=source.n_rows, seed=0, epochs=1)
        limits = Limits(num_prompts_per_step=prompts_per_step, window=lookahead,
                        max_inflight_prompts=prompts_per_step * (lookahead + 1),
                        max_buffered_rollouts=prompts_per_step * (lookahead + 1))
        settings = Settings(group_size=group_size, total_steps=steps, checkpoint_every=max(1, steps // 2),
                            checkpoint_on_shutdown=False)
        trace = journal = None
        if sinks:
            from ..core.journal.groupcommit import GroupCommit
            from ..trace import Trace

            trace = Trace(run_dir / "trace.jsonl")
            journal = GroupCommit(run_dir, next_seq=1, rows=rows, flush_ms=20, flush_events=4096)
            journal.restart(0, source.identity())
            trace.on_flush = journal.release
        sched = Scheduler(ledger=ledger, rows=rows, source=source, sampler=make_sampler(sampler, limits),
                          settings=settings,
                          sinks=Sinks(trace=trace and trace.ledger_event, journal=journal and journal.sink))
        sched.start(None, epochs=1)
        now, siblings = 0.0, 0
        t0 = time.process_time()
        try:
            pending: list = []
            while True:
                cmds = sched.poll(now)
                if trace is not None:
                    trace.flush()
                    if journal.kicked:  # the journal thread's cycle, here on the loop's thread
                        journal.cycle()
                stop = False
                for c in cmds:
                    if isinstance(c, Dispatch):
                        pending.append(c.request)
                    elif isinstance(c, Train):
                        sched.on_trained(c.step)
                    elif isinstance(c, Refit):
                        sched.on_refit(c.version)
                    elif isinstance(c, Cut):
                        sched.on_cut_written(c.step)
                        c.custody.rows.release()
                    elif isinstance(c, Stop):
                        stop = True
                if stop:
                    break
                if not pending:
                    if not any(isinstance(c, (Train, Refit, Cut)) for c in cmds):
                        now += 0.001  # nothing to do but wait: a backoff or the trainer
                    continue
                done, pending = pending, []
                for req in done:
                    sched.on_result((req.group_id, req.generation, req.attempt), Generated(completion, 1.0), now)
                    siblings += 1
        finally:
            if journal is not None:
                journal.close(report=False)
            if trace is not None:
                trace.close()
        cpu = time.process_time() - t0
    trained = ledger.version
    return {"group_size": group_size, "prompts_per_step": prompts_per_step, "steps": trained, "sinks": sinks,
            "sampler": sampler, "siblings": siblings, "cpu_s": cpu, "siblings_per_cpu_s": siblings / cpu}
