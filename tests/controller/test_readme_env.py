"""The user environment of docs/multiturn.md runs as written, under `env.factory`, and
survives kills."""

from __future__ import annotations

import sys

from run_harness import check, config, killed, run_child, run_to_end, trace_lines
from test_readme import all_python_blocks


def test_the_readme_environment_runs_and_resumes_mid_episode(tmp_path, monkeypatch) -> None:
    (code,) = [b for b in all_python_blocks() if "class GuessEnv" in b]
    (tmp_path / "my_env.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_env", None)
    cfg = config(tmp_path / "run", "env.factory=my_env:GuessEnv", "env.kwargs={high: 10}", "env.max_turns=4",
                 "engine.token_ms=1", "recovery.progress_ms=1")
    assert killed(run_child(cfg, "ledger.turn_sealed:100"))
    run_to_end(cfg)
    check(cfg)
    turns = [x for x in trace_lines(cfg) if x["event"] == "turn_sealed"]
    assert turns and max(x["turn"] for x in turns) >= 1, "episodes of several turns"
