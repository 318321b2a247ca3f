"""How config problems read on the command line (issue 28): the "remove the quotes" hint
only for a value that was quoted, one problem per line even when there is one, what came
from the command line said so, config diffs one key per line, and a run_dir of another job
answered with "use a new run_dir" rather than a flag per key."""

from __future__ import annotations

import pytest

from rollkeep.cli import main
from rollkeep.core.errors import ConfigMismatch
from rollkeep.core.restore.configdiff import check_compatible


def _error(capsys, *argv: str) -> list[str]:
    assert main(["train", *argv]) == 2
    return capsys.readouterr().err.splitlines()


def test_remove_the_quotes_only_when_the_value_was_quoted(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text('rollout:\n  group_size: four\n  max_infra_attempts: "3"\n')
    lines = _error(capsys, str(cfg), f"run_dir={tmp_path / 'run'}")
    assert '  - `rollout.group_size`: expected an integer; found "four" (a string)' in lines
    assert '  - `rollout.max_infra_attempts`: expected an integer; found "3" (a string); remove the quotes' in lines
    assert not (tmp_path / "run").exists()


def test_one_problem_is_on_its_own_line_and_named_as_the_command_lines(tmp_path, capsys) -> None:
    lines = _error(capsys, "configs/toy.yaml", "train.total_step=5", f"run_dir={tmp_path / 'run'}")
    assert lines[0].startswith("error: 1 problem in config file configs/toy.yaml with overrides")
    assert lines[1] == ("  - unknown key `train.total_step`; did you mean `train.total_steps`? "
                        "(from the command line)")
    assert lines[2].startswith("Nothing was run.")


def test_a_config_diff_has_one_key_per_line() -> None:
    with pytest.raises(ConfigMismatch) as e:
        check_compatible({"data": {"epochs": 3}, "rollout": {"group_size": 4}},
                         {"data": {"epochs": 2}, "rollout": {"group_size": 8}})
    lines = str(e.value).splitlines()
    assert "  - data.epochs: 3 -> 2" in lines and "  - rollout.group_size: 4 -> 8" in lines
    assert e.value.remedy.endswith("--allow-config-change data.epochs --allow-config-change rollout.group_size")


def test_another_jobs_run_dir_leads_with_use_a_new_run_dir() -> None:
    saved = {"engine": {"name": "toy"}, "trainer": {"name": "toy"}, **{f"k{i}": i for i in range(20)}}
    current = {"engine": {"name": "torch"}, "trainer": {"name": "torch"}, **{f"k{i}": -i - 1 for i in range(20)}}
    with pytest.raises(ConfigMismatch) as e:
        check_compatible(saved, current)
    assert str(e.value).startswith("this run_dir belongs to another job (engine.name 'toy' -> 'torch', "
                                   "trainer.name 'toy' -> 'torch'): use a new run_dir")
    assert "--allow-config-change" not in e.value.remedy and "run_dir=runs/NEW" in e.value.remedy
    # The flags still accept the change, key by key (strict by default, leniency by name).
    assert check_compatible(saved, current, allow=["engine", "trainer", *(f"k{i}" for i in range(20))])
