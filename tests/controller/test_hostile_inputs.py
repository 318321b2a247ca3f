"""Regression tests for the hostile inputs of `../shared/findings/hostile-inputs.md` (issue
"refuse what cannot be proven"). Each test is named after the defect it pins. A refusal
is the documented exit code, one paragraph on stderr, no traceback, and nothing on disk
changed; a failure is clean (exit 5 or 2), and the previous checkpoint stays restorable."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
from pathlib import Path

import msgspec
import pytest
from hostile import edit_manifest, refused, refuses, rehash, rollkeep, train_args, tree
from pyroaring import BitMap
from run_harness import check, config, run_child, run_to_end, trace_lines
from trainer_files import as_dir, files_of

from rollkeep.cli import main
from rollkeep.core.custody import codec
from rollkeep.core.custody.ledger import AttemptStatus

ROOT = Path(__file__).resolve().parents[2]
V010_RUN = ROOT / "tests" / "data" / "v0.1.0-toy-run"  # written by rollkeep 0.1.0 (ledger schema 1)


# -- helpers (the shared ones are in tests/hostile.py) ----------------------------------------


def edit_ledger(ck: Path, fn) -> None:
    doc = msgspec.msgpack.decode((ck / "ledger.msgpack").read_bytes())
    fn(doc)
    (ck / "ledger.msgpack").write_bytes(msgspec.msgpack.encode(doc))
    rehash(ck)


# Groups are msgpack arrays: (epoch, ordinal, idx, task, fingerprint, granularity, state,
# target_step, start_version, claim_step, status, attempts, infra, data, advantages).
TARGET, START, ADVANTAGES, STATE = 7, 8, 14, 6


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 10-step toy run keeping every checkpoint (2, 4, ... 10; groups in flight and READY
    at each but the last)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    run_to_end(config(run, "train.total_steps=10", "checkpoint.keep_last=10"))
    return run


@pytest.fixture
def run(tmp_path, finished_run) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished_run, dst, symlinks=True)
    return dst


def at(run: Path, name: str) -> Path:
    """Point LATEST at `name` (the documented remedy), dropping the newer checkpoints."""
    ck = run / "checkpoints"
    (ck / "LATEST").write_text(name + "\n")
    for p in ck.iterdir():
        if p.name.startswith("step_") and p.name > name:
            shutil.rmtree(p)
    return ck / name


# -- 1. a missing LATEST, --resume-from --------------------------------------------------


def test_missing_latest_over_published_checkpoints_is_refused_not_a_fresh_start(run, capsys):
    (run / "checkpoints" / "LATEST").unlink()
    err = refuses(capsys, train_args(run, "train.total_steps=10"), 3, run)
    assert "LATEST is missing" in err and "--resume-from step_000010" in err and "new run_dir" in err


def test_checkpoints_gone_while_the_trace_records_them_is_refused(run, capsys):
    shutil.rmtree(run / "checkpoints")
    err = refuses(capsys, train_args(run), 3, run)
    assert "none is left" in err


def test_a_crash_inside_the_first_publication_starts_fresh(tmp_path):
    # Killed after the first checkpoint's directory got its name but before LATEST (P6-P8):
    # nothing was ever published, so the leftover is set aside and the run starts over.
    cfg = config(tmp_path / "run")
    assert run_child(cfg, "publish.dir_renamed:1") == -9
    assert not (Path(cfg.run_dir) / "checkpoints" / "LATEST").exists()
    run_to_end(cfg)
    check(cfg)


def test_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(run, capsys):
    newer = {n: tree(run / "checkpoints" / n) for n in ("step_000008", "step_000010")}
    assert main(train_args(run, "train.total_steps=12", "checkpoint.keep_last=10", "--resume-from",
                           "step_000006")) == 0
    ck = run / "checkpoints"
    [aside] = [p for p in ck.iterdir() if p.name.startswith("abandoned-")]
    assert {p.name: tree(p) for p in aside.iterdir()} == newer  # moved, byte for byte
    assert (ck / "LATEST").read_text() == "step_000012\n"
    started = [e for e in trace_lines(config(run)) if e["event"] == "run_started"][-1]
    assert started["resumed_from_step"] == 6 and started["checkpoint"] == "step_000006"
    assert started["abandoned_checkpoints"] == {"names": sorted(newer), "into": aside.name}
    check(config(run, "train.total_steps=12"))  # the lineage drops the abandoned steps 7-10


def test_resume_from_names_the_remedy_for_a_missing_latest(run, capsys):
    (run / "checkpoints" / "LATEST").unlink()
    assert main(train_args(run, "train.total_steps=10", "--resume-from", "step_000010")) == 0
    assert (run / "checkpoints" / "LATEST").read_text() == "step_000010\n"
    check(config(run, "train.total_steps=10"))


def test_resume_from_an_unknown_checkpoint_is_a_usage_error(run, capsys):
    err = refuses(capsys, [*train_args(run), "--resume-from", "step_000099"], 2, run)
    assert "step_000008" in err  # the names present
    refuses(capsys, [*train_args(run), "--resume-from", "../x"], 2, run)


# -- 2. the parts of a checkpoint bound to one step -----------------------------------------


def test_trainer_files_from_another_checkpoint_are_refused(run, capsys):
    ck = run / "checkpoints"
    shutil.copy(ck / "step_000006" / "trainer" / "toy_trainer.json", ck / "step_000010" / "trainer")
    rehash(ck / "step_000010")
    err = refuses(capsys, ["audit", str(ck)], 3, run)
    assert "another step" in err and "step 6" in err
    refuses(capsys, train_args(run, "train.total_steps=15"), 3, run)


def test_forged_trainer_step_is_refused(run, capsys):
    ck = at(run, "step_000006")
    state = json.loads((ck / "trainer" / "toy_trainer.json").read_text())
    (ck / "trainer" / "toy_trainer.json").write_text(json.dumps({**state, "rollkeep_step": 999}))
    rehash(ck)
    refuses(capsys, ["audit", str(run / "checkpoints")], 3, run)


def test_manifest_weight_version_other_than_the_ledgers_is_refused(run, capsys):
    ck = at(run, "step_000006")
    edit_manifest(ck, weight_version=999, run_id="forged")
    err = refuses(capsys, ["audit", str(run / "checkpoints")], 3, run)
    assert "weight_version" in err


def test_grpo_trainer_files_of_another_step_are_refused_by_load():
    torch = pytest.importorskip("torch")
    from rollkeep.config import TorchModelConfig, TorchTrainerConfig
    from rollkeep.core.checkpoint.cut import declared_step
    from rollkeep.core.errors import CheckpointError
    from rollkeep.models.gpt import GPT, GPTConfig
    from rollkeep.models.tokenizer import CharTokenizer
    from rollkeep.trainers.grpo import TorchTrainer

    tok = CharTokenizer()
    torch.manual_seed(0)
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, **shape))
    cfg = TorchTrainerConfig(model=TorchModelConfig(**shape))
    trainer = TorchTrainer(cfg, model=model, tokenizer=tok, temperature=1.0, seed=0)
    files = files_of(trainer.snapshot())
    assert {declared_step(n, b) for n, b in files.items()} == {0}
    trainer.load(as_dir(files), step=0)
    with pytest.raises(CheckpointError, match="step 0, not of step 16"):
        trainer.load(as_dir(files), step=16)
    # A forger who rewrites trainer.json alone leaves the tensors' own step behind.
    meta = json.loads(files["trainer.json"])
    forged = {**files, "trainer.json": json.dumps({**meta, "rl_steps": 16, "rollkeep_step": 16}).encode()}
    with pytest.raises(CheckpointError, match="model.safetensors"):
        trainer.load(as_dir(forged), step=16)


def test_forged_trained_set_past_what_the_steps_trained_is_refused(run, capsys):
    ck = at(run, "step_000006")

    def claim_everything(doc):
        bm = BitMap.deserialize(doc["trained"][0]) | BitMap(range(doc["cursor"][1], 60))
        doc["trained"][0] = bm.serialize()
        doc["cursor"] = [1, 0]
        doc["groups"] = []
        doc["spare"] = []

    edit_ledger(ck, claim_everything)
    err = refuses(capsys, ["audit", str(run / "checkpoints")], 3, run)
    assert "I5" in err
    refuses(capsys, train_args(run, "train.total_steps=10"), 3, run)


def test_trained_prompts_moved_back_to_spare_are_refused(run, capsys):
    ck = at(run, "step_000006")

    def untrain(doc):
        bm = BitMap.deserialize(doc["trained"][0])
        moved = list(bm)[:4]
        doc["trained"][0] = (bm - BitMap(moved)).serialize()
        doc["spare"] = [[0, o] for o in moved] + doc["spare"]

    edit_ledger(ck, untrain)
    err = refuses(capsys, ["audit", str(run / "checkpoints")], 3, run)
    assert "I5" in err and "TRAINED holds 20" in err


# -- 3. values no honest run can produce ----------------------------------------------------


def _advantages(value):
    def fn(doc):
        for g in doc["groups"]:
            if g[ADVANTAGES] is not None:
                g[ADVANTAGES] = [value] * len(g[ADVANTAGES])
    return fn


def _target(doc):
    next(g for g in doc["groups"] if g[TARGET] is not None)[TARGET] = 10**12


def _drop_step(doc):
    doc["dropped"].append([0, doc["cursor"][1] - 1, "x" * 5_000_000, 10**9])
    victim = next(g for g in doc["groups"] if g[1] == doc["cursor"][1] - 1)
    doc["groups"].remove(victim)


def _shortfall(doc):
    doc["shortfall"] = {doc["version"] + 1: 10**9}


@pytest.mark.parametrize(
    "forge",
    [_advantages(math.nan), _advantages(math.inf), _advantages(1e308), _target, _drop_step, _shortfall],
    ids=["nan-advantages", "inf-advantages", "1e308-advantages", "target-step-1e12", "dropped-step-1e9",
         "shortfall-1e9"],
)
def test_impossible_persisted_numbers_are_refused(run, capsys, forge):
    ck = at(run, "step_000006")
    edit_ledger(ck, forge)
    err = refuses(capsys, ["audit", str(run / "checkpoints")], 3, run)
    assert "impossible record" in err
    refuses(capsys, train_args(run, "train.total_steps=10"), 3, run)


def test_a_non_finite_reward_is_a_data_failure_never_trained(tmp_path, monkeypatch):
    from rollkeep import tasks

    monkeypatch.setitem(tasks.REWARDS, "arith", lambda text, row: math.nan)
    # (fail_fast off: a reward that is NaN on every row would stop the run first, exit 2)
    cfg = config(tmp_path / "run", "train.total_steps=2", "rollout.max_data_attempts=1", "rollout.fail_fast_attempts=0")
    from rollkeep.controller import train

    with pytest.raises(Exception, match="step 1 lost|min_step_batch|data budget"):
        train(cfg)
    failed = [e for e in trace_lines(cfg) if e["event"] == "failed"]
    assert failed and all("must be finite" in e["error"] for e in failed)
    assert not any(e["event"] == "ready" for e in trace_lines(cfg))


# -- 4. special files never block ------------------------------------------------------------


@pytest.mark.parametrize("where", ["checkpoints/LATEST", "checkpoints/step_000010/MANIFEST.json",
                                   "checkpoints/step_000010/rows.safetensors",
                                   "checkpoints/step_000010/trainer/toy_trainer.json"])
@pytest.mark.parametrize("command", ["train", "audit", "inspect"])
def test_a_fifo_in_a_checkpoint_is_refused_without_hanging(run, where, command):
    (run / where).unlink()
    os.mkfifo(run / where)
    before = tree(run)
    args = {"train": train_args(run, "train.total_steps=10"), "audit": ["audit", str(run / "checkpoints")],
            "inspect": ["inspect", str(run)]}[command]
    out = rollkeep(*args)
    assert out.returncode == 3, out.stderr
    assert "FIFO" in out.stderr and "Traceback" not in out.stderr
    assert tree(run) == before


def test_a_fifo_as_dataset_or_trace_is_refused_without_hanging(tmp_path, run):
    os.mkfifo(tmp_path / "data.jsonl")
    out = rollkeep(*train_args(tmp_path / "new", f"data.path={tmp_path / 'data.jsonl'}"))
    assert out.returncode == 2 and "FIFO" in out.stderr, out.stderr
    (run / "trace.jsonl").unlink()
    os.mkfifo(run / "trace.jsonl")
    out = rollkeep("trace", str(run), "--no-plots")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr


# -- 5. deep nesting ------------------------------------------------------------------------


DEEP = 200_000


def test_a_deeply_nested_ledger_is_refused(run, capsys):
    ck = at(run, "step_000006")
    for body in (b"\x82\xa6schema\x02\xa6groups" + b"\x91" * DEEP + b"\xc0", b"\x91" * DEEP + b"\xc0"):
        (ck / "ledger.msgpack").write_bytes(body)
        rehash(ck)
        refuses(capsys, ["audit", str(run / "checkpoints")], 3, run)


def test_a_deeply_nested_rows_header_or_manifest_is_refused(run, capsys):
    ck = at(run, "step_000006")
    header = b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}"
    rows = ck / "rows.safetensors"
    rows.write_bytes(len(header).to_bytes(8, "little") + header)
    rehash(ck)
    refuses(capsys, ["audit", str(run / "checkpoints")], 3, run)
    (ck / "MANIFEST.json").write_bytes(header)
    err = refuses(capsys, ["inspect", str(run)], 3, run)
    assert "nested too deeply" in err


def test_a_deeply_nested_dataset_row_is_refused_with_its_line(tmp_path, capsys):
    data = tmp_path / "deep.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": "1+1=", "x": ' + "[" * DEEP + "]" * DEEP + "}\n")
    err = refused(capsys, 0, train_args(tmp_path / "r", f"data.path={data}"), 2)
    assert "line 2" in err and "nested too deeply" in err


def test_a_deeply_nested_config_is_refused(tmp_path, capsys):
    (tmp_path / "deep.yaml").write_text("a: " + "[" * DEEP + "]" * DEEP + "\n")
    err = refused(capsys, 0, ["train", str(tmp_path / "deep.yaml"), f"run_dir={tmp_path / 'r'}"], 2)
    assert "nested too deeply" in err


def test_a_dataset_row_with_a_duplicate_key_is_refused_with_its_line(tmp_path, capsys):
    data = tmp_path / "dup.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": "1+1=", "prompt": "2+2="}\n')
    err = refused(capsys, 0, train_args(tmp_path / "r", f"data.path={data}"), 2)
    assert "line 2" in err and "duplicate key 'prompt'" in err


def test_a_deeply_nested_trace_line_is_skipped_and_counted(run, capsys):
    with open(run / "trace.jsonl", "a") as f:
        f.write('{"event": ' + "[" * DEEP + "]" * DEEP + "}\n")
    assert main(["trace", str(run), "--json", "--no-plots"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torn_lines"] == 1 and report["summary"]["steps"] == 10


# -- 12. no pickle -------------------------------------------------------------------------


def test_an_hf_model_directory_with_pickled_weights_only_is_refused(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from hf_fixture import make_tiny_hf_model
    from transformers import AutoModelForCausalLM

    from rollkeep.core.errors import UserInputError
    from rollkeep.models.hf import load_pretrained

    path = make_tiny_hf_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    for p in path.glob("*.safetensors"):
        p.unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")  # the legacy pickle format
    with pytest.raises(UserInputError, match="no safetensors weights") as e:
        load_pretrained(str(path), field="engine.model_path")
    assert "pytorch_model.bin" in e.value.found and "safe_serialization=True" in e.value.remedy


# -- 6, 7. filesystem faults and cleanup ----------------------------------------------------


def test_run_dir_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    err = refuses(capsys, train_args(tmp_path / "file"), 2, tmp_path)
    assert "not a directory" in err


class _FullDisk:
    """Make the n-th checkpoint file write fail with ENOSPC (the store's filesystem seam)."""

    def __init__(self, monkeypatch, fail_at: int) -> None:
        from rollkeep.core.checkpoint import store

        self.calls = 0
        real = store.FS.write

        def write(fs, path, data):
            self.calls += 1
            if self.calls == fail_at:
                raise OSError(28, "No space left on device", str(path))
            return real(fs, path, data)

        monkeypatch.setattr(store.FS, "write", write)


def test_enospc_while_publishing_is_exit_5_and_the_previous_checkpoint_stands(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _FullDisk(monkeypatch, fail_at=15)  # 5 files + manifest + LATEST per checkpoint: the third one
    err = refused(capsys, 0, train_args(run), 5)
    assert "publishing the checkpoint of step 6" in err and "No space left on device" in err
    assert (run / "checkpoints" / "LATEST").read_text() == "step_000004\n"
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert [e for e in trace_lines(config(run)) if e["event"] == "run_failed"]
    monkeypatch.undo()
    # Item 7: the lock was released and the engine closed, so the same process resumes.
    assert main(train_args(run)) == 0
    check(config(run))


def test_enospc_while_writing_the_trace_is_exit_5(tmp_path, monkeypatch, capsys):
    from rollkeep.core.io.fs import OSAppendFile  # the trace's handle on the filesystem seam

    real_write, written = OSAppendFile.write, [0]

    def filling(self, data):
        written[0] += len(data)
        if written[0] > 20_000:
            raise OSError(28, "No space left on device")
        real_write(self, data)

    monkeypatch.setattr(OSAppendFile, "write", filling)
    run = tmp_path / "run"
    err = refused(capsys, 0, train_args(run), 5)
    assert "writing the trace" in err and "trace.jsonl" in err
    monkeypatch.undo()
    assert main(train_args(run)) == 0  # resumes from the last checkpoint, exactly once
    check(config(run))


def test_a_failed_run_releases_the_run_dir_and_closes_the_engine(tmp_path, monkeypatch):
    from rollkeep import controller
    from rollkeep.engines.toy import ToyEngine

    closed = []

    class BrokenEngine(ToyEngine):
        async def generate(self, req, progress=None):
            raise TypeError("a bug in the engine")

        async def close(self):
            closed.append(True)

    real_build = controller.build

    def build(cfg):
        parts = real_build(cfg)
        parts.engine = BrokenEngine()
        return parts

    monkeypatch.setattr(controller, "build", build)
    cfg = config(tmp_path / "run")
    with pytest.raises(TypeError, match="a bug in the engine"):  # item 9: a bug, never retried
        controller.train(cfg)
    assert closed == [True]
    assert not [e for e in trace_lines(cfg) if e["event"] == "failed"]
    monkeypatch.undo()
    run_to_end(cfg)  # not "another process is running"


def test_enospc_on_a_real_small_filesystem_is_exit_5(tmp_path):
    mount = tmp_path / "run" / "checkpoints"
    mount.mkdir(parents=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs to make a small filesystem")
    try:
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        (mount / "fill").write_bytes(b"\0" * max(0, free - 24 * 1024))
        out = rollkeep(*train_args(tmp_path / "run", "train.total_steps=30", "train.num_prompts_per_step=16",
                                   "sampler.max_lookahead_versions=2"))
        assert out.returncode == 5, out.stderr
        assert "No space left on device" in out.stderr and "Traceback" not in out.stderr
        assert not [p for p in mount.iterdir() if ".tmp-" in p.name]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_read_only_run_dir_is_exit_5_and_unchanged(tmp_path, finished_run):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(ro)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs to make a read-only filesystem")
    try:
        shutil.copytree(finished_run, ro / "run", symlinks=True)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        before = tree(ro)
        out = rollkeep(*train_args(ro / "run", "train.total_steps=12"))
        assert out.returncode == 5 and "Read-only file system" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and tree(ro) == before
        out = rollkeep(*train_args(ro / "fresh"))
        assert out.returncode == 5 and "Traceback" not in out.stderr, out.stderr
    finally:
        subprocess.run(["umount", str(ro)], check=True)


# -- 8. hung generations ----------------------------------------------------------------------


# That a hung attempt fails as infra exactly at its deadline, is cancelled and retried
# after its backoff, or dropped once its budget is spent, is the scheduler's decision:
# tests/core/test_scheduler_clock.py checks it on a fake clock. The run below keeps the
# runner's side (it sleeps until WakeAt, cancels, and a kill in between) on real time.


def test_hangs_are_the_same_in_every_lineage_so_deterministic_mode_stays_deterministic(tmp_path):
    over = ["engine.hang_rate=0.05", "rollout.timeout_s=1", "deterministic=true",
            "rollout.on_dropped_prompt=shrink"]
    reference = config(tmp_path / "reference", *over)
    run_to_end(reference)
    deadlines = [e for e in trace_lines(reference) if e["event"] == "failed" and "deadline" in e["error"]]
    assert deadlines and all(e["kind"] == "infra" for e in deadlines)  # the runner woke for them
    ref_sha = [e for e in trace_lines(reference) if e["event"] == "run_finished"][-1]["weights_sha256"]
    cfg = config(tmp_path / "killed", *over)
    assert run_child(cfg, "ledger.failed:2") == -9
    run_to_end(cfg)
    check(cfg, ref_sha)


# -- 10, 11. config ranges and resume wording -------------------------------------------------


@pytest.mark.parametrize("override", ["seed=-1", "seed=9223372036854775808", "rollout.group_size=100000",
                                      "rollout.max_infra_attempts=256", "engine.latency_ms=.inf",
                                      "rollout.timeout_s=0", "engine.hang_rate=1.5"])
def test_out_of_range_config_values_are_refused_at_load(tmp_path, capsys, override):
    err = refused(capsys, 0, train_args(tmp_path / "r", override), 2)
    assert override.split("=")[0] in err
    assert not (tmp_path / "r").exists()


def test_changing_the_seed_on_resume_is_a_config_change_that_can_never_be_allowed(run, capsys):
    err = refuses(capsys, train_args(run, "train.total_steps=12", "seed=1"), 3, run)
    assert "seed: 0 -> 1" in err and "point data.path" not in err
    err = refuses(capsys, [*train_args(run, "seed=1"), "--allow-config-change", "seed"], 2, run)
    assert "can never change" in err


def test_an_unknown_allow_config_change_key_is_a_usage_error(run, capsys):
    err = refuses(capsys, [*train_args(run), "--allow-config-change", "train.bogus"], 2, run)
    assert "did you mean `train.total_steps`" in err


def test_raising_data_epochs_extends_the_run_when_allowed(run, capsys):
    err = refuses(capsys, train_args(run, "train.total_steps=20", "data.epochs=2"), 3, run)
    assert "data.epochs: 1 -> 2" in err and "--allow-config-change data.epochs" in err
    assert main([*train_args(run, "train.total_steps=20", "data.epochs=2"),
                 "--allow-config-change", "data.epochs"]) == 0
    cfg = config(run, "train.total_steps=20", "data.epochs=2")
    report = check(cfg)
    assert report.steps == 20 and report.duplicates == []
    steps = {e["step"]: e["prompts"] for e in trace_lines(cfg) if e["event"] == "step_committed"}
    assert any(p[0] == 1 for p in steps[20])  # epoch 1 was handed out: the run went on


def test_lowering_data_epochs_is_refused_even_when_allowed(run, capsys):
    shutil.rmtree(run / "checkpoints" / "step_000010")  # resume a checkpoint before the end
    (run / "checkpoints" / "LATEST").write_text("step_000008\n")
    assert main([*train_args(run, "train.total_steps=20", "data.epochs=2"),
                 "--allow-config-change", "data.epochs"]) == 0
    err = refuses(capsys, [*train_args(run, "train.total_steps=20", "data.epochs=1"),
                           "--allow-config-change", "data.epochs"], 3, run)
    assert "can only grow" in err


# -- 14. the final checkpoint matches the trace ---------------------------------------------


def test_final_checkpoint_holds_the_drops_after_its_last_step(tmp_path, capsys):
    over = ["data.generated.n_rows=48", "train.total_steps=1000", "checkpoint.every_steps=1",
            "engine.latency_ms=3", "engine.latency_jitter_ms=25", "sampler.name=windowed",
            "sampler.max_staleness_versions=0", "sampler.on_stale=drop"]
    cfg = config(tmp_path / "run", *over)
    run_to_end(cfg)
    check(cfg)  # the final checkpoint's DROPPED set equals the trace's
    ck = Path(cfg.run_dir) / "checkpoints"
    drops = sum(e["event"] == "dropped" for e in trace_lines(cfg))
    before = tree(ck)
    run_to_end(cfg)  # a rerun finds nothing left to do and drops nothing again
    assert sum(e["event"] == "dropped" for e in trace_lines(cfg)) == drops
    assert tree(ck) == before


def test_a_stop_at_the_version_of_the_last_checkpoint_writes_its_next_revision(tmp_path):
    # SIGTERM right after step 4 commits: its periodic checkpoint is cut with step 5's
    # groups in flight (lookahead 0: admitted only now, so step 5 cannot be claimed before
    # the stop is seen), then the stop abandons them. That later state of the same step is
    # published as step_000004.1 instead of being lost (the store never rewrites the
    # checkpoint LATEST names).
    from rollkeep.controller import train

    cfg = config(tmp_path / "run", "checkpoint.every_steps=4", "sampler.max_lookahead_versions=0")
    train(cfg, on_step=lambda step, _: os.kill(os.getpid(), signal.SIGTERM) if step == 4 else None)
    ck = Path(cfg.run_dir) / "checkpoints"
    assert (ck / "LATEST").read_text() == "step_000004.1\n"
    published = [e["name"] for e in trace_lines(cfg) if e["event"] == "checkpoint_published"]
    assert published == ["step_000004", "step_000004.1"]
    first, final = (codec.decode((ck / n / "ledger.msgpack").read_bytes()) for n in published)
    assert first.version == final.version == 4
    assert any(AttemptStatus.DISPATCHED in r.status for r in first.groups.values())
    assert not any(AttemptStatus.DISPATCHED in r.status for r in final.groups.values())
    run_to_end(cfg)
    check(cfg)


# -- the checkpoints of rollkeep 0.1.0 -------------------------------------------------------


def test_a_checkpoint_written_by_rollkeep_0_1_0_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(V010_RUN, run)
    assert main(["audit", "--all", str(run / "checkpoints")]) == 0
    assert main(train_args(run, "--resume-from", "step_000003")) == 0  # schema 1, groups in flight
    check(config(run))
