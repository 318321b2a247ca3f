"""The report's model: what the restarts of a run cost, read from `RUN_DIR/trace.jsonl` and `metrics.jsonl`.

`analyse(run_dir)` is pure: it reads the two files (a run directory may still be written
while it reads; torn lines are skipped and counted) and returns a `Report`.
`write_report(run_dir, report)` writes `RUN_DIR/report/`: `report.md`, `report.json` and
the PNG plots (matplotlib, the `report` extra: `PLOTS` always, `RESTART_PLOTS` when
the run was restarted). `rollkeep report RUN_DIR` runs both.

The model behind every number is the **surviving history**: the trace lines the final
state descends from. Walking the runs in order, a restart from a checkpoint whose cut was
taken at unix time T forgets every earlier line after T (work the checkpoint does not
hold); a fresh restart forgets everything. `lineage()` is the same walk for step commits.

Definitions (also in `DEFINITIONS`, written into the report):

- **tokens thrown away** at a restart = the `sealed.tokens` of every surviving seal made
  by an earlier run after the restored checkpoint's `cut_time` (rows the checkpoint does
  not hold), plus the tokens of the sealed siblings the checkpoint does hold but that the
  resumed run abandoned with reason "restart" (an all-or-nothing group that was not
  complete at the cut) or dropped while restoring (recovery.mode=cursor_only loses every
  group in flight at the cut). Each seal is counted once, at the first restart that
  loses it.
- **thrown-away generation time** = for each (group_id, generation) the resumed run
  abandoned with reason "restart": `cut_time` minus the time of that attempt's last
  `dispatched` before the cut (clamped at 0), summed. For a sealed sibling of an
  all-or-nothing group this includes the time the row waited for its siblings. Each
  dispatch is counted once, at the first restart that throws it away.
- **lost progress** = from the previous run's kill (its last trace line) until the resumed
  run committed again the last step the previous run had committed; if the previous run
  committed nothing after the restored checkpoint's step, until the resumed run's first
  commit instead. After a graceful stop (SIGINT/SIGTERM, the end of the steps or of the
  data: a `run_finished` line) the time the run directory sat idle is not lost: the clock
  starts when the resumed run starts, and it is 0 when the stop's final checkpoint holds
  every step the stopped run committed (nothing to redo). Null while that commit has not
  happened (yet).
- **group completion time** = a group's last surviving `ready` before the commit that
  trained it minus its first surviving `taken` (a group taken by an earlier run counts
  from there, across the downtime).
- **batch age** = the token-weighted number of weight versions between generating a token
  and training on it (metrics.jsonl `batch_age`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.custody.ledger import COUNT_KEYS

TRACE = "trace.jsonl"
METRICS = "metrics.jsonl"
REPORT_DIR = "report"
#: Written for every run: the learning curves.
PLOTS = ("reward.png", "training.png")
#: Written only when the run was restarted: on a run never interrupted they are a flat
#: line (batch age), a solid block (custody) and nothing (cost), and teach nothing.
RESTART_PLOTS = ("batch_age.png", "custody.png", "restart_cost.png")
#: The trainer's metrics plotted in training.png and summed up in report.md: (StepInfo
#: field, metrics.jsonl key, label, what it tells).
TRAINING = (
    ("loss", "trainer/loss", "loss",
     "the GRPO policy loss. It need not fall: advantages are centred in every group, so a "
     "flat loss around 0 is normal; what should rise is the reward and the held-out accuracy."),
    ("kl", "trainer/kl", "KL to the reference",
     "how far the policy has moved from the reference model (0 when `kl_coef` is 0 and no "
     "reference is kept). A steady climb is learning; a sudden jump is a step that moved the "
     "policy a lot at once."),
    ("clip_frac", "trainer/clip_frac", "clip fraction",
     "the fraction of completion tokens whose PPO-clipped branch is active. Near 0 means the "
     "updates stay within `clip_eps`; a sustained high value (say above 0.2) means the "
     "batches are far off-policy or the learning rate is too high."),
    ("grad_norm", "trainer/grad_norm", "grad norm",
     "the global gradient norm before clipping to `grad_clip`. Isolated spikes are clipped "
     "away; a norm that grows step after step is an unstable run."),
    ("response_length", "response_length/mean", "response length (tokens)",
     "the mean completion length of the step's batch. Lengths pinned at `max_new_tokens` "
     "(see `response_length/clip_ratio` in metrics.jsonl) mean completions are cut off; a "
     "collapse to 1 token means the policy learned to stop at once."),
)
#: What a spike of batch age after a restart means (report.md and batch_age.png).
BATCH_AGE_SPIKE = (
    "Batch age is how many weight versions older than the step that trains them its tokens "
    "are (token-weighted). A spike right after a restart is expected, and no breach of "
    "`max_lookahead_versions`: the restart reuses rows generated before the stop (kept by the "
    "checkpoint or the journal) instead of generating them again, and those rows are as many "
    "versions old as the steps between their generation and the step that finally trains "
    "them. It lasts until they are used up. A spike with no restart before it is not this."
)
#: What the custody plot shows (report.md and custody.png).
CUSTODY_NOTE = (
    "custody.png shows who holds the prompts after each step. Right after a restart, a jump of "
    "`ready` is finished groups the restart reused, and one of `generating` the siblings it sent "
    "out again; `trained` and `dropped` only grow along the surviving history (a prompt that "
    "fell out of custody would show as a drop there)."
)
OWNERS = COUNT_KEYS  # the custody counts of every metrics line, in this order
RESTORED_COUNTS = (
    "groups_reused", "groups_finalize_again", "siblings_reused", "siblings_regenerated",
    "siblings_pending", "groups_readmitted", "spare_prompts", "groups_lost",
)

DEFINITIONS: dict[str, str] = {
    "surviving history": "the trace lines the final state descends from: a restart from a "
    "checkpoint cut at time T forgets every earlier line after T, except the first "
    "`journal_events_replayed` ledger events after it (the journal's tail, which it replayed); "
    "a fresh restart forgets all.",
    "tokens kept by the journal": "tokens of the seals in the journal's tail a restart replayed: "
    "generated after the checkpoint, not thrown away.",
    "tokens thrown away": "tokens of seals an earlier run made after the restored checkpoint's "
    "cut (the checkpoint does not hold them), plus tokens of sealed siblings the checkpoint "
    "holds but the resumed run abandoned with reason 'restart' (all-or-nothing groups) or "
    "dropped while restoring (recovery.mode=cursor_only); "
    "each seal counted once, at the first restart that loses it.",
    "thrown-away generation time": "for each (group, generation) the resumed run abandoned "
    "with reason 'restart': the restored cut_time minus that attempt's last dispatch before "
    "the cut (clamped at 0), summed; each dispatch counted once.",
    "attempts abandoned": "(group, generation) pairs the resumed run abandoned with reason "
    "'restart'.",
    "turns reused": "finished turns of multi-turn episodes the restart continues after "
    "(the `restored` event's turns_reused): only the turn in flight is generated again.",
    "calls made": "calls to the outside (rollkeep.effects) a process made anew: its "
    "`effect_intent` lines.",
    "calls answered from the record": "calls a process did not make because a restored record "
    "held their outcome (`effect_answered` lines, resent false): the cost and the effect of a "
    "second call avoided.",
    "calls sent again": "calls whose outcome died with the killed process, sent again with the "
    "same idempotency key (`on_unknown: retry`; `effect_answered` lines, resent true).",
    "turns regenerated": "finished turns the killed run traced for the siblings the restart "
    "abandoned, beyond the ones it reused: turns that were not durable yet (the journal's "
    "last flush had not reached them) and are played again.",
    "tokens reused": "tokens of the sealed rows the restored checkpoint holds that the resumed "
    "run keeps.",
    "lost progress": "from the previous run's kill (its last trace line) until the resumed run "
    "committed again the last step the previous run had committed; if the previous run committed "
    "nothing after the checkpoint's step, until the resumed run's first commit. After a graceful "
    "stop the idle time does not count: the clock starts when the resumed run starts, and it is 0 "
    "when the stop's final checkpoint holds every step it committed. Empty while that commit has "
    "not happened.",
    "group completion time": "a group's last surviving 'ready' before the commit that trained "
    "it minus its first surviving 'taken' (across runs and downtime).",
    "batch age": "token-weighted number of weight versions between generating a token and "
    "training on it (metrics.jsonl batch_age).",
}


# ====================================================================== the report


@dataclass
class RunInfo:
    """One process that appended to the trace."""

    run_id: str
    started: float | None  # t of run_started
    resumed_from_step: int | None
    checkpoint: str | None
    finished: bool  # a run_finished line exists (a graceful stop, whatever its reason)
    reason: str | None  # run_finished.reason
    status: str  # see `run_status`
    last_t: float | None  # t of its last complete trace line
    steps_committed: list[int] = field(default_factory=list)
    signal: str | None = None  # run_finished.signal (reason "signal"; None in older traces)
    error: str | None = None  # run_failed.error


def run_status(*, reason: str | None, signal: str | None, error: str | None, last: bool) -> str:
    """How a run ended, as the report labels it: "finished", "finished (data exhausted)",
    "stopped (SIGINT)", "failed: <error>", "killed" (no end line), or "killed, or still
    running" (the last run, no end line). A run_failed line wins over a run_finished one
    (a run that stopped gracefully and then failed, e.g. on its last journal flush)."""
    if error is not None:
        first = error.splitlines()[0] if error else "no error text"
        return f"failed: {first[:200]}{'...' if len(first) > 200 else ''}"
    if reason is None:
        return "killed, or still running" if last else "killed"
    if reason == "finished":
        return "finished"
    if reason == "data exhausted":
        return "finished (data exhausted)"
    if reason == "signal":
        return f"stopped ({signal or 'SIGINT or SIGTERM'})"
    if reason == "no engine replica":
        return "failed: no engine replica left (stopped with a final checkpoint)"
    if reason == "user code":
        return "failed: user code stopped the run (SystemExit, KeyboardInterrupt or hung calls)"
    return f"stopped ({reason})"


@dataclass
class Restart:
    """One run after the first: what it reused and what the restart threw away."""

    index: int  # 1 for the first restart
    run_id: str
    previous_run_id: str
    previous_status: str
    checkpoint: str | None
    step: int | None  # the restored checkpoint's step
    cut_time: float | None
    # from the `restored` line (None where the resumed run died before writing it)
    groups_reused: int | None = None
    groups_finalize_again: int | None = None
    siblings_reused: int | None = None
    siblings_regenerated: int | None = None
    siblings_pending: int | None = None
    groups_readmitted: int | None = None
    spare_prompts: int | None = None
    groups_lost: int | None = None  # dropped at the restart (recovery.mode=cursor_only)
    recovery_mode: str | None = None
    # computed from the trace (None where the cut time is unknown)
    tokens_reused: int | None = None
    tokens_thrown_away: int | None = None
    tokens_sealed_after_cut: int | None = None
    seals_after_cut: int | None = None
    tokens_siblings_discarded: int | None = None
    siblings_discarded: int | None = None
    thrown_away_generation_seconds: float | None = None
    attempts_abandoned: int = 0
    # journal.enabled: the events after the cut the restart replayed, and the seals among them
    journal_events_replayed: int = 0
    seals_kept_by_journal: int | None = None
    tokens_kept_by_journal: int | None = None
    # recovery.partial: tokens the siblings cut off mid-generation continue from, and the
    # tokens the killed run traced for them that were not durable (generated again)
    tokens_resumed: int = 0
    tokens_in_flight_regenerated: int = 0
    # multi-turn episodes: finished turns the restart continues after, and the ones the
    # killed run traced for its cut-off siblings that were not durable (played again)
    turns_reused: int = 0
    turns_regenerated: int = 0
    # calls to the outside (docs/design.md §13) in the resumed process, and what it restored
    effects_made: int = 0
    effects_answered: int = 0
    effects_resent: int = 0
    effects_replayed: int = 0
    effects_unknown: int = 0
    attempts_without_dispatch: int = 0  # abandoned, but no live dispatch found before the cut
    kill_t: float | None = None  # the previous run's last trace line
    lost_progress_seconds: float | None = None
    lost_progress_until: str = ""  # "step N committed again" or "first commit"


@dataclass
class StepInfo:
    """One committed step of the surviving lineage."""

    step: int
    t: float | None
    run_id: str | None
    groups: int
    tokens: int | None = None
    batch_age: float | None = None
    tokens_generated_per_s: float | None = None
    reward_mean: float | None = None
    step_seconds: float | None = None
    # the trainer's metrics (`TRAINING`), None where the trainer does not report them
    loss: float | None = None
    kl: float | None = None
    clip_frac: float | None = None
    grad_norm: float | None = None
    response_length: float | None = None
    completion_n: int = 0  # groups whose completion time is known
    completion_mean: float | None = None
    completion_p50: float | None = None
    completion_p90: float | None = None


@dataclass
class Report:
    run_dir: str
    runs: list[RunInfo]
    restarts: list[Restart]
    steps: list[StepInfo]
    custody: list[dict[str, Any]]  # metrics step lines: t, run_id, step, surviving, owners
    evals: list[dict[str, Any]]  # surviving eval lines: step, accuracy, reward_mean (else metrics.jsonl's)
    torn_lines: int  # torn trace lines skipped
    torn_metrics_lines: int = 0
    duplicates: list[list[int]] = field(default_factory=list)  # prompts trained twice

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary(), "definitions": DEFINITIONS}

    def summary(self) -> dict[str, Any]:
        """Totals over restarts and statistics over the surviving steps."""
        completions = [s.completion_mean for s in self.steps if s.completion_mean is not None]
        ages = [s.batch_age for s in self.steps if s.batch_age is not None]
        return {
            "runs": len(self.runs),
            "restarts": len(self.restarts),
            "steps": len(self.steps),
            "last_step": self.steps[-1].step if self.steps else None,
            "finished": bool(self.runs and self.runs[-1].finished),
            "status": self.runs[-1].status if self.runs else None,
            "eval_first": self.evals[0] if self.evals else None,
            "eval_last": self.evals[-1] if self.evals else None,
            "eval_best": max(
                (e for e in self.evals if e.get("accuracy") is not None),
                key=lambda e: e["accuracy"], default=None),
            "tokens_thrown_away": sum(r.tokens_thrown_away or 0 for r in self.restarts),
            "thrown_away_generation_seconds": sum(
                r.thrown_away_generation_seconds or 0.0 for r in self.restarts
            ),
            "lost_progress_seconds": sum(r.lost_progress_seconds or 0.0 for r in self.restarts),
            "batch_age_mean": _mean(ages),
            "batch_age_max": max(ages) if ages else None,
            "group_completion_mean_of_steps": _mean(completions),
        }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
