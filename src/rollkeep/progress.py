"""What a person watching a run sees: a live bar (rich) on a terminal, plain lines
otherwise, and one clear line per checkpoint and per restore. (rich is imported only for
the bar: a restart that prints lines, or nothing, does not pay for it.)"""

from __future__ import annotations

import sys
import time
from typing import Any


def _fmt(fields: dict[str, Any]) -> str:
    parts = []
    for k, v in fields.items():
        if v is None:
            continue
        parts.append(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}")
    return "  ".join(parts)


class RunProgress:
    """`mode`: "bar", "lines", "none" or "auto" (a bar on a terminal, lines otherwise)."""

    def __init__(self, mode: str, *, total_steps: int, start_step: int) -> None:
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self._last_line = 0.0
        self._bar: Any = None  # a rich Progress in bar mode
        if mode == "bar":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=False, highlight=False),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")
            self._bar.start()

    def step(self, step: int, fields: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=_fmt(fields))
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self._last_line >= 1.0:  # at most a line a second
                self._last_line = now
                print(f"step {step}  {_fmt(fields)}", flush=True)

    def note(self, line: str) -> None:
        if self.mode == "none":
            return
        if self._bar is not None:
            self._bar.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
