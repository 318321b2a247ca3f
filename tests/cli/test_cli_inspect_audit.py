"""`rollkeep inspect` and `rollkeep audit` on real checkpoints: a good one is reported with
the ledger's numbers; every damaged one is refused with the right exit code and one
paragraph naming the file, and nothing on disk changes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rollkeep import cli
from rollkeep.cli import main
from rollkeep.core import errors
from rollkeep.core.checkpoint.cut import LEDGER_FILE, ROWS_FILE, cut, save_files, write_checkpoint
from rollkeep.core.checkpoint.manifest import RESERVED_KEYS
from rollkeep.core.checkpoint.rowindex import ROWS_INDEX
from rollkeep.core.checkpoint.store import CheckpointStore
from rollkeep.core.custody.events import Admitted, Claimed, Dispatched, Finalizing, Ready, Sealed
from rollkeep.core.custody.ledger import Ledger
from rollkeep.core.restore.chain import plan
from rollkeep.core.rollout.datasets import SequenceDataset
from rollkeep.core.rollout.rows import Row, RowId
from rollkeep.core.rollout.rowstore import RowStore
from rollkeep.core.rollout.source import PromptSource
from rollkeep.core.rollout.take import drop_event, spare_event, take_event

G = 2


def row(seed: int) -> Row:
    r = np.random.default_rng(seed)
    n = int(r.integers(1, 6))
    return Row(
        prompt_ids=r.integers(0, 50, 4).astype(np.int32),
        completion_ids=r.integers(0, 50, n).astype(np.int32),
        logprobs=-r.random(n).astype(np.float32),
        versions=np.zeros(n, np.int32),
        reward=float(r.random()),
        finish_reason="stop",
    )


class Run:
    """A ledger driven by hand the way the pumps would, publishing real checkpoints."""

    def __init__(self, run_dir: Path) -> None:
        self.source = PromptSource(
            SequenceDataset([{"prompt": f"{i}+1=", "answer": i + 1} for i in range(12)]),
            seed=5,
            epochs=1,
        )
        self.led = Ledger(n_rows=12, seed=5, epochs=1)
        self.rows = RowStore()
        self.store = CheckpointStore(run_dir / "checkpoints")

    def take(self) -> str:
        ev = take_event(self.led, self.source, group_size=G)
        self.led.apply(ev)
        return f"e{ev.epoch}.{ev.ordinal}"

    def admit(self, gid: str) -> None:
        self.led.apply(Admitted(group_id=gid, target_step=self.led.version + 1, version=self.led.version))
        self.led.apply(Dispatched(group_id=gid, generations=tuple(range(G)), version=self.led.version))

    def seal(self, gid: str, g: int) -> None:
        self.rows.put(RowId(gid, g, 0), row(hash((gid, g)) % 10_000))
        self.led.apply(Sealed(group_id=gid, generation=g, attempt=0, version=self.led.version, tokens=3))

    def ready(self, gid: str) -> None:
        for g in range(G):
            self.seal(gid, g)
        self.led.apply(Finalizing(group_id=gid))
        self.led.apply(Ready(group_id=gid, advantages=(1.0, -1.0)))

    def train_step(self) -> None:
        gids = [self.take(), self.take()]
        for gid in gids:
            self.admit(gid)
            self.ready(gid)
        step = self.led.version + 1
        self.led.apply(Claimed(step=step, group_ids=tuple(gids)))
        self.led.apply(self.led.commit_event(step))

    def publish(self) -> None:
        meta = {"dataset": {"n_rows": 12, "seed": 5, "fingerprint": self.source.fingerprint()},
                "config": {"seed": 5}}
        write_checkpoint(self.store, cut(self.led, self.rows), trainer_save=save_files({"model.bin": b"w" * 64}),
                         meta=meta, keep_last=None)


def make_run(run_dir: Path) -> Run:
    """step_000001: 2 trained. step_000002 (LATEST): 4 trained, e0.4 READY, e0.5
    generating with one sibling sealed, e0.6 dropped (shrinking step 3), e0.7 RESERVED,
    e0.8 in the spare pool, cursor e0.9."""
    r = Run(run_dir)
    r.train_step()
    r.publish()
    r.train_step()
    ready, generating, dropped = r.take(), r.take(), r.take()
    for gid in (ready, generating, dropped):
        r.admit(gid)
    r.ready(ready)
    r.seal(generating, 0)
    r.led.apply(drop_event(r.led, r.source, dropped, "data_failures", on_dropped_prompt="shrink",
                           group_size=G))
    r.take()
    r.led.apply(spare_event(r.led))
    r.publish()
    return r


def tree_digest(root: Path) -> str:
    """Names, bytes, modes and mtimes of everything under `root`."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)}|{st.st_mode}|{st.st_mtime_ns}|{st.st_size}".encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def run(tmp_path) -> Run:
    return make_run(tmp_path / "run")


def inspect_json(capsys, path: Path) -> dict:
    assert main(["inspect", "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def test_inspect_owner_table_matches_the_ledger(tmp_path, run, capsys) -> None:
    led = run.led
    before = tree_digest(tmp_path)
    rep = inspect_json(capsys, tmp_path / "run")
    assert rep["ok"] and rep["checkpoint"] == "step_000002" and rep["via"] == "LATEST"
    assert rep["step"] == 2 and rep["weight_version"] == 2
    c, counts = rep["custody"], led.counts()
    assert c["spare"] == len(led.spare) == 1
    assert c["ledger"] == {"total": led.n_inflight(), "RESERVED": counts["reserved"],
                           "GENERATING": counts["generating"], "READY_TO_FINALIZE": 0,
                           "FINALIZING": 0}
    assert c["ledger"]["total"] == 2 and c["ledger"]["RESERVED"] == 1
    assert c["replay"] == {"total": 1, "READY": counts["ready"], "CLAIMED": counts["claimed"]}
    assert c["trained"] == led.trained_count() == 4
    assert c["dropped"] == len(led.dropped()) == 1
    assert c["dropped_by_reason"] == {"data_failures": 1}
    assert c["cursor"] == list(led.cursor) == [0, 9] and c["cursor_key"] == "e0.9"
    assert c["version"] == led.version == 2
    assert c["shortfall"] == {"3": 1}
    assert c["source_left"] == 3
    assert rep["rows"] == G + 1  # the READY group's siblings and one sealed sibling
    assert rep["plan"]["lines"] == plan(led.capture()).lines()
    assert set(rep["checks"]["passed"]) == {"1", "2", "3", "4", "5", "6"}
    assert set(rep["checks"]["not_run"]) == {"7", "8"}
    assert set(rep["files"]) == {LEDGER_FILE, ROWS_FILE, ROWS_INDEX, "trainer/model.bin", "MANIFEST.json"}
    assert rep["bytes"] == sum(p.stat().st_size for p in Path(rep["path"]).rglob("*") if p.is_file())
    assert rep["store"]["checkpoints"] == ["step_000001", "step_000002"]
    assert rep["store"]["latest"] == "step_000002"
    assert tree_digest(tmp_path) == before


def test_inspect_text(tmp_path, run, capsys) -> None:
    before = tree_digest(tmp_path)
    assert main(["inspect", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0].startswith("checkpoint  step_000002  (LATEST of ")

    def owner(name: str) -> list[str]:
        [hit] = [ln.split() for ln in lines if ln.split()[:1] == [name]]
        return hit

    assert owner("spare") == ["spare", "1"]
    assert owner("ledger")[:5] == ["ledger", "2", "RESERVED", "1,", "GENERATING"]
    assert owner("replay")[:4] == ["replay", "1", "READY", "1,"]
    assert owner("trained")[:2] == ["trained", "4"]
    assert owner("dropped") == ["dropped", "1", "data_failures", "1"]
    assert owner("cursor") == ["cursor", "e0.9"]
    assert owner("version") == ["version", "2"]
    for line in plan(run.led.capture()).lines():
        assert line in out
    assert "not run  7  dataset unchanged" in out and "dataset or config" in out
    assert any(ln.split() == ["step_000002", "<-", "LATEST,", "inspected"] for ln in lines)
    assert any(ln.split() == ["step_000001"] for ln in lines)
    assert tree_digest(tmp_path) == before


def test_the_three_path_forms(tmp_path, run, capsys) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    assert inspect_json(capsys, ckpts)["checkpoint"] == "step_000002"
    one = inspect_json(capsys, ckpts / "step_000001")
    assert one["checkpoint"] == "step_000001" and one["via"] == "path"
    assert one["custody"]["trained"] == 2 and one["custody"]["ledger"]["total"] == 0
    assert one["store"]["latest"] == "step_000002"


def test_audit_good(tmp_path, run, capsys) -> None:
    before = tree_digest(tmp_path)
    assert main(["audit", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert out == ("step_000002: ok (trained 4, ledger 2, replay 1, spare 1, dropped 1, "
                   "cursor e0.9, version 2; 0 row(s) read from the row log)\n")
    assert err == ""
    assert main(["audit", "--all", str(tmp_path / "run" / "checkpoints")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "LATEST: step_000002",
        "step_000001: ok (trained 2, ledger 0, replay 0, spare 0, dropped 0, cursor e0.2, version 1; 0 row(s) read from the row log)",
        "step_000002: ok (trained 4, ledger 2, replay 1, spare 1, dropped 1, cursor e0.9, version 2; 0 row(s) read from the row log)",
    ]
    assert tree_digest(tmp_path) == before


# -- damaged checkpoints -----------------------------------------------------------------


def flip_ledger_byte(root: Path) -> str:
    p = root / "run" / "checkpoints" / "step_000002" / LEDGER_FILE
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x40
    p.write_bytes(bytes(b))
    return LEDGER_FILE


def delete_rows(root: Path) -> str:
    (root / "run" / "checkpoints" / "step_000002" / ROWS_FILE).unlink()
    return ROWS_FILE


def garbage_latest(root: Path) -> str:
    (root / "run" / "checkpoints" / "LATEST").write_bytes(b"\x00\xffnot a name")
    return "LATEST"


def republish_two_owners(root: Path) -> str:
    """Replace the run with one whose ledger gives e0.0 two owners (TRAINED and SPARE),
    published through the store so the manifest is consistent: only the audit sees it."""
    good = CheckpointStore(root / "run" / "checkpoints")
    ck = good.open()
    files = {f: ck.read(f) for f in ck.files()}
    doc = msgspec.msgpack.decode(files[LEDGER_FILE])
    doc["spare"] = [*doc["spare"], [0, 0]]
    files[LEDGER_FILE] = msgspec.msgpack.encode(doc)
    meta = {k: v for k, v in ck.manifest.items() if k not in RESERVED_KEYS}
    CheckpointStore(root / "bad" / "checkpoints").publish(ck.manifest["step"], files, meta, keep_last=None)
    return LEDGER_FILE


DAMAGE = {
    "flipped_ledger_byte": (flip_ledger_byte, "run", errors.ManifestMismatch, "wrong sha256"),
    "deleted_rows": (delete_rows, "run", errors.ManifestMismatch, "missing"),
    "garbage_latest": (garbage_latest, "run", errors.CheckpointNotFound, "does not hold a checkpoint name"),
    "audit_fails": (republish_two_owners, "bad", errors.CheckpointCustodyError, "two owners"),
}


@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["audit"]])
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused_and_untouched(tmp_path, run, capsys, case, command) -> None:
    damage, run_name, error_cls, reason = DAMAGE[case]
    filename = damage(tmp_path)
    before = tree_digest(tmp_path)
    code = main([*command, str(tmp_path / run_name)])
    out, err = capsys.readouterr()
    assert code == cli.exit_code(error_cls("x")) == 3
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert filename in err and reason in err and "What to do:" in err
    assert "Traceback" not in err
    if "--json" in command:
        doc = json.loads(out)
        assert doc["ok"] is False and doc["exit_code"] == 3
        assert doc["error"]["type"] == error_cls.__name__
        assert doc["error"]["path"].endswith(filename)
    else:
        assert out == ""
    assert tree_digest(tmp_path) == before


def test_audit_all_reports_each_checkpoint(tmp_path, run, capsys) -> None:
    flip_ledger_byte(tmp_path)
    before = tree_digest(tmp_path)
    assert main(["audit", "--all", str(tmp_path / "run")]) == 3
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "LATEST: step_000002",
        "step_000001: ok (trained 2, ledger 0, replay 0, spare 0, dropped 0, cursor e0.2, version 1; 0 row(s) read from the row log)",
        "step_000002: FAILED at restore step 2, every file has its listed size and sha256, "
        "nothing unlisted (see the error on stderr)",
    ]
    assert err.startswith("error: ") and err.count("\n") == 1 and LEDGER_FILE in err
    assert tree_digest(tmp_path) == before


def test_audit_all_with_garbage_latest_still_audits_the_directories(tmp_path, run, capsys) -> None:
    garbage_latest(tmp_path)
    assert main(["audit", "--all", str(tmp_path / "run")]) == 3
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("LATEST: FAILED at restore step 1")
    assert [ln.split(":")[1].split()[0] for ln in out.splitlines()[1:]] == ["ok", "ok"]
    assert "LATEST" in err


def test_no_checkpoint_and_bad_paths(tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["audit", str(tmp_path / "empty")]) == 2
    assert "not a run dir" in capsys.readouterr().err
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    assert main(["inspect", str(tmp_path / "fresh")]) == 3
    assert "LATEST is missing" in capsys.readouterr().err
    assert main(["audit", "--all", str(tmp_path / "fresh")]) == 3
    out, err = capsys.readouterr()
    assert "LATEST: missing" in out and "no checkpoint directory" in err


# -- the top level -----------------------------------------------------------------------


def test_exit_codes_by_error_class(tmp_path) -> None:
    assert cli.exit_code(errors.ConfigError("x")) == 2
    assert cli.exit_code(errors.RowsMismatch("x")) == 3
    assert cli.exit_code(errors.AuditFailure("x")) == 4
    assert cli.exit_code(errors.ExternalError("x")) == 5
    assert cli.exit_code(errors.RollkeepError("x")) == 1


def test_help_documents_exit_codes_and_examples(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for code, cls in ((2, "UserInputError"), (3, "CheckpointError"), (4, "CustodyError"), (5, "ExternalError")):
        assert f"  {code}  " in out and cls in out
    for name in cli.COMMANDS:
        assert name in out
    for sub in ("inspect", "audit"):
        assert main([sub, "--help"]) == 0
        assert f"rollkeep {sub} runs/a" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["inspect"]) == 2  # argparse usage error: PATH missing


def test_a_subcommand_not_written_yet(monkeypatch, capsys) -> None:
    monkeypatch.setitem(cli.COMMANDS, "frobnicate", "does not exist")
    assert main(["frobnicate", "--anything"]) == 2
    assert "not available yet" in capsys.readouterr().err
    assert main(["inspect", "--help"]) == 0  # the others still work


def test_through_a_real_process(tmp_path, run) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def rollkeep(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rollkeep", *argv], capture_output=True,
                              text=True, env=env, timeout=120)

    good = rollkeep("inspect", "--json", str(tmp_path / "run"))
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["custody"]["trained"] == 4
    delete_rows(tmp_path)
    before = tree_digest(tmp_path)
    bad = rollkeep("audit", str(tmp_path / "run"))
    assert bad.returncode == 3
    assert bad.stdout == ""
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1 and ROWS_FILE in bad.stderr
    assert tree_digest(tmp_path) == before


# -- the journal's tail -----------------------------------------------------------------


def _stopped_with_a_tail(tmp_path: Path) -> Path:
    """A toy run stopped gracefully with no final checkpoint: LATEST is step 4 and the
    journal holds everything after it."""
    from run_harness import config, run_child

    cfg = config(tmp_path / "run", "checkpoint.every_steps=4", "checkpoint.on_shutdown=false")
    assert run_child(cfg, "ledger.step_committed:6", crash_signal="TERM") == 143
    return Path(cfg.run_dir)


def test_inspect_and_audit_show_and_check_the_journal_tail(tmp_path, capsys) -> None:
    run = _stopped_with_a_tail(tmp_path)
    assert main(["inspect", "--json", str(run)]) == 0
    j = json.loads(capsys.readouterr().out)["journal"]
    assert j["after_seq"] > 0 and j["events"] > 0 and j["seals"] > 0 and j["steps_taken_back"][0] == 5
    assert j["plan"]["groups_reused"] >= j["groups_returned"] > 0  # the taken-back steps' groups
    assert main(["inspect", str(run)]) == 0
    assert f"journal     {j['events']} event(s) after this checkpoint" in capsys.readouterr().out
    assert main(["audit", str(run)]) == 0
    assert f"journal after step_000004: ok ({j['events']} event(s), {j['seals']} row(s) read and verified" \
        in capsys.readouterr().out
    # A checkpoint given by path is inspected alone: its tail is LATEST's business.
    assert main(["inspect", "--json", str(run / "checkpoints" / "step_000004")]) == 0
    assert json.loads(capsys.readouterr().out)["journal"] is None


def test_audit_refuses_a_damaged_journal_record(tmp_path, capsys) -> None:
    run = _stopped_with_a_tail(tmp_path)
    [segment] = sorted((run / "journal").iterdir())
    data = bytearray(segment.read_bytes())
    data[36 + 24 + 2] ^= 0xFF  # inside the first record's payload, valid records after it
    segment.write_bytes(bytes(data))
    before = hashlib.sha256(segment.read_bytes()).hexdigest()
    assert main(["audit", "--all", str(run)]) == 3
    captured = capsys.readouterr()
    assert "journal after step_000004: FAILED" in captured.out and "in the middle of a segment" in captured.err
    assert main(["audit", str(run)]) == 3
    assert hashlib.sha256(segment.read_bytes()).hexdigest() == before  # nothing repaired
