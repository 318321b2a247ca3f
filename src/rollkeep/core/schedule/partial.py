"""The scheduler's side of partial generations (`recovery.partial: resume`, docs/design.md §5.3).

A streaming engine reports chunks of new tokens. With the journal on (sibling granularity)
they are recorded as `progressed` events whatever `recovery.partial` says (the trace then
shows what a kill cut off, and `rollkeep bench` counts it as generated), coalesced:

    an attempt's first record   `every_s` (`recovery.progress_ms`) after its first chunk
    then                        at most one per `every_s`
    before its seal             one more with what is left, if it recorded any (so the trace
                                shows the last chunk of every attempt it shows at all)
    at a stop                   what every attempt in flight has, whatever the interval

A generation shorter than `every_s` records nothing but its seal. (Recording every
attempt's first chunk at once tripled the default job's journal records, 183 k `progressed`
for 38 k seals and +40 % RL time, for tokens a restart regenerates in under `every_s`.)

A chunk's tokens go to the prefix store, and from there to the row log. With `recovery.
partial: resume`, when a sibling whose chain is kept (a restart, a graceful stop, an infra
failure) is dispatched again, its new attempt continues from the chain's tokens; with
`regenerate` it starts over.

A finished turn of a multi-turn episode (docs/design.md §5.4) is recorded at once, as a
`turn_sealed` event whose chunk is everything since the last record (the model's tokens and
the environment's response), at sibling granularity only (an all-or-nothing group
regenerates whole). A new attempt of the sibling continues after its last finished turn
whatever `recovery.partial` says; that decides only what happens to the tokens of the turn
in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from ..custody.events import Event, Progressed, TurnSealed
from ..rollout.generation import TOKEN_FIELDS, Chunk, Prefix, Tokens
from ..rollout.prefixes import PrefixStore
from .commands import AttemptKey

Apply = Callable[[Event], None]


class PartialGenerations:
    def __init__(self, prefixes: PrefixStore, *, enabled: bool, resume: bool, every_s: float,
                 turns: bool = True) -> None:
        self.prefixes = prefixes
        self.enabled = enabled  # record chunks: sibling granularity, the journal on, a streaming engine
        self.resume = resume  # and continue from them: recovery.partial=resume
        self.turns = turns  # continue after finished turns: sibling granularity
        self.every_s = every_s
        self._resumed: dict[AttemptKey, int] = {}  # in-flight attempt -> prefix tokens it started from
        self._end: dict[AttemptKey, int] = {}  # in-flight attempt -> tokens its records reach
        self._pending: dict[AttemptKey, list[Chunk]] = {}  # chunks not recorded yet
        self._due: dict[AttemptKey, float] = {}  # when the attempt records next
        self._recorded: set[AttemptKey] = set()  # attempts that recorded a chunk

    def prefix_for(self, key: AttemptKey) -> tuple[Prefix | None, tuple[int, ...], bytes | None]:
        """At dispatch: what the attempt continues from the sibling's kept chain: its tokens
        (all of them with `resume`, else through its last finished turn), the trajectory
        offsets where its finished turns end, and the last one's environment snapshot."""
        if not (self.resume or self.turns) or not len(self.prefixes):  # (the common case: nothing kept)
            return None, (), None
        gid, g, _ = key
        whole_turns = not self.resume
        chain = self.prefixes.chain(gid, g, whole_turns=whole_turns)
        if not chain:
            return None, (), None
        prefix = self.prefixes.prefix(gid, g, whole_turns=whole_turns)
        self._resumed[key] = self._end[key] = len(prefix)
        ends = tuple(link.end for link in chain if link.turn >= 0)
        snapshot = next((link.snapshot for link in reversed(chain) if link.turn >= 0), None)
        return prefix, ends, snapshot

    def on_turn(self, key: AttemptKey, trajectory: Tokens, turn: int, snapshot: bytes | None,
                apply: Apply) -> None:
        """The in-flight attempt `key` (the caller checked it is current) finished turn
        `turn`: record it with what its unrecorded chunks had, as one chunk. (Not at
        prompt-group granularity, whose groups regenerate whole.)"""
        if not self.turns:
            return
        gid, g, attempt = key
        self._pending.pop(key, None)
        start = self._end.get(key, 0)
        self.prefixes.stage(gid, g, Tokens(*(getattr(trajectory, f)[start:] for f in TOKEN_FIELDS)))
        apply(TurnSealed(group_id=gid, generation=g, attempt=attempt, turn=turn, tokens=len(trajectory),
                         resumed_from=self._resumed.get(key, 0), snapshot=snapshot))
        self._end[key] = len(trajectory)

    def on_chunk(self, key: AttemptKey, chunk: Chunk, now: float, apply: Apply) -> None:
        """A chunk of the in-flight attempt `key` (the caller checked it is current)."""
        if not self.enabled or not len(chunk):
            return
        self._pending.setdefault(key, []).append(chunk)
        due = self._due.get(key)
        if due is None:  # its first chunk: the first record is due one interval later
            self._due[key] = now + self.every_s
        elif now >= due:
            self._record(key, apply)
            self._due[key] = now + self.every_s

    def flush(self, key: AttemptKey, apply: Apply) -> None:
        """Record what is left of the attempt's chunks (at a stop)."""
        if self._pending.get(key):
            self._record(key, apply)

    def before_seal(self, key: AttemptKey, apply: Apply) -> int:
        """Record the attempt's last chunks if it recorded any before (else its seal says it
        all), then forget it; return its `resumed_from`."""
        if not (self._recorded or self._resumed or self._end or self._pending or self._due):
            return 0  # the common case (nothing streamed, nothing resumed): nothing to forget
        if key in self._recorded:
            self.flush(key, apply)
        resumed = self._resumed.get(key, 0)
        self.forget(key)
        return resumed

    def forget(self, key: AttemptKey) -> None:
        self._resumed.pop(key, None)
        self._end.pop(key, None)
        self._pending.pop(key, None)
        self._due.pop(key, None)
        self._recorded.discard(key)

    def forget_all(self) -> None:
        for table in (self._resumed, self._end, self._pending, self._due, self._recorded):
            table.clear()

    def _record(self, key: AttemptKey, apply: Apply) -> None:
        gid, g, attempt = key
        self._recorded.add(key)
        chunks = self._pending.pop(key)
        tokens = Tokens.joined(chunks)
        total = self._end.get(key, 0) + len(tokens)
        self.prefixes.stage(gid, g, tokens)
        apply(Progressed(group_id=gid, generation=g, attempt=attempt, tokens=total,
                         resumed_from=self._resumed.get(key, 0)))
        self._end[key] = total


