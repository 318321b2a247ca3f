"""What a person watching a run sees: the bar keeps `step N/T` and the ETA at any width
(an 80-column terminal once showed `eta… reward 0.43 … trained 7232 dr…`: no step, no
ETA), drops the custody counts first, and shows the last checkpoint instead of a line per
checkpoint unless logger.verbose asks for those."""

from __future__ import annotations

import io
import re

from rich.console import Console

from rollkeep.config import load_config
from rollkeep.progress import RunProgress, bar_line

FIELDS = {"reward": 0.43, "acc": 0.48, "age": 1, "tok/s": 698, "gen": 0, "ready": 16, "trained": 7232,
          "dropped": 0}


def _frame(width: int, **kw) -> str:
    return bar_line(69, 2000, eta="17m00s", elapsed=65.0, fields={**FIELDS, **kw}, width=width).plain


def test_at_80_columns_the_step_the_eta_and_the_headline_metric_stay_and_custody_goes() -> None:
    line = _frame(80)
    assert len(line) <= 80
    assert line.startswith("step 69/2000 ") and "eta 17m00s" in line
    assert "reward 0.43" in line and "acc 0.48" in line
    assert "trained" not in line and "dropped" not in line  # the custody counts go first
    assert "…" not in line  # whole fields are dropped, none is cut in the middle


def test_at_120_columns_more_fields_fit_in_priority_order() -> None:
    line = _frame(120)
    assert len(line) <= 120
    assert "step 69/2000" in line and "eta 17m00s" in line and "0:01:05" in line and "━" in line
    assert "tok/s 698" in line and "dropped" not in line
    assert line.index("reward") < line.index("age") < line.index("tok/s")
    wide = _frame(200)
    assert all(k in wide for k in FIELDS) and len(wide) <= 200


def test_even_a_very_narrow_terminal_keeps_step_and_eta() -> None:
    for width in (24, 40, 60):
        line = _frame(width)
        assert line.startswith("step 69/2000") and "eta 17m00s" in line and len(line) <= max(width, 23)
    assert "━" not in _frame(40)  # the bar goes before the headline metric
    assert "reward 0.43" in _frame(40)


def _progress(width: int, **kw) -> tuple[RunProgress, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None, highlight=False)
    return RunProgress("bar", total_steps=20, start_step=0, console=console, **kw), out


def test_the_live_bar_at_a_forced_width_shows_step_and_eta() -> None:
    for width in (80, 120):
        progress, out = _progress(width)
        for step in range(1, 6):
            progress.step(step, FIELDS)
        progress.close()
        shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", out.getvalue()).replace("\r", "\n")
        last = [line for line in shown.splitlines() if "step 5/20" in line]
        assert last, out.getvalue()
        text = last[-1]
        assert "eta " in text and "reward 0.43" in text and len(text) <= width


def test_a_checkpoint_is_folded_into_the_bar_unless_verbose() -> None:
    progress, out = _progress(120)
    progress.step(3, FIELDS)
    progress.checkpoint("step_000003", "checkpoint step_000003: 8.31 MB; the cut held the loop 40 us", "short")
    progress.step(4, FIELDS)
    progress.close()
    text = out.getvalue()
    assert "ckpt 3" in text and "the cut held" not in text and "short" not in text

    progress, out = _progress(120, verbose=True)
    progress.checkpoint("step_000003", "checkpoint step_000003: 8.31 MB; the cut held the loop 40 us", "short")
    progress.close()
    assert "the cut held the loop 40 us" in out.getvalue()


def test_lines_mode_prints_the_short_checkpoint_line(capsys) -> None:
    progress = RunProgress("lines", total_steps=20, start_step=0)
    progress.checkpoint("step_000003", "the long line", "checkpoint step_000003 (8.31 MB)")
    progress.close()
    assert capsys.readouterr().out == "checkpoint step_000003 (8.31 MB)\n"
    verbose = RunProgress("lines", total_steps=20, start_step=0, verbose=True)
    verbose.checkpoint("step_000003", "the long line", "short")
    assert capsys.readouterr().out == "the long line\n"


def test_logger_verbose_is_off_by_default_and_not_semantic() -> None:
    from rollkeep.config import semantic
    from rollkeep.config.semantic_keys import is_semantic

    assert load_config(None, []).logger.verbose is False
    assert load_config(None, ["logger.verbose=true"]).logger.verbose is True
    assert not is_semantic("logger.verbose")
    assert semantic(load_config(None, ["logger.verbose=true"])) == semantic(load_config(None, []))
