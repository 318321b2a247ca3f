"""`rollkeep simulate`: the deterministic simulation finds no violation in thousands of
schedules, reaches every crash point a run can reach, and does find the bugs it exists to
find (a test that could not fail would prove nothing)."""

from __future__ import annotations

import dataclasses
import errno
import random
from pathlib import Path

import pytest

from rollkeep.cli import main
from rollkeep.core.custody.events import StepCommitted
from rollkeep.core.custody.trace_schema import CheckpointPublished
from rollkeep.core.io.fs import DIR, FILE
from rollkeep.simulate import Crash, check, plan, simulate
from rollkeep.simulate.memfs import MemFS, SimCrash
from rollkeep.simulate.schedules import EFFECT_POINTS, crash_points, schedule_seed
from rollkeep.trace import Trace, parse_trace, published_in_trace, read_trace

# `released` undoes a claim or a running finalization found in a checkpoint: a cut is taken
# at a step boundary with no claim open and never inside a finalization, so no run reaches it.
UNREACHABLE = {"ledger.released"}


@pytest.fixture(scope="session")
def sweep():
    return simulate(2000, seed=0)


# Every test that reads the sweep runs on one xdist worker, and the sweep (over a minute) is
# kept for the session: drawn once per `make test`, not once per worker or per module
# visit (xdist may run other modules' tests between two of these).
on_the_sweep = pytest.mark.xdist_group("simulate_sweep")


@on_the_sweep
def test_2000_schedules_find_no_violation(sweep):
    assert sweep.schedules == 2000 and not sweep.violations, "\n".join(
        f"{p.seed}: {o.problems}" for p, o in sweep.violations)
    assert sweep.crashes > 1000 and sweep.faults > 500  # the schedules do crash and fail


@on_the_sweep
def test_every_reachable_crash_point_fires(sweep):
    missing = [p for p in crash_points() if p not in UNREACHABLE and sweep.fired[p] == 0]
    assert not missing
    assert sweep.fired["ledger event"] > 0


def test_the_cli_prints_one_summary_line_and_exits_0(capsys):
    assert main(["simulate", "--schedules", "30", "--seed", "3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("30 schedules, ") and out[0].count(" violations") == 1


def test_the_same_seed_gives_the_same_schedules():
    a, b = (check(plan(schedule_seed(9, i), index=i)) for i in (4, 4))
    assert (a.crashes, a.faults, a.digest, a.segments) == (b.crashes, b.faults, b.digest, b.segments)


def test_a_restart_that_forgets_in_flight_attempts_is_caught_and_shrunk(monkeypatch, capsys):
    # The bug class the ledger exists to prevent: a restore that keeps attempts DISPATCHED
    # instead of abandoning them, so their results never come and the run cannot go on.
    from rollkeep.core.custody.ledger import Ledger

    monkeypatch.setattr(Ledger, "normalize_for_restart", lambda self: [])
    assert main(["simulate", "--schedules", "300", "--seed", "0"]) == 4
    out = capsys.readouterr().out
    assert "VIOLATION in schedule seed" in out and "injections:" in out and "reproduce" in out
    assert out.strip().splitlines()[-1].endswith("1 violations")


def test_a_publication_that_does_not_fsync_latest_is_caught_by_a_power_cut(monkeypatch):
    # Without the fsync of the new LATEST before it is renamed in (store step P7), a power
    # cut right after the commit point can leave a LATEST that names nothing durable.
    from rollkeep.core.checkpoint import store

    real = store.CheckpointStore.publish

    def careless(self, *args, **kwargs):
        fs = self._fs
        real_fsync = fs.fsync
        fs.fsync = lambda path: None if Path(path).name.startswith("LATEST") else real_fsync(path)
        try:
            return real(self, *args, **kwargs)
        finally:
            del fs.fsync

    monkeypatch.setattr(store.CheckpointStore, "publish", careless)
    found = simulate(1500, seed=1)
    assert found.violations


# -- the simulated disk ----------------------------------------------------------------


def fs() -> MemFS:
    m = MemFS(random.Random(0))
    m.makedirs_durable(Path("/r"))
    return m


def test_a_power_cut_keeps_only_what_was_fsynced():
    m = fs()
    m.write(Path("/r/a"), b"synced")
    m.fsync(Path("/r/a"))
    m.fsync(Path("/r"))
    m.write(Path("/r/b"), b"never synced")  # neither the file nor its name is durable
    m.mkdir(Path("/r/d"))
    m.power_cut()
    assert m.read(Path("/r/a")) == b"synced"
    assert m.kind_of(Path("/r/b")) is None and m.kind_of(Path("/r/d")) is None


def test_a_rename_is_durable_only_once_its_directory_is_fsynced():
    m = fs()
    for name in ("LATEST", "LATEST.tmp"):
        m.write(Path(f"/r/{name}"), name.encode())
        m.fsync(Path(f"/r/{name}"))
    m.fsync(Path("/r"))
    m.rename(Path("/r/LATEST.tmp"), Path("/r/LATEST"))
    m.power_cut()
    assert m.read(Path("/r/LATEST")) == b"LATEST"  # the old one: never both, never neither
    m.rename(Path("/r/LATEST.tmp"), Path("/r/LATEST"))
    m.fsync(Path("/r"))
    m.power_cut()
    assert m.read(Path("/r/LATEST")) == b"LATEST.tmp" and m.kind_of(Path("/r/LATEST.tmp")) is None


def test_an_unsynced_file_is_torn_to_a_prefix_and_a_killed_process_touches_nothing():
    m = fs()
    m.write(Path("/r/f"), b"0123456789")
    m.fsync(Path("/r"))  # the name is durable, the content is not
    crash = SimCrash("dead")
    m.freeze(crash)
    with pytest.raises(SimCrash):
        m.unlink(Path("/r/f"))
    m.power_cut()
    assert b"0123456789".startswith(m.read(Path("/r/f")))
    assert dict(m.listdir(Path("/r"))) == {"f": FILE}
    assert dict(m.listdir(Path("/"))) == {"r": DIR}


def test_appended_bytes_survive_a_kill_and_a_power_cut_keeps_the_synced_ones_and_a_prefix():
    kept = set()
    for seed in range(30):
        m = MemFS(random.Random(seed))
        m.makedirs_durable(Path("/r"))
        f = m.open_append(Path("/r/log"))
        f.write(b"synced;")
        f.fsync()
        m.fsync(Path("/r"))  # the name is durable too
        f.write(b"flushed only")
        m.kill()  # the page cache lives on
        assert m.read(Path("/r/log")) == b"synced;flushed only"
        m.power_cut()
        after = m.read(Path("/r/log"))
        assert after.startswith(b"synced;") and b"synced;flushed only".startswith(after)
        kept.add(len(after))
    assert len(kept) > 2  # sometimes all, sometimes none, often a torn part of the rest


def test_an_appended_file_whose_name_was_never_synced_is_gone_after_a_power_cut():
    m = fs()
    f = m.open_append(Path("/r/log"))
    f.write(b"data")
    f.fsync()  # the bytes are durable, the directory entry is not
    m.power_cut()
    assert m.kind_of(Path("/r/log")) is None


def test_a_failed_append_raises_enospc_after_at_most_a_prefix():
    for seed in range(10):
        m = MemFS(random.Random(seed), fault_rate=1.0, max_faults=1)
        m.makedirs_durable(Path("/r"))
        f = m.open_append(Path("/r/log"))
        with pytest.raises(OSError) as e:
            f.write(b"0123456789")
        assert e.value.errno == errno.ENOSPC
        assert b"0123456789".startswith(m.read(Path("/r/log")))
        f.write(b"!")  # the fault budget is spent
        assert m.read(Path("/r/log")).endswith(b"!")


def test_an_append_fsync_that_fails_makes_nothing_more_durable():
    m = MemFS(random.Random(0), fault_rate=1.0, max_faults=0)
    m.makedirs_durable(Path("/r"))
    f = m.open_append(Path("/r/log"))
    f.write(b"abc")
    m.fsync(Path("/r"))
    m.faults_left = 1  # the next fsync fails
    with pytest.raises(OSError) as e:
        f.fsync()
    assert e.value.errno == errno.EIO
    m.power_cut()
    assert b"abc".startswith(m.read(Path("/r/log")))  # only ever a torn prefix: nothing was durable


def test_a_frozen_disk_refuses_every_append_call():
    m = fs()
    f = m.open_append(Path("/r/log"))
    m.freeze(SimCrash("dead"))
    for call in (lambda: f.write(b"x"), f.fsync, lambda: f.tail(1), f.close,
                 lambda: m.open_append(Path("/r/other"))):
        with pytest.raises(SimCrash):
            call()


# -- the real trace writer on the simulated disk -----------------------------------------


def _committed(step: int) -> StepCommitted:
    return StepCommitted(step=step, weight_version=step, group_ids=(f"e0.{step}",), prompts=((0, step),))


def test_trace_sync_makes_its_lines_survive_a_power_cut_and_unsynced_ones_may_not():
    lost_some = kept_some = False
    for seed in range(20):
        m = MemFS(random.Random(seed))
        m.makedirs_durable(Path("/r"))
        trace = Trace(Path("/r/trace.jsonl"), "a", fs=m, clock=lambda: 1.0)
        for step in (1, 2):
            trace.emit(_committed(step))  # flushed at once: a kill keeps them
        trace.sync()
        for step in (3, 4, 5):
            trace.emit(_committed(step))  # flushed, never synced
        m.power_cut()
        lines, torn = read_trace(Path("/r/trace.jsonl"), fs=m)
        steps = [x["step"] for x in lines]
        assert steps == [1, 2, 3, 4, 5][: len(steps)] and len(steps) >= 2 and torn <= 1
        lost_some, kept_some = lost_some or len(steps) < 5, kept_some or len(steps) > 2
        # the next process ends a torn line before it appends
        after = Trace(Path("/r/trace.jsonl"), "b", fs=m)
        after.emit(_committed(9))
        assert read_trace(Path("/r/trace.jsonl"), fs=m)[0][-1]["step"] == 9
    assert lost_some and kept_some  # an unsynced line may go, or stay


def test_published_in_trace_reads_through_the_seam():
    m = fs()
    assert published_in_trace(Path("/r/trace.jsonl"), fs=m) is None
    trace = Trace(Path("/r/trace.jsonl"), "a", fs=m)
    assert published_in_trace(Path("/r/trace.jsonl"), fs=m) == 0
    trace.emit(CheckpointPublished(step=2, name="step_000002", cut_time=1.0))
    assert published_in_trace(Path("/r/trace.jsonl"), fs=m) == 1


def test_a_publication_that_does_not_sync_the_trace_first_is_caught_by_a_power_cut(monkeypatch):
    # The durability rule (docs/design.md §8): without the trace's fsync before the commit
    # point, a power cut after it can leave a checkpoint whose steps the trace lost.
    monkeypatch.setattr(Trace, "sync_flushed", lambda self: None)
    found = simulate(300, seed=0)
    assert found.violations
    plan_, outcome = found.violations[0]
    assert any(c.power for c in plan_.crashes)
    assert any("lineage" in p for p in outcome.problems)


# -- the journal (issue 10): each process keeps it on the simulated disk, as the runner does


@on_the_sweep
def test_the_sweep_restores_from_the_journal_and_replays_its_events(sweep):
    assert sweep.journal_restores > 100 and sweep.journal_replayed > 1000
    for point in ("journal.before_fsync", "journal.after_fsync", "rowlog.before_fsync", "rowlog.after_fsync"):
        assert sweep.fired[point] > 0, point


def test_both_modes_are_drawn():
    plans = [plan(schedule_seed(0, i), index=10**6) for i in range(200)]
    on = sum(p.journal for p in plans)
    assert 100 < on < 200


@pytest.mark.parametrize("point", ["journal.before_fsync", "journal.after_fsync", "rowlog.before_fsync"])
def test_a_power_cut_inside_a_journal_flush_restores_from_the_tail_and_passes(point):
    # A deterministic schedule: `check` also compares the weights with the run without crashes.
    p = plan(schedule_seed(1, 6), index=10**6)
    assert p.settings.deterministic
    p = dataclasses.replace(p, journal=True, crashes=(Crash(at=2, point=point, power=True),),
                            fault_rate=0.0, max_faults=0)
    out = check(p)
    assert out.fired == [point] and not out.problems and out.failed_by_design is None and out.digest
    restored = [line for line in parse_trace(out.trace)[0] if line["event"] == "restored"]
    if point != "rowlog.before_fsync":  # there the cut tears the first flush's rows: nothing to restore
        assert out.journal_restores == 1 and out.journal_replayed > 0
        assert restored[-1]["journal_events_replayed"] == out.journal_replayed


def test_the_journal_off_restores_from_the_checkpoint_alone():
    p = dataclasses.replace(plan(schedule_seed(1, 6), index=10**6), journal=False,
                            crashes=(Crash(at=40),), fault_rate=0.0, max_faults=0)
    out = check(p)
    assert out.crashes == 1 and not out.problems and out.journal_restores == 0


@pytest.mark.parametrize("seed, index", [
    # the row log's directory, made by a process that failed its parent's fsync, vanished at
    # a later power cut under a durable journal whose seals named rows in it
    (5538753999894365358, 111),
    # a disk fault inside a sink: closing the journal released the half transition (a failure
    # that spent the infra budget, not its drop), and the restore sent one attempt too many
    (2770171316622869610, 352),
    # closing after a failed row-log write flushed the buffered seals naming the lost rows:
    # every restore then failed on a cut-short row frame
    (653103300812192787, 4),
    # the trace, closed after the journal on a disk-fault exit, released into a closed writer
    (3679193067137636706, 2),
    # a restart that replayed drops and trained no step ends without a new cut: the run's
    # custody is LATEST and its tail (the check read LATEST alone)
    (2307904307005706415, 249),
    # a journal close that failed at Stop was closed again on the way out (the world's own bug)
    (6001569392389376283, 164),
])
def test_journal_bugs_the_simulation_found_stay_fixed(seed, index):
    out = check(plan(seed, index=index))
    assert not out.problems


# -- multi-turn episodes (issue 12)


@on_the_sweep
def test_multi_turn_episodes_are_drawn_and_the_sweep_crashes_mid_episode(sweep):
    plans = [plan(schedule_seed(0, i), index=10**6) for i in range(200)]
    assert 60 < sum(p.script.turns > 1 for p in plans) < 140
    assert sweep.fired["ledger.turn_sealed"] > 0


def test_a_crash_between_turns_of_a_deterministic_run_continues_the_episodes_and_ends_identical():
    p = plan(schedule_seed(1, 6), index=10**6)
    assert p.settings.deterministic and p.settings.recovery_mode == "sibling"
    # (lost_versions: keep, or the turns the tail recorded are regenerated, not reused)
    p = dataclasses.replace(p, journal=True, script=dataclasses.replace(p.script, turns=3),
                            crashes=(Crash(at=30, point="ledger.turn_sealed"),), fault_rate=0.0, max_faults=0,
                            settings=dataclasses.replace(p.settings, lost_versions="keep"))
    out = check(p)  # also the digest of the same plan run without the crash
    assert not out.problems and out.crashes == 1
    lines, _ = parse_trace(out.trace)
    restored = [x for x in lines if x["event"] == "restored"]
    assert restored and restored[-1]["turns_reused"] > 0


# -- calls to the outside (docs/design.md §13; more in test_effects.py)


@on_the_sweep
def test_the_sweep_calls_the_judge_and_crashes_around_the_calls(sweep):
    assert sweep.effects > 800 and sweep.effect_calls > 10_000
    assert sweep.effect_resent > 100 and sweep.effect_answered > 100 and sweep.effect_unknown > 100
    for point in EFFECT_POINTS:
        assert sweep.fired[point] > 50, point
