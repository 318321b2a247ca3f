"""`reward.fn` (reward functions from the user's code) and `eval.path` (evaluation on a
held-out file): what they do in a run, and every hostile input refused at start-up with
exit 2, one paragraph, no traceback and nothing created."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from hostile import one_paragraph
from run_harness import DEFAULTS, FAST, config, trace_lines

from rollkeep import tasks
from rollkeep.cli import main
from rollkeep.config import load_config, semantic
from rollkeep.controller import train
from rollkeep.core.errors import ConfigMismatch

TINY_TORCH = [
    "engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=4",
    "trainer.model.n_layer=1", "trainer.model.n_head=2", "trainer.model.n_embd=32",
    "trainer.model.block_size=16", "trainer.micro_batch_size=16", "rollout.group_size=2",
    "train.num_prompts_per_step=2",
]


def module(tmp_path: Path, source: str) -> str:
    """Write `source` as a fresh module in `tmp_path` (the test's cwd); return its name."""
    name = f"rk_rewards_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(source)
    return name


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    tasks.use_rewards(None)


def rows_file(path: Path, n: int, task: str | None = "arith", start: int = 0) -> Path:
    lines = []
    for i in range(start, start + n):
        row = {"prompt": f"{i % 10}+{i % 7}=", "answer": str(i % 10 + i % 7)}
        if task is not None:
            row["task"] = task
        lines.append(json.dumps(row) + "\n")
    path.write_text("".join(lines))
    return path


def metrics(cfg) -> list[dict]:
    return [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]


def refused(capsys, args: list[str], run_dir: Path) -> str:
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert one_paragraph(err), err
    assert not run_dir.exists(), "a refused start created the run directory"
    return err


# -- reward.fn ------------------------------------------------------------------------------


def test_reward_fn_rewards_every_row_with_the_users_function(cwd) -> None:
    name = module(cwd, "def score(completion, row):\n    return 0.25 if row['prompt'] else 0.0\n")
    cfg = config(cwd / "run", "train.total_steps=3", f"reward.fn={name}:score")
    assert semantic(cfg)["reward"] == {"fn": f"{name}:score", "fns": None}  # it changes what is trained
    train(cfg)
    steps = [m for m in metrics(cfg) if "reward_mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["reward_mean"] == pytest.approx(0.25) for m in steps)
    # the run's function is not left installed for the next run in this process
    assert tasks.reward_fn("arith") is tasks.REWARDS["arith"]


def test_reward_fn_per_task_gives_a_new_task_its_function(cwd) -> None:
    name = module(cwd, "class Scorer:\n    @staticmethod\n    def poem(completion, row, *, bonus=0.0):\n"
                       "        return 0.75 + bonus\n")
    data = rows_file(cwd / "poems.jsonl", 40, task="poetry")
    cfg = config(cwd / "run", "train.total_steps=2", f"data.path={data}",
                 f"reward.fn={{poetry: '{name}:Scorer.poem'}}")
    train(cfg)
    assert all(m["reward_mean"] == pytest.approx(0.75) for m in metrics(cfg) if "reward_mean" in m)
    # without the mapping the task is unknown, as before
    with pytest.raises(Exception, match="no reward function for task 'poetry'"):
        train(config(cwd / "run2", f"data.path={data}"))


def test_a_reward_function_that_raises_or_returns_a_non_number_is_a_data_failure(cwd) -> None:
    name = module(cwd, "def score(completion, row):\n"
                       "    n = int(row['answer'])\n"
                       "    if n % 5 == 1:\n        raise ValueError('no score for ' + row['answer'])\n"
                       "    if n % 5 == 2:\n        return '0.5'\n"
                       "    return 1.0\n")
    cfg = config(cwd / "run", "train.total_steps=3", f"reward.fn={name}:score",
                 "rollout.max_data_attempts=1", "engine.data_fail_rate=0", "engine.infra_fail_rate=0")
    train(cfg)
    failed = [e["error"] for e in trace_lines(cfg) if e["event"] == "failed"]
    assert any(e.startswith(f"reward function {name}:score raised ValueError: no score for") for e in failed)
    assert any(f"reward function {name}:score raised TypeError:" in e and "returned '0.5' (str), not a number" in e for e in failed)
    dropped = [e for e in trace_lines(cfg) if e["event"] == "dropped"]
    assert dropped and all("data budget spent" in e["reason"] for e in dropped)
    assert all(m["reward_mean"] == 1.0 for m in metrics(cfg) if "reward_mean" in m)  # none of them trained


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("no-colon", "expected a `package.module:function` string"),
        ("missing-module", "module 'rk_no_such_module_x' cannot be imported"),
        ("missing-attribute", "has no attribute 'nope'"),
        ("not-callable", "is not callable"),
        ("wrong-signature", "cannot be called with (completion, row)"),
        ("import-fails", "importing module"),
    ],
)
def test_a_bad_reward_fn_is_refused_at_start_up(cwd, capsys, case, fragment) -> None:
    name = module(cwd, "SCORE = 3\n"
                       "def one(completion):\n    return 1.0\n"
                       "def score(completion, row):\n    return 1.0\n")
    broken = module(cwd, "raise RuntimeError('broken module')\n")
    spec = {
        "no-colon": f"{name}.score",
        "missing-module": "rk_no_such_module_x:score",
        "missing-attribute": f"{name}:nope",
        "not-callable": f"{name}:SCORE",
        "wrong-signature": f"{name}:one",
        "import-fails": f"{broken}:score",
    }[case]
    err = refused(capsys, ["train", DEFAULTS, *FAST, f"run_dir={cwd / 'run'}", f"reward.fn={spec}"],
                  cwd / "run")
    assert fragment in err and "reward.fn" in err
    if case == "missing-module":
        assert "PYTHONPATH" in err
    if case == "import-fails":
        assert "RuntimeError: broken module" in err


def test_changing_reward_fn_on_resume_is_a_semantic_change(cwd) -> None:
    name = module(cwd, "def score(completion, row):\n    return 0.5\n")
    train(config(cwd / "run", "train.total_steps=2"))
    with pytest.raises(ConfigMismatch, match="reward.fn"):
        train(config(cwd / "run", "train.total_steps=4", f"reward.fn={name}:score"))
    train(config(cwd / "run", "train.total_steps=4", f"reward.fn={name}:score"),
          allow_config_change=("reward.fn",))


# -- eval.path ------------------------------------------------------------------------------


@pytest.mark.slow
def test_eval_path_evaluates_a_dataset_run_on_the_held_out_file(tmp_path) -> None:
    data = rows_file(tmp_path / "train.jsonl", 32)
    held_out = rows_file(tmp_path / "eval.jsonl", 6, start=100)
    cfg = config(tmp_path / "run", *TINY_TORCH, f"data.path={data}", f"eval.path={held_out}",
                 "eval.every_steps=2", "train.total_steps=4")
    train(cfg)
    evals = [m for m in metrics(cfg) if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    assert all(0.0 <= m["eval/accuracy"] <= 1.0 for m in evals)


@pytest.mark.slow
def test_eval_configured_without_held_out_data_is_said_at_start_up(tmp_path, capsys) -> None:
    """Regression: with data.path set, eval silently never ran although eval.every_steps: 25."""
    data = rows_file(tmp_path / "train.jsonl", 16)
    cfg = config(tmp_path / "run", *TINY_TORCH, f"data.path={data}", "eval.every_steps=25",
                 "train.total_steps=1")
    train(cfg)
    err = capsys.readouterr().err
    assert "warning: eval.every_steps is 25 but there is no held-out data" in err
    assert "give eval.path" in err
    assert not [m for m in metrics(cfg) if "eval/accuracy" in m]


def test_eval_path_with_the_toy_trainer_or_no_cadence_is_said_too(tmp_path) -> None:
    from rollkeep.controller.build import build

    held_out = rows_file(tmp_path / "eval.jsonl", 3)
    parts = build(config(tmp_path / "run", f"eval.path={held_out}", "eval.every_steps=5"))
    assert parts.evaluator is None and len(parts.eval_rows) == 3
    assert parts.notes == ["eval.path is set but the toy trainer has no model to evaluate; no "
                           "evaluation runs (use trainer.name torch or hf)"]
    assert build(config(tmp_path / "run", "eval.every_steps=5")).notes == []  # toy: nothing to say


@pytest.mark.parametrize("case", ["missing", "fifo", "malformed", "no-prompt", "unknown-task"])
def test_a_bad_eval_path_is_refused_at_start_up_with_file_and_line(tmp_path, capsys, case) -> None:
    path = tmp_path / "eval.jsonl"
    if case == "fifo":
        os.mkfifo(path)
    elif case == "malformed":
        path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    elif case == "no-prompt":
        path.write_text('{"question": "1+1="}\n')
    elif case == "unknown-task":
        path.write_text('{"prompt": "1+1=", "task": "poetry"}\n')
    err = refused(capsys, ["train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}",
                           f"eval.path={path}"], tmp_path / "run")
    if case == "unknown-task":
        assert "no reward function for task 'poetry'" in err
        return
    assert str(path) in err
    if case == "fifo":
        assert "FIFO" in err
    if case in ("malformed", "no-prompt"):
        assert "line" in err


def test_eval_keys_are_not_semantic() -> None:
    a = load_config(None, ["eval.path=a.jsonl"])
    assert semantic(a) == semantic(load_config(None))
