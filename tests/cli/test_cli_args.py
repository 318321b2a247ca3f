"""Command-line parsing shared by the subcommands."""

from __future__ import annotations

import rollkeep.cli.train as train_cli
from rollkeep.cli import main


def test_overrides_may_follow_options(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(train_cli, "run", lambda args: seen.update(vars(args)) or 0)
    assert main(["train", "cfg.yaml", "a.b=1", "--allow-config-change", "seed", "seed=3", "x=[1, 2]"]) == 0
    assert seen["config"] == "cfg.yaml"
    assert seen["overrides"] == ["a.b=1", "seed=3", "x=[1, 2]"]
    assert seen["allow_config_change"] == ["seed"]


def test_unknown_arguments_are_refused(monkeypatch, capsys) -> None:
    monkeypatch.setattr(train_cli, "run", lambda args: 0)
    assert main(["train", "cfg.yaml", "--allow-config-change", "seed", "stray"]) == 2
    assert "unrecognized arguments: stray" in capsys.readouterr().err
    assert main(["inspect", "path", "a=1"]) == 2


def test_train_pauses_the_collector_only_for_start_up(monkeypatch, tmp_path) -> None:
    # `rollkeep train` imports with the cyclic GC paused, freezes what the imports made,
    # and runs the job with the collector on (as it was before the command).
    import gc

    import rollkeep.controller as controller
    from rollkeep.controller import RunResult

    seen = {}

    def fake_train(cfg, **kwargs):
        seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
        return RunResult(0, "0" * 64, "finished")

    monkeypatch.setattr(controller, "train", fake_train)
    assert gc.isenabled()
    try:
        assert main(["train", "tests/data/defaults.yaml", f"run_dir={tmp_path / 'r'}"]) == 0
    finally:
        gc.unfreeze()  # give this test process its objects back
    assert seen["enabled"] and seen["frozen"] > 0
    assert gc.isenabled()
