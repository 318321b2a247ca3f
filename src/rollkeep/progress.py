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


# The bar's fields by priority: at a narrow terminal the last ones go first. `step N/T`
# and the ETA are always shown; then the headline metrics, then the bar, the elapsed time,
# throughput, and last the custody counts (what a person debugging custody reads).
_KEEP_ORDER = ("reward", "acc", "replicas", "servers", "ckpt", "age", "tok/s", "gen", "ready", "trained",
               "dropped")
_BAR_MIN, _BAR_MAX = 10, 30


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


def bar_line(step: int, total: int, *, eta: str, elapsed: float, fields: dict[str, Any], width: int) -> Any:
    """One frame of the bar as a rich Text at most `width` columns wide:
    `step N/T`, the bar, the elapsed time, `eta ...`, then as many `fields` as fit, in
    `_KEEP_ORDER` (whole fields are dropped, never cut in the middle); the bar and the
    elapsed time are dropped before the headline metrics (reward, acc)."""
    from rich.text import Text

    head, tail = f"step {step}/{total}", f"eta {eta}"
    rank = {k: i for i, k in enumerate(_KEEP_ORDER)}
    shown = [(k, v) for k, v in sorted(fields.items(), key=lambda kv: rank.get(kv[0], len(rank)))
             if v is not None]
    parts = [_fmt({k: v}) for k, v in shown]
    headline = [p for (k, _), p in zip(shown, parts, strict=True) if k in ("reward", "acc")]

    def used(extra: list[str]) -> int:
        return len(head) + 1 + len(tail) + sum(2 + len(x) for x in extra)

    # The headline metrics first; then the bar and the elapsed time; then the rest.
    keep = [p for p in headline if used(headline[: headline.index(p) + 1]) <= width]
    clock = _clock(elapsed)
    room = width - used(keep) - 2 - len(clock) - 1  # "  ━━━ 0:00:12"
    bar = _BAR_MIN if room >= _BAR_MIN else 0
    if bar:  # a short bar, the fields that fit, then the room left widens the bar
        room -= bar
        for p in parts:
            if p in keep:
                continue
            if 2 + len(p) > room:
                break
            keep.append(p)
            room -= 2 + len(p)
        bar += min(room, _BAR_MAX - _BAR_MIN)
    text = Text(head, style="bold")
    if bar:
        done = 0 if total <= 0 else min(bar, round(bar * step / total))
        text.append(" ")
        text.append("━" * done, style="bar.complete")
        text.append("━" * (bar - done), style="bar.back")
        text.append(" " + clock, style="progress.elapsed")
    text.append(" " + tail)
    text.append("".join("  " + p for p in keep))
    text.truncate(width)
    return text


class _Frame:
    """The live bar's renderable: drawn at the console's width when rich refreshes it, so
    a resized terminal gets a bar that fits."""

    def __init__(self, total: int, step: int, started: float) -> None:
        self.total, self.step, self.started = total, step, started
        self.eta, self.fields = eta_text(None), {}

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield bar_line(self.step, self.total, eta=self.eta, elapsed=time.monotonic() - self.started,
                       fields=self.fields, width=options.max_width)


class RunProgress:
    """`mode`: "bar", "lines", "none" or "auto" (a bar on a terminal, lines otherwise).
    `verbose` (logger.verbose): each checkpoint gets its full line (size, the cut's hold,
    the write time); otherwise the bar shows the last checkpoint and lines mode prints
    one short line for it. `console`: the rich console of the bar (a test's fixed width)."""

    def __init__(self, mode: str, *, total_steps: int, start_step: int, verbose: bool = False,
                 console: Any = None) -> None:
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode, self.verbose = mode, verbose
        self._last_line = 0.0
        self._eta = Eta(total_steps)
        self._checkpoint: str | None = None  # the last checkpoint, shown in the bar
        self._bar: Any = None  # a rich Live in bar mode
        if mode == "bar":
            from rich.console import Console
            from rich.live import Live

            self._frame = _Frame(total_steps, start_step, time.monotonic())
            self._bar = Live(self._frame, console=console or Console(stderr=False, highlight=False),
                             auto_refresh=True, refresh_per_second=4, transient=False)
            self._bar.start()

    def step(self, step: int, fields: dict[str, Any]) -> None:
        now = time.monotonic()
        eta = eta_text(self._eta.update(step, now))
        if self._bar is not None:
            self._frame.step, self._frame.eta = step, eta
            self._frame.fields = {**fields, "ckpt": self._checkpoint}
        elif self.mode == "lines":
            if now - self._last_line >= 1.0:  # at most a line a second
                self._last_line = now
                print(f"step {step}/{self._eta.total_steps}  eta {eta}  {_fmt(fields)}", flush=True)

    def checkpoint(self, name: str, line: str, short: str) -> None:
        """A published checkpoint: `line` with logger.verbose; otherwise folded into the
        bar (`ckpt NAME`), or `short` in lines mode."""
        if self.verbose:
            self.note(line)
        elif self._bar is not None:
            self._checkpoint = name.removeprefix("step_").lstrip("0") or "0"
            self._frame.fields = {**self._frame.fields, "ckpt": self._checkpoint}
        else:
            self.note(short)

    def note(self, line: str) -> None:
        if self.mode == "none":
            return
        if self._bar is not None:
            self._bar.console.print(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.refresh()
            self._bar.stop()
