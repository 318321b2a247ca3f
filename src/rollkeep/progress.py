"""What a person watching a run sees: a live bar (rich) on a terminal, plain lines
otherwise, and one clear line per checkpoint and per restore. (rich is imported only for
the bar: a restart that prints lines, or nothing, does not pay for it.)"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any


def _fmt(fields: dict[str, Any]) -> str:
    parts = []
    for k, v in fields.items():
        if v is None:
            continue
        parts.append(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}")
    return "  ".join(parts)


class Eta:
    """Time left to `total_steps` at the pace of the last `window` steps of this process
    (a resumed run does not count the steps it restored; an eval or a slow start falls out
    of the window). The clock is an argument, so the arithmetic is testable without one."""

    def __init__(self, total_steps: int, *, window: int = 20) -> None:
        self.total_steps = total_steps
        self._seen: deque[tuple[int, float]] = deque(maxlen=window + 1)

    def update(self, step: int, now: float) -> float | None:
        """Seconds left after `step` committed at `now`; None until two steps were seen."""
        self._seen.append((step, now))
        (s0, t0), (s1, t1) = self._seen[0], self._seen[-1]
        if s1 <= s0:
            return None
        return max(0, self.total_steps - s1) * (t1 - t0) / (s1 - s0)


def duration(seconds: float) -> str:
    """3.2 s, 4m05s, 1h02m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def eta_text(seconds: float | None) -> str:
    return "?" if seconds is None else duration(seconds)


class RunProgress:
    """`mode`: "bar", "lines", "none" or "auto" (a bar on a terminal, lines otherwise)."""

    def __init__(self, mode: str, *, total_steps: int, start_step: int) -> None:
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self._last_line = 0.0
        self._eta = Eta(total_steps)
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
                TextColumn("eta {task.fields[eta]}"),
                TextColumn("{task.fields[info]}"),
                console=Console(stderr=False, highlight=False),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="",
                                          eta=eta_text(None))
            self._bar.start()

    def step(self, step: int, fields: dict[str, Any]) -> None:
        now = time.monotonic()
        eta = eta_text(self._eta.update(step, now))
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=_fmt(fields), eta=eta)
        elif self.mode == "lines":
            if now - self._last_line >= 1.0:  # at most a line a second
                self._last_line = now
                print(f"step {step}/{self._eta.total_steps}  eta {eta}  {_fmt(fields)}", flush=True)

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
