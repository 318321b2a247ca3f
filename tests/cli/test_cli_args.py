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
