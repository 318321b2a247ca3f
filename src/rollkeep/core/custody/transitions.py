"""The custody state machine as data: for a group's state, and for each sibling's current
attempt, which events are legal and the state each one leads to (docs/design.md §1).

`Ledger.apply` looks every event up here before it changes anything; a pair that is not
listed is an `IllegalTransition`. The tests (tests/core/test_ledger_transitions.py) try every
(state, event) pair of both tables' events: a listed pair must lead to the state listed
(GONE: the record leaves the ledger), any other must be refused and change nothing. The
few rules no table can express (a sealed sibling is abandoned only in an all-or-nothing
group, or for a lost version, which alone takes a complete group back to GENERATING; a
duplicate seal; a group's last seal makes it READY_TO_FINALIZE) are the ledger's
`_special_rules_*` and its `sealed` handler, tested on their own.
"""

from __future__ import annotations

from .events import GRANULARITIES, PROMPT_GROUP
from .records import AttemptStatus, GroupState

__all__ = ["ATTEMPT_NEXT", "ATTEMPT_TABLE", "GONE", "GRANULARITY_CODE", "GROUP_NEXT", "GROUP_TABLE",
           "PROMPT_GROUP_CODE"]

GONE = -1  # the record leaves the ledger (TRAINED or DROPPED)

_S, _A = GroupState, AttemptStatus

#: (group state, event) → next group state. Pairs not listed are illegal.
GROUP_TABLE: dict[tuple[GroupState, str], int] = {
    (_S.RESERVED, "admitted"): _S.GENERATING,
    (_S.RESERVED, "dropped"): GONE,
    (_S.GENERATING, "dispatched"): _S.GENERATING,
    (_S.GENERATING, "progressed"): _S.GENERATING,
    (_S.GENERATING, "turn_sealed"): _S.GENERATING,
    (_S.GENERATING, "effect_intent"): _S.GENERATING,
    (_S.GENERATING, "effect_done"): _S.GENERATING,
    (_S.GENERATING, "sealed"): _S.GENERATING,  # READY_TO_FINALIZE when the last sibling seals
    (_S.GENERATING, "failed"): _S.GENERATING,
    (_S.GENERATING, "abandoned"): _S.GENERATING,
    (_S.GENERATING, "dropped"): GONE,
    (_S.READY_TO_FINALIZE, "finalizing"): _S.FINALIZING,
    (_S.READY_TO_FINALIZE, "abandoned"): _S.GENERATING,  # reason LOST_VERSION only: `_special_rules_abandon`
    (_S.READY_TO_FINALIZE, "dropped"): GONE,
    (_S.FINALIZING, "ready"): _S.READY,
    (_S.FINALIZING, "released"): _S.READY_TO_FINALIZE,
    (_S.FINALIZING, "dropped"): GONE,
    (_S.READY, "claimed"): _S.CLAIMED,
    (_S.READY, "evicted"): _S.RESERVED,
    (_S.READY, "abandoned"): _S.GENERATING,  # reason LOST_VERSION only: `_special_rules_abandon`
    (_S.READY, "dropped"): GONE,
    (_S.CLAIMED, "released"): _S.READY,
    (_S.CLAIMED, "step_committed"): GONE,
}

#: (current attempt status, event) → status of the sibling's current attempt afterwards.
#: "failed" and "abandoned" end the attempt and open a fresh RESERVED one.
ATTEMPT_TABLE: dict[tuple[AttemptStatus, str], int] = {
    (_A.RESERVED, "dispatched"): _A.DISPATCHED,
    (_A.DISPATCHED, "progressed"): _A.DISPATCHED,
    (_A.DISPATCHED, "turn_sealed"): _A.DISPATCHED,
    (_A.DISPATCHED, "effect_intent"): _A.DISPATCHED,
    (_A.DISPATCHED, "effect_done"): _A.DISPATCHED,
    (_A.DISPATCHED, "sealed"): _A.SEALED,
    (_A.DISPATCHED, "failed"): _A.RESERVED,
    (_A.DISPATCHED, "abandoned"): _A.RESERVED,
    (_A.SEALED, "abandoned"): _A.RESERVED,  # all-or-nothing groups, or LOST_VERSION: `_special_rules_abandon`
}

# The same tables keyed and valued by plain ints, as the ledger's records store states
# (an int lookup is cheaper than an enum's on the hot path).
GROUP_NEXT: dict[tuple[int, str], int] = {(int(s), e): int(n) for (s, e), n in GROUP_TABLE.items()}
ATTEMPT_NEXT: dict[tuple[int, str], int] = {(int(s), e): int(n) for (s, e), n in ATTEMPT_TABLE.items()}

#: A group's granularity as its records store it (an index into `events.GRANULARITIES`).
GRANULARITY_CODE: dict[str, int] = {g: i for i, g in enumerate(GRANULARITIES)}
PROMPT_GROUP_CODE = GRANULARITY_CODE[PROMPT_GROUP]
