"""Partial generations across real kills (issue 11, docs/design.md §9): a sibling cut off
mid-generation continues from its durable tokens, and the run still trains on exactly the
prompts (and, in deterministic mode, ends with exactly the weights) of a run never killed."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_harness import (
    DEFAULTS,
    FAST,
    STOPPED,
    check,
    config,
    events,
    final_sha,
    killed,
    run_child,
    run_to_end,
    trace_lines,
)

from rollkeep.cli import main
from rollkeep.core.checkpoint.rowindex import ROWS_INDEX, decode_index
from rollkeep.core.checkpoint.store import CheckpointStore
from rollkeep.core.rowlog.segments import segment_path

# Streamed one token at a time, recorded at most every millisecond. Generation is the slow
# part (24 ms per completion, the toy trainer is instant), so generations are in flight at
# every instant of the run, a stop's included.
LONG = ["engine.completion_tokens=24", "engine.token_ms=1", "recovery.progress_ms=1"]
DET = ["deterministic=true", "rollout.on_dropped_prompt=shrink", "sampler.name=in_order", *LONG]


def reference(tmp_path, *over: str) -> str:
    ref = config(tmp_path / "reference", *over)
    run_to_end(ref)
    return final_sha(ref)


def assert_continued(cfg) -> None:
    """Each resumed process continues at most the chains its restore named, and the last one
    (run to the end, no failures) continues every one of them, once, from its full length.
    How much was in flight at a stop depends on how far the engine got, so this is what
    holds whatever it was."""
    lines = trace_lines(cfg)
    starts = [i for i, x in enumerate(lines) if x["event"] == "run_started"] + [len(lines)]
    for a, b in zip(starts, starts[1:], strict=False):
        run = lines[a:b]
        restored = next((x for x in run if x["event"] == "restored"), None)
        continued = [x for x in run if x["event"] == "sealed" and x["resumed_from"]]
        if restored is None:
            assert not continued
            continue
        assert sum(x["resumed_from"] for x in continued) <= restored["partial_tokens"]
        assert all(0 < x["resumed_from"] <= x["tokens"] for x in continued)
        if b == len(lines):
            assert len(continued) == restored["partial_generations"]
            assert sum(x["resumed_from"] for x in continued) == restored["partial_tokens"]


@pytest.mark.parametrize("sampler", ["in_order", "weight_fifo"])
def test_kills_mid_generation_resume_from_the_tokens_and_end_exactly_once(tmp_path, sampler) -> None:
    over = [*LONG, f"sampler.name={sampler}"]
    cfg = config(tmp_path / "run", *over)
    # Graceful stops (what they keep does not depend on how far the journal's thread got)
    # and SIGKILLs, mid-generation and mid-seal.
    assert run_child(cfg, "ledger.progressed:150", crash_signal="TERM") == STOPPED
    assert killed(run_child(cfg, "ledger.progressed:80"))
    assert run_child(cfg, "ledger.progressed:60", crash_signal="TERM") == STOPPED
    assert killed(run_child(cfg, "ledger.sealed:10"))
    run_to_end(cfg)
    check(cfg)
    assert_continued(cfg)
    assert sum(x["partial_generations"] for x in events(cfg, "restored")) > 0, "two stops mid-generation"


def test_deterministic_kills_mid_generation_end_byte_identical(tmp_path) -> None:
    sha = reference(tmp_path, *DET)
    cfg = config(tmp_path / "run", *DET)
    assert run_child(cfg, "ledger.progressed:120", crash_signal="TERM") == STOPPED
    assert killed(run_child(cfg, "ledger.progressed:80"))
    assert run_child(cfg, "ledger.progressed:40", crash_signal="TERM") == STOPPED
    run_to_end(cfg)
    check(cfg, sha)
    assert_continued(cfg)
    assert sum(x["partial_tokens"] for x in events(cfg, "restored")) > 0, "two stops mid-generation"


def test_an_attempt_records_its_chunks_coalesced_and_its_last_chunk_before_its_seal(tmp_path) -> None:
    cfg = config(tmp_path / "run", *LONG)
    run_to_end(cfg)
    by_attempt: dict[tuple, list[dict]] = {}
    for x in events(cfg, "progressed"):
        by_attempt.setdefault((x["group_id"], x["generation"], x["attempt"]), []).append(x)
    assert by_attempt, "generations longer than recovery.progress_ms record progress"
    for seal in events(cfg, "sealed"):
        chunks = by_attempt.get((seal["group_id"], seal["generation"], seal["attempt"]), [])
        if chunks:
            assert chunks[-1]["tokens"] == seal["tokens"], "the last chunk is recorded before the seal"
            assert chunks[0]["tokens"] > 1, "the first record waits one interval after the first chunk"
            assert [c["tokens"] for c in chunks] == sorted({c["tokens"] for c in chunks})


def test_generations_shorter_than_the_interval_record_only_their_seal(tmp_path) -> None:
    cfg = config(tmp_path / "run", *LONG[:2], "recovery.progress_ms=60000")
    run_to_end(cfg)
    assert not events(cfg, "progressed") and events(cfg, "sealed")
    commits = events(cfg, "step_committed")
    trained = {g for c in commits for g in c["group_ids"]}
    assert sum(c["tokens"] for c in commits) == sum(s["tokens"] for s in events(cfg, "sealed")
                                                   if s["group_id"] in trained), "step_committed counts its tokens"


def test_regenerate_and_the_journal_off_resume_nothing(tmp_path) -> None:
    """`recovery.partial=regenerate` still records progress (the trace shows what a stop cut
    off) but a restart starts every cut-off sibling over; with the journal off nothing is
    recorded at all."""
    for name, over in (("regenerate", ["recovery.partial=regenerate"]), ("off", ["journal.enabled=false"])):
        sha = reference(tmp_path / name, *DET, *over)
        cfg = config(tmp_path / name / "run", *DET, *over)
        stop_at = "ledger.progressed:100" if name == "regenerate" else "ledger.sealed:30"
        assert run_child(cfg, stop_at, crash_signal="TERM") == STOPPED
        assert killed(run_child(cfg, "ledger.sealed:40"))
        run_to_end(cfg)
        check(cfg, sha)
        assert bool(events(cfg, "progressed")) is (name == "regenerate"), name
        assert not [x for x in events(cfg, "sealed") if x["resumed_from"]], name
        assert all(x["partial_generations"] == 0 for x in events(cfg, "restored")), name


def test_a_graceful_stop_keeps_the_tokens_in_flight_for_the_rerun(tmp_path) -> None:
    """(Not deterministic mode: there a stop with pinned work unfinished keeps the previous
    checkpoint, and the journal's tail carries the tokens.)"""
    cfg = config(tmp_path / "run", *LONG)
    assert run_child(cfg, "ledger.progressed:200", crash_signal="TERM") == STOPPED
    ck = CheckpointStore(Path(cfg.run_dir) / "checkpoints").open()
    assert ck.manifest["rows"]["partial"] > 0, "the final checkpoint names the partial generations"
    run_to_end(cfg)
    check(cfg)
    (restored,) = events(cfg, "restored")
    assert restored["partial_generations"] == ck.manifest["rows"]["partial"]
    assert restored["partial_tokens"] == ck.manifest["rows"]["partial_tokens"]


def test_a_partial_generation_whose_segment_is_damaged_is_refused(tmp_path, capsys) -> None:
    cfg = config(tmp_path / "run", *LONG)
    run_dir = Path(cfg.run_dir)
    assert run_child(cfg, "ledger.progressed:200", crash_signal="TERM") == STOPPED
    chains = decode_index(CheckpointStore(run_dir / "checkpoints").open().read(ROWS_INDEX)).chains
    last = max((ch.at for chain in chains.values() for ch in chain), key=lambda at: (at.segment, at.offset))
    seg = segment_path(run_dir / "rows", last.segment)
    seg.write_bytes(seg.read_bytes()[: last.offset + last.length - 1])  # its last chunk cut short
    code = main(["train", DEFAULTS, *FAST, *LONG, f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 3 and f"segment {last.segment}" in err and "Traceback" not in err


TORCH = [
    "engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=10",
    "trainer.model.n_layer=1", "trainer.model.n_head=2", "trainer.model.n_embd=32",
    "trainer.model.block_size=24", "trainer.micro_batch_size=8", "rollout.group_size=4",
    "train.num_prompts_per_step=4", "train.total_steps=6", "warmup.sft_steps=0",
    "data.generated.n_rows=64", "data.epochs=null", "recovery.progress_ms=1", *DET[:3],
]


def test_the_built_in_gpt_resumes_mid_generation_and_ends_byte_identical(tmp_path) -> None:
    """The torch engine streams; a sibling stopped mid-generation continues from its tokens
    (its cache rebuilt token by token in deterministic mode), and the weights end as a run
    never stopped."""
    sha = reference(tmp_path, *TORCH)
    cfg = config(tmp_path / "run", *TORCH)
    assert run_child(cfg, "ledger.progressed:60", crash_signal="TERM") == STOPPED
    assert killed(run_child(cfg, "ledger.progressed:50"))
    assert run_child(cfg, "ledger.progressed:30", crash_signal="TERM") == STOPPED
    run_to_end(cfg)
    check(cfg, sha)
    assert_continued(cfg)
