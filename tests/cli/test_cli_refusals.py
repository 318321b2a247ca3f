"""D15: command-line input that `simulate`, `chaos` and `report` used to ignore or turn into
a crash is refused before anything runs (exit 2, one paragraph, nothing on disk), and
`rollkeep report`, the command train's summary names, exists (`rollkeep trace` too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_harness import DEFAULTS, config

import rollkeep.chaos as chaos_mod
import rollkeep.simulate as simulate_mod
from rollkeep.cli import main
from rollkeep.controller import train
from rollkeep.simulate.schedules import Summary


def refused(capsys, args: list[str]) -> str:
    capsys.readouterr()
    got = main(args)
    err = capsys.readouterr().err
    assert got == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if a refused command starts a simulation or a training subprocess."""

    def ran(*args, **kwargs):
        raise AssertionError("a refused command started work")

    monkeypatch.setattr(simulate_mod, "simulate", ran)
    monkeypatch.setattr(simulate_mod, "check", ran)
    monkeypatch.setattr(chaos_mod.subprocess, "run", ran)
    monkeypatch.setattr(chaos_mod.subprocess, "Popen", ran)


# -- simulate ---------------------------------------------------------------------------------


def test_d15_simulate_index_without_replay_is_exit_2(capsys, nothing_runs) -> None:
    # It used to run the sweep and ignore --index.
    err = refused(capsys, ["simulate", "--index", "3", "--schedules", "2"])
    assert "--index is given without --replay" in err and "--replay SEED" in err


@pytest.mark.parametrize("n", [0, -1, 10**7 + 1, 10**30])
def test_d15_simulate_schedules_out_of_range_is_exit_2_with_the_bound(capsys, nothing_runs, n) -> None:
    err = refused(capsys, ["simulate", "--schedules", str(n)])
    assert f"--schedules {n} is out of range" in err and "from 1 to 10000000" in err


def test_d15_simulate_at_the_bound_runs(capsys, monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(simulate_mod, "simulate", lambda n, seed, **kw: asked.append(n) or Summary(schedules=n))
    assert main(["simulate", "--schedules", str(10**7)]) == 0
    assert asked == [10**7]
    assert main(["simulate", "--help"]) == 0
    assert "at most 10000000" in capsys.readouterr().out


# -- chaos ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, said", [
    (["--kills", "-1"], "--kills -1 is negative"),
    (["--replica-kills", "-2"], "--replica-kills -2 is negative"),
    (["--replica-kills", "3"], "--replica-kills 3 needs engine replicas on Ray"),
    (["--rank-kills", "-1"], "--rank-kills -1 is negative"),
    (["--kills", "2", "--rank-kills", "3"], "--rank-kills 3 is more than --kills 2"),
    (["--kills", "2", "--rank-kills", "1"], "--rank-kills 1 needs trainer ranks"),
    (["--kills", "2", "--rank-kills", "1", "engine.name=torch", "trainer.name=torch", "trainer.world_size=2",
      "cluster.backend=ray"],
     "--rank-kills 1 kills rank processes of the controller"),
])
def test_d15_chaos_kill_counts_it_cannot_honour_are_exit_2(tmp_path, capsys, nothing_runs, flags, said) -> None:
    # --kills -1 and --replica-kills 3 on the local backend used to report PASS with no kill.
    err = refused(capsys, ["chaos", DEFAULTS, f"run_dir={tmp_path / 'run'}", *flags])
    assert said in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["a-file", "a-file/below"])
def test_d15_chaos_workdir_that_is_not_a_usable_directory_is_exit_2(tmp_path, capsys, nothing_runs,
                                                                   where) -> None:
    # It used to start the reference run, which failed: exit 1, "the uninterrupted
    # reference run failed".
    (tmp_path / "a-file").write_text("mine")
    err = refused(capsys, ["chaos", DEFAULTS, f"run_dir={tmp_path / 'run'}", "--workdir", str(tmp_path / where)])
    assert "is not a directory chaos can run in" in err and str(tmp_path / where) in err
    assert (tmp_path / "a-file").read_text() == "mine" and not (tmp_path / "run").exists()


def test_d15_chaos_json_that_cannot_be_written_is_exit_2_before_the_runs(tmp_path, capsys, nothing_runs) -> None:
    err = refused(capsys, ["chaos", DEFAULTS, f"run_dir={tmp_path / 'run'}", "--json", str(tmp_path / "no" / "r.json")])
    assert "--json" in err and "no directory" in err


def test_d15_chaos_junk_numbers_are_exit_2(tmp_path, capsys, nothing_runs) -> None:
    for flag in ("--kills", "--replica-kills", "--seed"):
        assert main(["chaos", DEFAULTS, f"run_dir={tmp_path / 'run'}", flag, "abc"]) == 2
        assert f"argument {flag}: invalid int value" in capsys.readouterr().err


# -- report -----------------------------------------------------------------------------------


def test_d15_report_is_a_command_and_trace_its_alias(tmp_path, capsys) -> None:
    # train's summary says "`rollkeep report RUN_DIR` itemizes them"; the command was
    # `rollkeep trace` only (exit 2, invalid choice).
    cfg = config(tmp_path / "run", "train.total_steps=2")
    train(cfg)
    run_dir = Path(cfg.run_dir)
    capsys.readouterr()
    assert main(["report", str(run_dir), "--json", "--no-plots"]) == 0
    by_report = json.loads(capsys.readouterr().out)
    assert (run_dir / "report" / "report.md").is_file()
    assert main(["trace", str(run_dir), "--json", "--no-plots"]) == 0
    assert json.loads(capsys.readouterr().out) == by_report
    for name in ("report", "trace"):
        assert main([name, str(tmp_path / "missing")]) == 2
        assert "does not exist" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "report (trace)" in capsys.readouterr().out
