"""Controller benchmarks: what a checkpoint costs and how fast the control plane runs.

  checkpoint    for N in-flight groups (16 siblings, half sealed, 64-token rows), with the
                rows in the row log (named by reference, as with the journal) and copied
                (the journal off): the cut's hold of the loop, the background write
                (encode + fsync + publish), the restore (chain + ledger + rows +
                normalisation), and reading every row afterwards
  ceiling       steps/s and groups/s of the toy engine and toy trainer at zero latency:
                the most the control plane can drive; `cut_hold_seconds` of the
                checkpoints taken while both pumps ran
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..core.checkpoint.cut import cut, gc_paused, save_files, write_checkpoint
from ..core.checkpoint.store import CheckpointStore
from ..core.custody.ledger import Ledger
from ..core.custody.trace_schema import (
    ADMITTED,
    CHECKPOINT_PUBLISHED,
    DISPATCHED,
    RUN_FINISHED,
    RUN_STARTED,
    SEALED,
    TAKEN,
)
from ..core.restore.chain import restore_chain
from ..core.rollout.rows import Row, RowId
from ..core.rollout.rowstore import RowStore
from ..core.rowlog.segments import ROWS_DIR, RowLogReader
from ..core.rowlog.writer import RowLogWriter
from ..core.schedule.restart import normalize
from ..trace import read_trace
from .ledger import G, inflight_ledger


def _row(tokens: int) -> Row:
    return Row(
        prompt_ids=np.arange(16, dtype=np.int32),
        completion_ids=np.arange(tokens, dtype=np.int32),
        logprobs=np.full(tokens, -1.0, np.float32),
        versions=np.zeros(tokens, np.int32),
        reward=1.0,
        finish_reason="stop",
    )


def checkpoint_costs(n: int, tokens: int = 64, *, by_reference: bool = True, group_size: int = G) -> dict:
    """`by_reference`: the rows are in the row log first, as the journal puts them, so the
    checkpoint names them (`rows.index`); else it copies them (the journal off)."""
    led = inflight_ledger(n, group_size)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        rows = RowStore(reader=RowLogReader(run / ROWS_DIR).read)
        log = RowLogWriter(run / ROWS_DIR) if by_reference else None
        for gid, rec in led.groups():
            for g in rec.sealed_generations():
                rid = RowId(gid, g, 0)
                rows.put(rid, _row(tokens))
                if log is not None:
                    rows.locate(rid, log.append(rid, rows.get(rid)))
        if log is not None:
            log.close()
        store = CheckpointStore(run / "checkpoints")
        holds = []
        for _ in range(20):
            t0 = time.perf_counter()
            c = cut(led, rows)
            holds.append(time.perf_counter() - t0)
            c.rows.release()
        c = cut(led, rows)
        phases: dict[str, float] = {}
        t0 = time.perf_counter()
        published = write_checkpoint(store, c, trainer_save=save_files({"model.bin": b"\0" * 1024}), meta={},
                                     keep_last=2, phases=phases)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        restored = restore_chain(store, source=None, config=None)
        with gc_paused():  # as `open_state` builds them at a restart
            ledger = Ledger.from_state(restored.ledger)
            store2 = RowStore(reader=RowLogReader(run / ROWS_DIR).read)
            store2.restore(restored.rows, restored.located)
        normalize(ledger, ledger.apply)
        restore_s = time.perf_counter() - t0
        resident = store2.resident()
        c = cut(ledger, store2)  # the restored run's first checkpoint (its rows' places: `LocatedColumns.fill`)
        t0 = time.perf_counter()
        after_phases: dict[str, float] = {}
        write_checkpoint(store, c, trainer_save=save_files({"model.bin": b"\0" * 1024}), meta={}, keep_last=2,
                         phases=after_phases)
        write_after_restore_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for rid in list(store2.ids()):
            store2.get(rid)
        read_all_s = time.perf_counter() - t0
    return {
        "groups": n,
        "rows": len(rows),
        "by_reference": by_reference,
        "row_bytes": sum(r.prompt_ids.nbytes + 3 * r.completion_ids.nbytes for r in map(rows.get, rows.ids())),
        "cut_hold_s_median": statistics.median(holds),
        "write_s": write_s,
        "write_phases": phases,  # seconds: audit, key_order, locations, index_columns, encode_*, publish
        "bytes": published.bytes,
        "restore_s": restore_s,
        "write_after_restore_s": write_after_restore_s,
        "write_after_restore_phases": after_phases,
        "rows_read_at_restore": resident,
        "read_every_row_after_s": read_all_s,
    }


def ceiling(steps: int = 40, prompts_per_step: int = 64, group_size: int = G, *, trace: bool = True,
            journal: bool = True) -> dict:
    """`trace=False` measures the loop without writing the per-event trace lines (the run
    events the measure reads are still written); `journal=False` without the journal."""
    from ..config import load_config
    from ..controller import train
    from ..trace import FLUSH_NOW, Trace

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [
            f"run_dir={tmp}/run", "engine.name=toy", "trainer.name=toy", "logger.progress=none",
            f"data.generated.n_rows={prompts_per_step * (steps + 2)}", "data.epochs=1",
            f"rollout.group_size={group_size}", f"train.num_prompts_per_step={prompts_per_step}",
            f"train.total_steps={steps}", "checkpoint.every_steps=10", "eval.every_steps=0",
            f"journal.enabled={journal}",
        ])
        real = Trace.emit
        if not trace:  # keep only what the measure reads (and what a restart would)
            Trace.emit = Trace.ledger_event = lambda self, ev: (  # type: ignore[method-assign]
                real(self, ev) if ev.__struct_config__.tag in FLUSH_NOW else None)
        try:
            train(cfg)
        finally:
            Trace.emit = Trace.ledger_event = real  # type: ignore[method-assign]
        lines, _ = read_trace(Path(tmp) / "run" / "trace.jsonl")
    t0 = next(x["t"] for x in lines if x["event"] == RUN_STARTED)
    finished = next(x for x in lines if x["event"] == RUN_FINISHED)
    t1 = finished["t"]
    holds = [x["cut_hold_seconds"] for x in lines if x["event"] == CHECKPOINT_PUBLISHED]
    events = sum(1 for x in lines if x["event"] in (SEALED, DISPATCHED, TAKEN, ADMITTED))
    siblings = steps * prompts_per_step * group_size
    return {
        "steps": steps,
        "prompts_per_step": prompts_per_step,
        "group_size": group_size,
        "seconds": t1 - t0,
        "steps_per_s": steps / (t1 - t0),
        "groups_per_s": steps * prompts_per_step / (t1 - t0),
        "siblings_per_s": siblings / (t1 - t0),
        "trace": trace,
        "journal": journal,
        "journal_flushes": finished.get("journal_flushes", 0),
        "journal_flush_p50_s": finished.get("journal_flush_p50_s"),
        "journal_flush_p99_s": finished.get("journal_flush_p99_s"),
        "ledger_events": events,
        "cut_hold_s_median_while_running": statistics.median(holds) if holds else None,
    }


def run(quick: bool = False, log=print) -> dict:
    out: dict = {"checkpoint": []}
    for n in [1000] if quick else [1000, 10_000, 100_000]:
        for by_reference in (True, False):
            r = checkpoint_costs(n, by_reference=by_reference)
            out["checkpoint"].append(r)
            how = "rows by reference" if by_reference else "rows copied (journal off)"
            log(
                f"checkpoint at {n:>6} in-flight groups ({r['rows']} rows, {r['row_bytes'] / 1e6:.1f} MB), "
                f"{how}: cut holds the loop {r['cut_hold_s_median'] * 1e6:.1f} us, background write "
                f"{r['write_s']:.2f} s ({r['bytes'] / 1e6:.1f} MB), restore {r['restore_s']:.2f} s "
                f"({r['rows_read_at_restore']} rows read; reading all later {r['read_every_row_after_s']:.2f} s)"
            )
    n = 10 if quick else 40
    c, off, bare = ceiling(steps=n), ceiling(steps=n, trace=False), ceiling(steps=n, journal=False)
    out["ceiling"], out["ceiling_trace_off"], out["ceiling_journal_off"] = c, off, bare
    log(
        f"control-plane ceiling (toy engine and trainer, zero latency, P={c['prompts_per_step']}, "
        f"G={c['group_size']}): {c['steps_per_s']:.1f} steps/s, {c['groups_per_s']:.0f} groups/s, "
        f"{c['siblings_per_s']:.0f} siblings/s with the trace and the journal on, "
        f"{off['siblings_per_s']:.0f} with per-event trace lines off, {bare['siblings_per_s']:.0f} with "
        f"the journal off; cut hold while running {c['cut_hold_s_median_while_running'] * 1e6:.0f} us"
    )
    if c["journal_flushes"]:
        log(f"journal: {c['journal_flushes']} group commits, flush p50 {c['journal_flush_p50_s'] * 1e3:.2f} ms, "
            f"p99 {c['journal_flush_p99_s'] * 1e3:.2f} ms; {c['ledger_events'] / c['seconds']:.0f} ledger "
            f"events/s journaled; throughput {c['siblings_per_s'] / bare['siblings_per_s'] - 1:+.1%} vs off")
    return out
