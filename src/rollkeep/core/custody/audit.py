"""`audit()`: the proof of the custody invariants listed at the top of `ledger.py`.

It runs in tests after every operation, at every checkpoint save and restore, and from
`rollkeep audit` on any checkpoint. It never raises on a bad ledger: it returns a report
listing every violation, readable by a person (`str(report)`) and by code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import attrgetter, is_not
from typing import NamedTuple

import numpy as np
from pyroaring import BitMap

from ..errors import AuditFailure
from .columns import GroupColumns
from .events import GRANULARITIES
from .keys import group_id
from .ledger import MAX_ADVANTAGE, MAX_REASON, GroupRecord, GroupState, Ledger, LedgerState

_A_RESERVED, _A_SEALED = 0, 2
_S_RESERVED, _S_GENERATING, _S_RTF, _S_READY, _S_CLAIMED = (
    int(GroupState.RESERVED), int(GroupState.GENERATING), int(GroupState.READY_TO_FINALIZE),
    int(GroupState.READY), int(GroupState.CLAIMED))
_MAX_LISTED = 8  # keys listed per violation; the count is always exact
_N_STATES, _N_GRAN = len(GroupState), len(GRANULARITIES)
_EXACT = 2.0**52  # below this a float64 holds every integer exactly


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


def check_records(state: LedgerState, columns: GroupColumns | None = None) -> list[str]:
    """Invariants I3-I6: each record well formed, consistent with the version, and every
    persisted number within what the ledger's own records allow.

    Decoding a checkpoint runs this (restore step 4); `audit` runs it too. `columns`: the
    state's `GroupColumns`, when the caller has them (else they are built here).
    """
    bad: list[str] = []
    version, n_rows = state.version, state.n_rows
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
    limits = _Limits(version, top, window, n_rows)
    for gid, r in _suspects(state, limits, columns):
        _check_group(gid, r, limits, bad)
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


class _Limits(NamedTuple):
    version: int
    top: int  # the newest version reached (at least `version`)
    window: int | None
    n_rows: int


def _check_group(gid: str, r: GroupRecord, lim: _Limits, bad: list[str]) -> None:
    """Append what is wrong with one record to `bad`. The reference for every per-record
    check: `_suspects` only picks, faster, which records must come here."""
    version, top, window, n_rows = lim
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
        return
    if not (0 <= r.granularity < _N_GRAN):
        bad.append(f"group {gid}: unknown granularity code {r.granularity}")
    s = r.state
    if not (0 <= s < _N_STATES):
        bad.append(f"group {gid}: unknown state code {s}")
        return
    if max(status) > _A_SEALED:
        bad.append(f"group {gid}: a current attempt is FAILED or ABANDONED (it must be superseded)")
    if any(r.infra_failures) or any(r.data_failures):
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


def _suspects(state: LedgerState, lim: _Limits, columns: GroupColumns | None) -> Iterable[tuple[str, GroupRecord]]:
    """The records `_check_group` may find something wrong with, in the state's order: every
    record that fails any of its checks, computed over columns (a superset; a record picked
    here and found sound costs only the time). Every record when the columns cannot be
    trusted to line up (per-sibling arrays of different lengths, an integer past int64)."""
    groups = state.groups
    if not groups:
        return ()
    cols = GroupColumns(groups) if columns is None else columns
    try:
        pick = _picked(cols, lim)
    except OverflowError:
        pick = None
    if pick is None:
        return groups.items()
    if not pick.any():
        return ()
    where = np.sort(cols.order[pick])  # back to the state's order, as the messages always came
    items = list(groups.items())
    return map(items.__getitem__, where.tolist())


def _picked(c: GroupColumns, lim: _Limits) -> np.ndarray | None:
    """Per record (key order): True where some check of `_check_group` may fail. None if
    the per-sibling columns do not line up."""
    version, top, window, n_rows = lim
    if not c.regular or max(abs(version), abs(top), abs(window or 0)) > _EXACT:
        return None
    n = len(c)
    epoch, ordinal, idx, gran, st = (c.ints(f) for f in ("epoch", "ordinal", "idx", "granularity", "state"))
    target, start, claim = (c.optional(f) for f in ("target_step", "start_version", "claim_step"))
    # A float loses integers past 2**53: such values go to the exact check.
    pick = (np.abs(target) > _EXACT) | (np.abs(start) > _EXACT) | (np.abs(claim) > _EXACT)
    expected_ids = list(map("e{}.{}".format, c.column("epoch"), c.column("ordinal")))
    if expected_ids != c.ids:
        pick |= np.fromiter(map(str.__ne__, c.ids, expected_ids), bool, n)
    pick |= (idx < 0) | (idx >= n_rows) | (epoch < 0) | (ordinal < 0) | (ordinal >= n_rows)
    pick |= (gran < 0) | (gran >= _N_GRAN) | (st < 0) | (st >= _N_STATES)
    sizes, starts, status = c.sizes, c.starts, c.status
    pick |= np.maximum.reduceat(status, starts) > _A_SEALED
    failures = c.flat("infra_failures").astype(np.int64) + c.flat("data_failures")
    if failures.any():
        pick |= np.logical_or.reduceat(failures > c.attempts, starts)
    sealed = np.add.reduceat(status == _A_SEALED, starts)
    reserved = st == _S_RESERVED
    has_target, has_start, has_claim = ~np.isnan(target), ~np.isnan(start), ~np.isnan(claim)
    pick |= reserved & ((np.add.reduceat(status == _A_RESERVED, starts) != sizes) | has_target | has_start)
    pick |= ~reserved & (~has_start | ~(start >= 0) | ~(start <= top))
    pick |= ((st == _S_GENERATING) & (sealed == sizes)) | ((st >= _S_RTF) & (sealed != sizes))
    adv = c.column("advantages")
    has_adv = np.fromiter(map(is_not, adv, repeat(None)), bool, n)
    pick |= has_adv != (st >= _S_READY)
    if has_adv.any():
        present = list(compress(adv, has_adv))
        lengths = np.fromiter(map(len, present), np.int64, len(present))
        values = np.fromiter(chain.from_iterable(present), np.float64, int(lengths.sum()))
        wrong = lengths != sizes[has_adv]
        wrong[np.repeat(np.arange(len(present)), lengths)[~(np.abs(values) <= MAX_ADVANTAGE)]] = True  # NaN too
        pick[has_adv] |= wrong
    pick |= (st == _S_CLAIMED) != has_claim
    pick |= has_claim & (claim != version + 1)
    pick |= has_target & (target <= version)
    if window is not None:
        pick |= has_target & has_start & (target > start + 1 + window)
    return pick


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


def audit(ledger: Ledger | LedgerState, *, records: bool = True, columns: GroupColumns | None = None) -> AuditReport:
    """Check invariants I1–I4. Returns a report; `report.raise_if_failed()` to enforce.

    `records=False` skips I3–I4 for a state that `codec.decode` has just checked.
    `columns`: the state's `GroupColumns`, when the caller has them."""
    state = ledger.capture() if isinstance(ledger, Ledger) else ledger
    cols = GroupColumns(state.groups) if columns is None and records else columns
    report = AuditReport(violations=check_records(state, cols) if records else [])
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
    epochs, ordinals, states = ((cols.column(f) for f in ("epoch", "ordinal", "state")) if cols is not None
                                else (list(map(attrgetter(f), recs)) for f in ("epoch", "ordinal", "state")))
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

    replay = sum(map(_S_READY.__le__, states))
    counts = {"spare": len(state.spare), "ledger": len(states) - replay, "replay": replay}
    counts["trained"] = sum(len(b) for b in state.trained.values())
    counts["dropped"] = len(state.dropped)
    report.counts = counts
    return report
