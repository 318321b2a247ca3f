"""`audit()`: the proof of the custody invariants listed at the top of `ledger.py`.

It runs in tests after every operation, at every checkpoint save and restore, and from
`rollkeep audit` on any checkpoint. It never raises on a bad ledger: it returns a report
listing every violation, readable by a person (`str(report)`) and by code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from pyroaring import BitMap

from ..errors import AuditFailure
from .events import GRANULARITIES
from .keys import group_id
from .ledger import MAX_ADVANTAGE, MAX_REASON, GroupState, Ledger, LedgerState

_A_RESERVED, _A_SEALED = 0, 2
_S_RESERVED, _S_GENERATING, _S_RTF, _S_READY, _S_CLAIMED = (
    int(GroupState.RESERVED), int(GroupState.GENERATING), int(GroupState.READY_TO_FINALIZE),
    int(GroupState.READY), int(GroupState.CLAIMED))
_MAX_LISTED = 8  # keys listed per violation; the count is always exact
_EPOCH, _ORDINAL, _STATE = attrgetter("epoch"), attrgetter("ordinal"), attrgetter("state")


@dataclass
class AuditReport:
    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def __str__(self) -> str:
        if self.ok:
            return "custody audit passed: " + ", ".join(f"{k} {v}" for k, v in self.counts.items())
        return "custody audit FAILED:\n" + "\n".join(f"  - {v}" for v in self.violations)

    def raise_if_failed(self, error=AuditFailure, **kw) -> None:
        if not self.ok:
            raise error(
                f"custody audit failed with {len(self.violations)} violation(s): "
                + "; ".join(self.violations[:5]),
                expected="every key below the cursor owned exactly once, and well-formed records",
                found=f"{len(self.violations)} violation(s)",
                **kw,
            )


def _listed(ordinals: Iterable[int], epoch: int) -> str:
    ords = list(ordinals)
    shown = ", ".join(group_id((epoch, o)) for o in ords[:_MAX_LISTED])
    more = f" and {len(ords) - _MAX_LISTED} more" if len(ords) > _MAX_LISTED else ""
    return f"{len(ords)} key(s): {shown}{more}"


def check_records(state: LedgerState) -> list[str]:
    """Invariants I3-I6: each record well formed, consistent with the version, and every
    persisted number within what the ledger's own records allow.

    Decoding a checkpoint runs this (restore step 4); `audit` runs it too.
    """
    bad: list[str] = []
    version, n_rows = state.version, state.n_rows
    n_states, n_gran = len(GroupState), len(GRANULARITIES)
    c = state.cursor
    if c[0] < 0 or not (0 <= c[1] < n_rows):
        bad.append(f"cursor {tuple(c)} outside [0, {n_rows})")
    if state.epochs is not None and c[0] > state.epochs or (
        state.epochs is not None and c[0] == state.epochs and c[1] != 0
    ):
        bad.append(f"cursor {tuple(c)} past the last epoch {state.epochs}")
    if version < 0:
        bad.append(f"version {version} < 0")
    # What was recorded at the newest version reached counts against it (LedgerState.max_version).
    top = state.max_version
    if top < version:
        bad.append(f"max_version {top} below the version {version}")
        top = version
    window = state.max_window
    zeros: dict[int, bytes] = {}
    for gid, r in state.groups.items():
        # Written for speed (it runs on every restore): int codes, not enum members, and
        # the group's name is only formatted when something is wrong.
        status = r.status
        n = len(status)
        if gid != f"e{r.epoch}.{r.ordinal}":
            bad.append(f"group {gid}: stored under the wrong id (its key is e{r.epoch}.{r.ordinal})")
        if not (0 <= r.idx < n_rows):
            bad.append(f"group {gid}: idx {r.idx} outside [0, {n_rows})")
        if r.epoch < 0 or not (0 <= r.ordinal < n_rows):
            bad.append(f"group {gid}: key outside the dataset")
        if n < 1 or len(r.attempts) != n or len(r.infra_failures) != n or len(r.data_failures) != n:
            bad.append(
                f"group {gid}: per-sibling arrays disagree (status {n}, attempts {len(r.attempts)}, "
                f"infra {len(r.infra_failures)}, data {len(r.data_failures)})"
            )
            continue
        if not (0 <= r.granularity < n_gran):
            bad.append(f"group {gid}: unknown granularity code {r.granularity}")
        s = r.state
        if not (0 <= s < n_states):
            bad.append(f"group {gid}: unknown state code {s}")
            continue
        if max(status) > _A_SEALED:
            bad.append(f"group {gid}: a current attempt is FAILED or ABANDONED (it must be superseded)")
        zero = zeros.get(n) or zeros.setdefault(n, bytes(n))
        if r.infra_failures != zero or r.data_failures != zero:
            for g in range(n):
                if r.attempts[g] < r.infra_failures[g] + r.data_failures[g]:
                    bad.append(f"group {gid}: sibling {g} has more failures than attempts")
                    break
        sealed = status.count(_A_SEALED)
        if s == _S_RESERVED:
            if status.count(_A_RESERVED) != n:
                bad.append(f"group {gid}: RESERVED but some attempt was dispatched")
            if r.target_step is not None or r.start_version is not None:
                bad.append(f"group {gid}: RESERVED but carries a target step or start version")
        elif r.start_version is None or not (0 <= r.start_version <= top):
            bad.append(f"group {gid}: admitted with start version {r.start_version} (newest version {top})")
        if s == _S_GENERATING and sealed == n:
            bad.append(f"group {gid}: GENERATING with every sibling sealed")
        if s >= _S_RTF and sealed != n:
            bad.append(f"group {gid}: {GroupState(s).name} with {n - sealed} unsealed sibling(s)")
        has_adv = s >= _S_READY
        if has_adv != (r.advantages is not None) or (has_adv and len(r.advantages) != n):
            bad.append(f"group {gid}: advantages present iff READY or CLAIMED, one per sibling")
        if (s == _S_CLAIMED) != (r.claim_step is not None):
            bad.append(f"group {gid}: claim step set iff CLAIMED")
        elif r.claim_step is not None and r.claim_step != version + 1:
            bad.append(f"group {gid}: claimed by step {r.claim_step}, but only step {version + 1} may claim")
        if r.target_step is not None and r.target_step <= version:
            bad.append(f"group {gid}: stamped for step {r.target_step}, already committed (version {version})")
        elif (
            r.target_step is not None
            and window is not None
            and r.start_version is not None
            and r.target_step > r.start_version + 1 + window
        ):
            bad.append(
                f"I6 group {gid}: stamped for step {r.target_step}, beyond its start version "
                f"{r.start_version} + 1 + the widest window {window}"
            )
        if r.advantages is not None and not all(abs(a) <= MAX_ADVANTAGE for a in r.advantages):
            bad.append(f"I6 group {gid}: advantages not finite or beyond {MAX_ADVANTAGE:g}: {r.advantages[:4]}")
    horizon = None if window is None else top + 1 + window
    limit = state.max_prompts_per_step
    for step, n in state.shortfall.items():
        if step <= version or n < 1:
            bad.append(f"shortfall {n} for step {step} (version {version})")
        elif (limit is not None and n > limit) or (horizon is not None and step > horizon):
            bad.append(f"I6 shortfall {n} for step {step}: beyond {limit} prompts per step or step {horizon}")
    for key, (reason, step) in state.dropped.items():
        if step < 1 or (horizon is not None and step > horizon):
            bad.append(f"I6 dropped {group_id(key)} at step {step}, outside [1, {horizon}]")
        if len(reason) > MAX_REASON:
            bad.append(f"I6 dropped {group_id(key)}: a reason of {len(reason)} characters (at most {MAX_REASON})")
    bad.extend(check_steps(state))
    return bad


def check_steps(state: LedgerState) -> list[str]:
    """Invariant I5: the step records account for every committed step and every key in
    TRAINED."""
    bad: list[str] = []
    limit = state.max_prompts_per_step
    expected_first, known, unknown_steps = 1, 0, 0
    for run in state.steps:
        if run.first != expected_first or run.last < run.first:
            bad.append(f"I5 step records cover steps {run.first}..{run.last}; expected a run from step {expected_first}")
            return bad
        expected_first = run.last + 1
        if run.groups is None or run.shortfall is None:
            unknown_steps += run.n_steps
            continue
        if run.groups < 1 or run.shortfall < 0:
            bad.append(f"I5 steps {run.first}..{run.last} trained {run.groups} group(s), short {run.shortfall}")
        elif limit is not None and run.groups + run.shortfall > limit:
            bad.append(
                f"I5 steps {run.first}..{run.last} trained {run.groups} group(s) (+{run.shortfall} short), "
                f"more than {limit} per step"
            )
        known += run.groups * run.n_steps
    if expected_first != state.version + 1:
        bad.append(f"I5 step records end at step {expected_first - 1}, but version is {state.version}")
    trained = sum(len(b) for b in state.trained.values())
    rest = trained - known
    if unknown_steps == 0 and rest != 0:
        bad.append(f"I5 TRAINED holds {trained} key(s), but the committed steps trained {known}")
    elif unknown_steps and not (unknown_steps <= rest and (limit is None or rest <= unknown_steps * limit)):
        bad.append(
            f"I5 TRAINED holds {trained} key(s): {rest} for {unknown_steps} step(s) without records, "
            f"expected between {unknown_steps} and {unknown_steps} x {limit}"
        )
    return bad


def audit(ledger: Ledger | LedgerState, *, records: bool = True) -> AuditReport:
    """Check invariants I1–I4. Returns a report; `report.raise_if_failed()` to enforce.

    `records=False` skips I3–I4 for a state that `codec.decode` has just checked."""
    state = ledger.capture() if isinstance(ledger, Ledger) else ledger
    report = AuditReport(violations=check_records(state) if records else [])
    n_rows = state.n_rows
    cursor_epoch, cursor_ordinal = state.cursor

    owners: dict[str, dict[int, BitMap]] = {
        "SPARE": {},
        "LEDGER/REPLAY": {},
        "TRAINED": {e: b for e, b in state.trained.items()},
        "DROPPED": {},
    }

    def add(owner: str, epoch: int, ordinal: int) -> None:
        bm = owners[owner].get(epoch)
        if bm is None:
            bm = owners[owner][epoch] = BitMap()
        if ordinal in bm:
            report.violations.append(f"{owner} holds {group_id((epoch, ordinal))} twice")
        bm.add(ordinal)

    for e, o in state.spare:
        add("SPARE", e, o)
    recs = state.groups.values()
    epochs, ordinals = list(map(_EPOCH, recs)), list(map(_ORDINAL, recs))
    if len(set(epochs)) == 1:  # the usual case: every group in flight is of one epoch
        owners["LEDGER/REPLAY"][epochs[0]] = BitMap(ordinals)
    else:
        by_epoch: dict[int, list[int]] = {}
        for e, o in zip(epochs, ordinals, strict=True):
            by_epoch.setdefault(e, []).append(o)
        for e, ords in by_epoch.items():
            owners["LEDGER/REPLAY"][e] = BitMap(ords)
    for e, o in state.dropped:
        add("DROPPED", e, o)

    epochs = {cursor_epoch} | {e for m in owners.values() for e in m}
    for e in sorted(epochs):
        limit = n_rows if e < cursor_epoch else (cursor_ordinal if e == cursor_epoch else 0)
        expected = BitMap(range(limit)) if limit else BitMap()
        held = [(name, m.get(e, BitMap())) for name, m in owners.items()]
        union = BitMap.union(*(bm for _, bm in held))
        if sum(len(bm) for _, bm in held) != len(union):
            for i, (na, a) in enumerate(held):
                for nb, b in held[i + 1 :]:
                    both = a & b
                    if both:
                        report.violations.append(f"I1 two owners ({na} and {nb}) for {_listed(both, e)}")
        missing = expected - union
        if missing:
            report.violations.append(f"I1 no owner for {_listed(missing, e)} below the cursor")
        past = union - expected
        if past:
            holders = [name for name, bm in held if bm & past]
            report.violations.append(
                f"I2 {'/'.join(holders)} hold(s) {_listed(past, e)} at or past the cursor {tuple(state.cursor)}"
            )

    replay = sum(map(_S_READY.__le__, map(_STATE, recs)))
    counts = {"spare": len(state.spare), "ledger": len(recs) - replay, "replay": replay}
    counts["trained"] = sum(len(b) for b in state.trained.values())
    counts["dropped"] = len(state.dropped)
    report.counts = counts
    return report
