"""`logger.wandb`: the metrics of a run in a Weights & Biases run, offline, continued by a
resumed run (its id kept in RUN_DIR/wandb_run_id); refusals at start-up."""

from __future__ import annotations

import os
import sys
import types

import pytest
from run_harness import DEFAULTS, FAST, config

from rollkeep.cli import main
from rollkeep.controller import train
from rollkeep.controller.metrics import WANDB_ID_FILE


class FakeRun:
    def __init__(self, calls: list, **kwargs) -> None:
        self.calls = calls
        calls.append(("init", kwargs))

    def define_metric(self, name, **kw) -> None:
        self.calls.append(("define_metric", name, kw))

    def log(self, data) -> None:
        self.calls.append(("log", data))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch) -> list:
    """A `wandb` module that records what rollkeep asks of it."""
    calls: list = []
    module = types.ModuleType("wandb")
    module.init = lambda **kw: FakeRun(calls, **kw)
    module.teardown = lambda: calls.append(("teardown",))
    module.Table = lambda columns, data: ("table", tuple(columns), data)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_metrics_go_to_one_wandb_run_that_a_resumed_run_continues(tmp_path, fake_wandb) -> None:
    cfg = config(tmp_path / "run", "train.total_steps=4", "logger.wandb=true",
                 "logger.wandb_project=proj", "logger.wandb_name=first")
    train(cfg)
    kept = (tmp_path / "run" / WANDB_ID_FILE).read_text().strip()
    inits = [c[1] for c in fake_wandb if c[0] == "init"]
    assert len(inits) == 1
    assert inits[0]["id"] == kept and inits[0]["resume"] == "allow"
    assert (inits[0]["project"], inits[0]["name"], inits[0]["dir"]) == ("proj", "first", str(tmp_path / "run"))
    assert inits[0]["config"]["train"]["total_steps"] == 4  # the resolved config
    assert ("define_metric", "*", {"step_metric": "step"}) in fake_wandb
    logged = [c[1] for c in fake_wandb if c[0] == "log"]
    assert [d["step"] for d in logged] == [1, 2, 3, 4]
    assert all({"reward_mean", "batch_age", "custody/trained"} <= d.keys() for d in logged)
    assert fake_wandb[-2:] == [("finish",), ("teardown",)]  # what was logged is written

    fake_wandb.clear()
    train(config(tmp_path / "run", "train.total_steps=6", "logger.wandb=true"))
    [again] = [c[1] for c in fake_wandb if c[0] == "init"]
    assert again["id"] == kept and again["name"] == "run"  # default name: the run_dir's
    assert [c[1]["step"] for c in fake_wandb if c[0] == "log"] == [5, 6]


TORCH = ["engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=4", "trainer.model.n_layer=1",
         "trainer.model.n_head=2", "trainer.model.n_embd=32", "trainer.model.block_size=16",
         "data.generated.n_rows=32", "data.generated.eval_rows=8"]


def test_the_warm_start_and_the_eval_samples_log_into_the_same_wandb_run(tmp_path, fake_wandb) -> None:
    cfg = config(tmp_path / "run", *TORCH, "warmup.sft_steps=3", "warmup.sft_batch_size=4",
                 "train.total_steps=2", "eval.every_steps=2", "eval.num_samples=2", "logger.wandb=true")
    train(cfg)
    kept = (tmp_path / "run" / WANDB_ID_FILE).read_text().strip()
    inits = [c[1] for c in fake_wandb if c[0] == "init"]
    assert [(i["id"], i["resume"]) for i in inits] == [(kept, "allow")] * 2  # warm start, then RL: one W&B run
    assert [c for c in fake_wandb if c[0] in ("finish", "teardown")] == [("finish",), ("teardown",)] * 2
    # The warm start's keys plot against warmup/step, each by name (wandb picks any one
    # matching glob, and `*` matches them too).
    assert ("define_metric", "warmup/*", {"step_metric": "warmup/step"}) in fake_wandb
    assert ("define_metric", "warmup/loss", {"step_metric": "warmup/step"}) in fake_wandb
    logged = [c[1] for c in fake_wandb if c[0] == "log"]
    warm = [d for d in logged if "warmup/step" in d]
    assert [d["warmup/step"] for d in warm] == [1, 2, 3] and not any("step" in d for d in warm)
    assert all({"warmup/loss", "warmup/seconds"} <= d.keys() for d in warm)
    tables = [(d["step"], d["eval/samples"]) for d in logged if "eval/samples" in d]
    assert [step for step, _ in tables] == [0, 2]
    assert all(t[1] == ("prompt", "completion", "reward", "answer") and len(t[2]) == 2 for _, t in tables)
    assert [d["step"] for d in logged if "reward_mean" in d] == [1, 2]


def test_without_logger_wandb_nothing_is_sent(tmp_path, fake_wandb) -> None:
    train(config(tmp_path / "run", "train.total_steps=2"))
    assert fake_wandb == [] and not (tmp_path / "run" / WANDB_ID_FILE).exists()


def test_wandb_not_installed_is_refused_at_start_up(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}", "logger.wandb=true"])
    err = capsys.readouterr().err
    assert code == 2 and "rollkeep[wandb]" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kept", ["not an id!", "fifo"])
def test_a_damaged_kept_wandb_id_is_refused_at_start_up(tmp_path, capsys, fake_wandb, kept) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if kept == "fifo":
        os.mkfifo(run / WANDB_ID_FILE)
    else:
        (run / WANDB_ID_FILE).write_text(kept)
    code = main(["train", DEFAULTS, *FAST, f"run_dir={run}", "logger.wandb=true"])
    err = capsys.readouterr().err
    assert code == 2 and WANDB_ID_FILE in err and "Traceback" not in err and err.count("\n") == 1, err
    assert sorted(p.name for p in run.iterdir()) == [WANDB_ID_FILE] and fake_wandb == []


def test_real_wandb_offline_run_is_continued_on_resume(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    run = tmp_path / "run"
    train(config(run, "train.total_steps=2", "logger.wandb=true"))
    train(config(run, "train.total_steps=3", "logger.wandb=true"))
    kept = (run / WANDB_ID_FILE).read_text().strip()
    # one offline run directory per process, both logging into the W&B run `kept` (a second
    # start within the same second gets a `-1` suffix from wandb)
    logs = sorted((run / "wandb").glob(f"offline-run-*-{kept}*/run-{kept}.wandb"))
    assert len(logs) == 2, sorted(p.name for p in (run / "wandb").iterdir())
    for log in logs:
        data = log.read_bytes()
        assert b"reward_mean" in data and b"custody/trained" in data, (log, len(data))


def test_the_wandb_keys_are_not_semantic() -> None:
    from rollkeep.config import load_config, semantic

    on = load_config(None, ["logger.wandb=true", "logger.wandb_project=p", "logger.wandb_name=n"])
    assert semantic(on) == semantic(load_config(None))
