"""The scheduler's side of partial generations (`recovery.partial: resume`, docs/design.md §5.3).

A streaming engine reports chunks of new tokens; with the journal on (sibling granularity)
they are recorded as `progressed` events whatever `recovery.partial` says (the trace then
shows what a kill cut off, and `rollkeep bench` counts it as generated),
coalesced: an attempt records at most once per `every_s` (the journal's flush interval, so
at most one record per attempt per flush), and once more, with what is left, just before
its seal, so the trace shows every attempt's first and last chunk. A chunk's tokens go to
the prefix store, and from there to the row log. With `recovery.partial: resume`, when a
sibling whose chain is kept (a restart, a graceful stop, an infra failure) is dispatched
again, its new attempt continues from the chain's tokens; with `regenerate` it starts over.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..events import Event, Progressed
from ..generation import Chunk, Prefix, Tokens
from ..prefixes import PrefixStore
from .commands import AttemptKey


class PartialGenerations:
    def __init__(self, prefixes: PrefixStore, *, enabled: bool, resume: bool, every_s: float) -> None:
        self.prefixes = prefixes
        self.enabled = enabled  # record chunks: sibling granularity, the journal on
        self.resume = resume  # and continue from them: recovery.partial=resume
        self.every_s = every_s
        self._resumed: dict[AttemptKey, int] = {}  # in-flight attempt -> prefix tokens it started from
        self._pending: dict[AttemptKey, list[Chunk]] = {}  # chunks not recorded yet
        self._next: dict[AttemptKey, float] = {}  # when the attempt may record again
        self.tokens_resumed = 0  # prefix tokens handed to engines by this run

    def prefix_for(self, key: AttemptKey) -> Prefix | None:
        """At dispatch: the sibling's kept chain, which the attempt continues (or None)."""
        if not self.resume:
            return None
        gid, g, _ = key
        prefix = self.prefixes.prefix(gid, g)
        if prefix is not None:
            self._resumed[key] = len(prefix)
            self.tokens_resumed += len(prefix)
        return prefix

    def resumed_from(self, key: AttemptKey) -> int:
        return self._resumed.get(key, 0)

    def on_chunk(self, key: AttemptKey, chunk: Chunk, now: float, apply: Callable[[Event], None]) -> None:
        """A chunk of the in-flight attempt `key` (the caller checked it is current)."""
        if not self.enabled or not len(chunk):
            return
        self._pending.setdefault(key, []).append(chunk)
        if now >= self._next.get(key, -np.inf):
            self._record(key, apply)
            self._next[key] = now + self.every_s

    def flush(self, key: AttemptKey, apply: Callable[[Event], None]) -> None:
        """Record what is left of the attempt's chunks (before its seal, or a stop)."""
        if self._pending.get(key):
            self._record(key, apply)

    def before_seal(self, key: AttemptKey, apply: Callable[[Event], None]) -> int:
        """`flush`, then forget the attempt; return its `resumed_from`."""
        self.flush(key, apply)
        resumed = self._resumed.get(key, 0)
        self.forget(key)
        return resumed

    def forget(self, key: AttemptKey) -> None:
        self._resumed.pop(key, None)
        self._pending.pop(key, None)
        self._next.pop(key, None)

    def forget_all(self) -> None:
        self._resumed.clear()
        self._pending.clear()
        self._next.clear()

    def _record(self, key: AttemptKey, apply: Callable[[Event], None]) -> None:
        gid, g, attempt = key
        chunks = self._pending.pop(key)
        tokens = chunks[0] if len(chunks) == 1 else Tokens(
            *(np.concatenate([getattr(c, f) for c in chunks]) for f in ("completion_ids", "logprobs", "versions")))
        total = self.prefixes.length(gid, g) + len(tokens)
        self.prefixes.stage(gid, g, tokens)
        apply(Progressed(group_id=gid, generation=g, attempt=attempt, tokens=total,
                         resumed_from=self._resumed.get(key, 0)))
