"""`reward.fns`: reward functions as TRL users write them (issue 28): several functions
summed with weights, each logged as `reward/<name>`; the per-sample signature
`f(completion, row)`, TRL's batched one `f(prompts, completions, **row_fields) -> list`,
and `async def`; `reward.fn` and `reward.fns` together is a config error."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from run_harness import DEFAULTS, FAST, config, events

from rollkeep import tasks
from rollkeep.cli import main
from rollkeep.config import load_config, semantic
from rollkeep.controller import train

NO_INJECTED = ["engine.data_fail_rate=0", "engine.infra_fail_rate=0", "train.total_steps=3"]

SOURCE = '''
import asyncio
CALLS = []

def per_sample(completion, row):                  # rollkeep's own signature
    return 0.5

def trl_style(prompts, completions, answer, **kwargs):   # TRL's reward_funcs signature
    CALLS.append((list(prompts), list(completions), list(answer), sorted(kwargs)))
    return [1.0 if c.strip() == a.strip() else 0.25 for c, a in zip(completions, answer)]

def completions_only(completions, **kwargs):
    return [2.0 for _ in completions]

def no_kwargs(completions, answer):               # batched, takes only what it names
    return [0.0 for _ in completions]

async def judged(completion, row):                 # async per sample
    await asyncio.sleep(0)
    return 0.125

async def judged_batch(prompts, completions, **kwargs):   # async batched
    await asyncio.sleep(0)
    return [None for _ in completions]             # TRL: None = no reward from this function

def wrong(a, b, c):
    return 0.0
'''


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    tasks.use_rewards(None)


def module(where: Path) -> str:
    name = f"rk_fns_{uuid.uuid4().hex[:10]}"
    (where / f"{name}.py").write_text(SOURCE)
    return name


def fns(*entries: str) -> str:
    return "reward.fns=[" + ", ".join(entries) + "]"


def metrics(cfg) -> list[dict]:
    lines = (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "reward_mean" in m]


def test_weighted_sum_and_a_metric_per_function_with_every_signature_kind(cwd) -> None:
    m = module(cwd)
    cfg = config(cwd / "run", *NO_INJECTED, fns(
        f'{{fn: "{m}:per_sample", weight: 2.0}}', f'{{fn: "{m}:completions_only", weight: -0.5, name: two}}',
        f'{{fn: "{m}:judged"}}', f'{{fn: "{m}:judged_batch", weight: 100}}', f'{{fn: "{m}:no_kwargs"}}'))
    assert semantic(cfg)["reward"]["fns"][0] == {"fn": f"{m}:per_sample", "weight": 2.0, "name": None}
    train(cfg)
    steps = metrics(cfg)
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        # 2*0.5 - 0.5*2 + 0.125 + (None: nothing) + 0 = 0.125
        assert s["reward_mean"] == pytest.approx(0.125)
        assert s["reward/per_sample"] == 0.5 and s["reward/two"] == 2.0 and s["reward/judged"] == 0.125
        assert s["reward/no_kwargs"] == 0.0
        assert "reward/judged_batch" not in s  # every value None: no mean that step
    assert events(cfg, "dropped") == [] and events(cfg, "failed") == []


def test_a_batched_function_gets_lists_of_prompts_completions_and_row_fields(cwd) -> None:
    m = module(cwd)
    cfg = config(cwd / "run", *NO_INJECTED, fns(f'{{fn: "{m}:trl_style"}}'))
    train(cfg)
    import importlib
    calls = importlib.import_module(m).CALLS
    assert calls, "the batched function was never called"
    for prompts, completions, answer, other in calls:
        assert len(prompts) == len(completions) == len(answer) == 1
        assert isinstance(prompts[0], str) and isinstance(completions[0], str)
        assert "task" in other  # the row's other fields come as keywords too
    steps = metrics(cfg)
    assert all(s["reward/trl_style"] == pytest.approx(s["reward_mean"]) for s in steps)


def test_reward_fn_alone_is_unchanged_and_logs_no_per_function_metric(cwd) -> None:
    m = module(cwd)
    cfg = config(cwd / "run", *NO_INJECTED, f"reward.fn={m}:per_sample")
    assert "fns" not in semantic(cfg)["reward"] or semantic(cfg)["reward"]["fns"] is None
    train(cfg)
    assert all(s["reward_mean"] == 0.5 and not any(k.startswith("reward/") for k in s) for s in metrics(cfg))


def test_a_failing_function_of_fns_is_a_data_failure_naming_it(cwd) -> None:
    m = module(cwd)
    (cwd / f"{m}_bad.py").write_text("def half(completion, row):\n"
                                     "    if len(row['prompt']) % 2:\n        raise KeyError('odd')\n"
                                     "    return 1.0\n")
    cfg = config(cwd / "run", *NO_INJECTED, "rollout.max_data_attempts=1",
                 fns(f'{{fn: "{m}:per_sample"}}', f'{{fn: "{m}_bad:half"}}'))
    train(cfg)
    errors = {e["error"] for e in events(cfg, "failed")}
    assert errors and all(e.startswith(f"reward function {m}_bad:half raised KeyError") for e in errors)


def test_fn_and_fns_together_and_bad_entries_are_refused_at_start_up(cwd, capsys) -> None:
    m = module(cwd)
    run_dir = cwd / "run"
    cases = [
        ([f"reward.fn={m}:per_sample", fns(f'{{fn: "{m}:judged"}}')], "`reward.fn` or `reward.fns`, not both"),
        ([fns(f'{{fn: "{m}:wrong"}}')], "cannot be called with (completion, row) nor batched"),
        ([fns(f'{{fn: "{m}:per_sample"}}', f'{{fn: "{m}:per_sample"}}')], "two reward.fns entries are named"),
        ([fns('{fn: "no_colon"}')], "reward.fns[0].fn"),
        ([fns(f'{{fn: "{m}:per_sample", weight: .inf}}')], "reward.fns[0].weight"),
    ]
    for overrides, fragment in cases:
        code = main(["train", DEFAULTS, *FAST, f"run_dir={run_dir}", *overrides])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and "Traceback" not in err, (overrides, err)
        assert not run_dir.exists()


def test_fns_is_semantic_and_old_checkpoints_read_it_as_null() -> None:
    from rollkeep.config.semantic_keys import ADDED_KEYS, is_semantic

    assert is_semantic("reward.fns") and ADDED_KEYS["reward.fns"] is None
    assert load_config(None, [*FAST]).reward.fns is None
