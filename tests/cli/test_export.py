"""`rollkeep export RUN_DIR --out DIR`: the built-in GPT as a Hugging Face directory that
transformers loads offline and that computes what rollkeep's model computes; RL continues
from it with configs/hf.yaml; and every hostile input is refused with its exit code, one
paragraph, no traceback, and nothing modified."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from run_harness import ROOT, config, trace_lines  # noqa: E402

from rollkeep.cli import main  # noqa: E402
from rollkeep.config import load_config  # noqa: E402
from rollkeep.controller import train  # noqa: E402
from rollkeep.export import load_builtin  # noqa: E402

pytestmark = pytest.mark.slow

TINY = [
    "engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=4",
    "trainer.model.n_layer=2", "trainer.model.n_head=2", "trainer.model.n_embd=32",
    "trainer.model.block_size=16", "trainer.micro_batch_size=16",
    "rollout.group_size=4", "train.num_prompts_per_step=4", "train.total_steps=4",
    "checkpoint.every_steps=2", "warmup.sft_steps=60", "warmup.sft_batch_size=16",
    "data.generated.n_rows=64", "data.generated.eval_rows=200", "data.epochs=null",
    "eval.every_steps=0",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished short run of the built-in model (torch backend)."""
    cfg = config(tmp_path_factory.mktemp("export") / "run", *TINY)
    train(cfg)
    return Path(cfg.run_dir)


def tree(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(f"{p.relative_to(root)}|{p.lstat().st_mode}".encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def refused(capsys, args: list[str], code: int) -> str:
    capsys.readouterr()
    got = main(args)
    err = capsys.readouterr().err
    assert got == code, err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


def hf_greedy(model, tok, prompts: list[str], max_new_tokens: int) -> list[str]:
    """What a user writes: generate(do_sample=False), prompts of one length per batch."""
    by_len: dict[int, list[int]] = {}
    ids = [tok(p)["input_ids"] for p in prompts]
    for i, x in enumerate(ids):
        by_len.setdefault(len(x), []).append(i)
    out = [""] * len(prompts)
    for members in by_len.values():
        x = torch.tensor([ids[i] for i in members])
        with torch.inference_mode():
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens)
        for i, row in zip(members, y[:, x.size(1):].tolist(), strict=True):
            out[i] = tok.decode(row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row,
                                skip_special_tokens=True)
    return out


def test_exported_model_loads_offline_and_matches_rollkeep(run, tmp_path, capsys, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollkeep.controller.build import build_data
    from rollkeep.models.sampling import greedy

    before = tree(run)
    out = tmp_path / "models" / "arith"  # its parent does not exist yet
    assert main(["export", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "exported step_000004 (step 4)" in printed and "log-probs within" in printed
    assert tree(run) == before, "export changed the run directory"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "rollkeep_export.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.activation_function == "gelu"
    loaded = load_builtin(run)
    ours = loaded.model
    cfg = load_config(None, [*TINY, f"run_dir={run}"])
    _, eval_rows = build_data(cfg)
    prompts = [r["prompt"] for r in eval_rows]
    assert len(prompts) == 200
    for p in prompts[:20] + ["Hi there?", "a~b", "é+1="]:  # ids: BOS, one per char, '?' for unknown
        assert tok(p)["input_ids"] == loaded.tokenizer.encode(p)

    mine = greedy(ours, loaded.tokenizer, prompts, max_new_tokens=4)
    theirs = hf_greedy(hf, tok, prompts, max_new_tokens=4)
    same = sum(a == b for a, b in zip(mine, theirs, strict=True)) / len(prompts)
    assert same >= 0.99, (same, [(p, a, b) for p, a, b in zip(prompts, mine, theirs, strict=True) if a != b])
    assert len(set(mine)) > 1, "a model that says one thing to everything proves little"

    # log-probs of every token of prompt + rollkeep's completion, over the full vocabulary
    worst = 0.0
    for p, text in zip(prompts, mine, strict=True):
        ids = loaded.tokenizer.encode(p) + loaded.tokenizer.encode(text, bos=False)
        x = torch.tensor([ids])
        with torch.inference_mode():
            a = torch.log_softmax(ours(x).double(), -1)
            b = torch.log_softmax(hf(input_ids=x).logits.double(), -1)
        worst = max(worst, float((a - b).abs().max()))
    assert worst <= 1e-4, worst
    meta = json.loads((out / "rollkeep_export.json").read_text())
    assert meta["checkpoint"] == "step_000004" and meta["weights_sha256"] == loaded.weights_sha256


def test_hf_yaml_continues_rl_from_an_exported_directory(run, tmp_path) -> None:
    models = tmp_path / "models" / "arith"
    assert main(["export", str(run), "--out", str(models)]) == 0
    cfg = load_config(ROOT / "configs" / "hf.yaml", [
        f"engine.model_path={models}", f"trainer.model_path={models}", f"run_dir={tmp_path / 'hf'}",
        "train.total_steps=2", "train.num_prompts_per_step=2", "rollout.group_size=2",
        "eval.every_steps=2", "eval.n_rows=8", "data.generated.n_rows=32", "logger.progress=none",
    ])
    shipped = load_config(ROOT / "configs" / "hf.yaml")
    assert (shipped.engine.name, shipped.trainer.name, shipped.run_dir) == ("hf", "hf", "runs/hf")
    assert shipped.engine.model_path == shipped.trainer.model_path == "models/arith"
    # The same held-out problems as the default job's, so its first eval repeats runs/arith's last.
    arith = load_config(ROOT / "configs" / "arith.yaml")
    assert (shipped.seed, shipped.data.generated, shipped.eval.n_rows) == (
        arith.seed, arith.data.generated, arith.eval.n_rows)
    train(cfg)
    lines = trace_lines(cfg)
    assert [e["step"] for e in lines if e["event"] == "step_committed"] == [1, 2]
    assert [e["step"] for e in lines if e["event"] == "eval"] == [0, 2]  # the hf trainer evaluates


# -- hostile inputs -------------------------------------------------------------------------


def test_export_of_a_missing_run_dir_is_exit_2(tmp_path, capsys) -> None:
    err = refused(capsys, ["export", str(tmp_path / "nope"), "--out", str(tmp_path / "out")], 2)
    assert "does not exist" in err and not (tmp_path / "out").exists()


def test_export_of_a_run_without_checkpoint_is_exit_3(tmp_path, capsys) -> None:
    (tmp_path / "run").mkdir()
    err = refused(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")], 3)
    assert "no checkpoint" in err and not (tmp_path / "out").exists()
    (tmp_path / "run" / "checkpoints").mkdir()
    err = refused(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")], 3)
    assert "LATEST" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["model-bytes", "manifest"])
def test_export_of_a_corrupt_checkpoint_is_exit_3_and_changes_nothing(run, tmp_path, capsys, damage) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ck = copy / "checkpoints" / (copy / "checkpoints" / "LATEST").read_text().strip()
    if damage == "model-bytes":
        f = ck / "trainer" / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        (ck / "MANIFEST.json").write_text("{")
    before = tree(copy)
    err = refused(capsys, ["export", str(copy), "--out", str(tmp_path / "out")], 3)
    assert str(ck) in err
    assert tree(copy) == before and not (tmp_path / "out").exists()


def test_export_of_a_named_checkpoint_and_of_an_unknown_one(run, tmp_path, capsys) -> None:
    assert main(["export", str(run), "--out", str(tmp_path / "two"), "--checkpoint", "step_000002"]) == 0
    assert json.loads((tmp_path / "two" / "rollkeep_export.json").read_text())["step"] == 2
    err = refused(capsys, ["export", str(run), "--out", str(tmp_path / "x"), "--checkpoint", "step_000099"], 2)
    assert "no such checkpoint" in err and "step_000004" in err and not (tmp_path / "x").exists()


def test_export_of_a_run_that_is_not_the_built_in_model_is_exit_2(tmp_path, capsys) -> None:
    cfg = config(tmp_path / "toy", "train.total_steps=2")
    train(cfg)
    err = refused(capsys, ["export", cfg.run_dir, "--out", str(tmp_path / "out")], 2)
    assert "has no model that exports" in err and "'toy'" in err
    assert not (tmp_path / "out").exists()


def test_exported_model_has_no_absolute_path(run, tmp_path) -> None:
    out = tmp_path / "models" / "plain"
    assert main(["export", str(run), "--out", str(out)]) == 0
    meta = json.loads((out / "rollkeep_export.json").read_text())
    assert meta["run_dir"] == run.name and meta["trainer"] == "torch"
    for f in out.iterdir():
        assert str(tmp_path) not in f.read_text(errors="replace"), f.name


def _hf_run(base: Path, tmp_path: Path) -> list[str]:
    rows = tmp_path / "data.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7), "task": "arith"})
                            + "\n" for i in range(24)))
    return ["engine.name=hf", f"engine.model_path={base}", "engine.max_new_tokens=4", "trainer.name=hf",
            f"trainer.model_path={base}", "trainer.lr=1e-3", f"data.path={rows}", "data.epochs=1",
            "train.total_steps=3", "warmup.sft_steps=2", "warmup.sft_batch_size=8"]


def test_an_hf_run_exports_and_transformers_reloads_it_with_the_trainers_log_probs(tmp_path, capsys,
                                                                                   monkeypatch) -> None:
    """trainer.name hf: config, tokenizer and the checkpoint's float32 master weights as
    save_pretrained writes them (safetensors only), no absolute path in any file."""
    _export_hf_run_and_compare(tmp_path, capsys, monkeypatch)


@pytest.mark.skipif(not os.environ.get("ROLLKEEP_TEST_RANKS"),
                    reason="the slower tier: make test-ranks (ROLLKEEP_TEST_RANKS=1)")
def test_an_hf_run_on_two_trainer_ranks_exports_from_its_shards(tmp_path, capsys, monkeypatch) -> None:
    """A sharded checkpoint (trainer/shards/, `trainer.world_size: 2`): the shards are read
    back whole (`read_shards`) and exported as one model.safetensors."""
    ckpt = _export_hf_run_and_compare(tmp_path, capsys, monkeypatch, "trainer.world_size=2",
                                      "trainer.step_timeout_s=120")
    assert (ckpt / "trainer" / "shards").is_dir() and not (ckpt / "trainer" / "model.safetensors").exists()


def _export_hf_run_and_compare(tmp_path, capsys, monkeypatch, *extra: str) -> Path:
    from hf_fixture import make_tiny_hf_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollkeep.trainers.hf import HFTrainer

    base = make_tiny_hf_model(tmp_path / "base")
    cfg = config(tmp_path / "hfrun", *_hf_run(base, tmp_path), *extra)
    train(cfg)
    run = Path(cfg.run_dir)
    before = tree(run)
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert "exported step_000003 (step 3)" in capsys.readouterr().out
    assert tree(run) == before, "export changed the run directory"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "rollkeep_export.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
    for f in out.iterdir():
        assert str(tmp_path) not in f.read_text(errors="replace"), f.name
    meta = json.loads((out / "rollkeep_export.json").read_text())
    assert (meta["trainer"], meta["base_model"], meta["run_dir"], meta["dtype"]) == ("hf", "base", "hfrun", "float32")

    # the trainer's model as rollkeep restores it from the checkpoint
    trainer = HFTrainer(cfg.trainer, temperature=1.0, seed=0)
    trainer.load(run / "checkpoints" / "step_000003" / "trainer", step=3)
    assert meta["weights_sha256"] == trainer.weights_sha256()
    base_model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert next(hf.parameters()).dtype == torch.float32
    worst, moved = 0.0, 0.0
    model = trainer.model.cpu().eval()
    for p in ["1+2=", "13+6=", "Hi there?"]:
        ids = tok(p)["input_ids"] + tok("34", add_special_tokens=False)["input_ids"]
        assert tok(p)["input_ids"] == trainer.tokenizer.encode(p)
        x = torch.tensor([ids])
        with torch.inference_mode():
            a = torch.log_softmax(model(input_ids=x).logits.double(), -1)
            b = torch.log_softmax(hf(input_ids=x).logits.double(), -1)
            c = torch.log_softmax(base_model(input_ids=x).logits.double(), -1)
        worst = max(worst, float((a - b).abs().max()))
        moved = max(moved, float((a - c).abs().max()))
    assert worst <= 1e-5, worst
    assert moved > 1e-3, "the export holds the base model's weights, not the trained ones"
    return run / "checkpoints" / "step_000003"


def test_export_into_a_non_empty_dir_needs_force_and_never_deletes(run, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    err = refused(capsys, ["export", str(run), "--out", str(out)], 2)
    assert "is not empty" in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    assert (out / "config.json").read_text() == "{}"

    assert main(["export", str(run), "--out", str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    assert "replaced in" in printed and "config.json" in printed and "kept in" in printed
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    assert _siblings(tmp_path) == []  # neither the temporary nor the set-aside directory is left


def test_export_to_a_file_is_exit_2(run, tmp_path, capsys) -> None:
    (tmp_path / "out").write_text("x")
    for extra in ([], ["--force"]):
        err = refused(capsys, ["export", str(run), "--out", str(tmp_path / "out"), *extra], 2)
        assert "is not a directory" in err
    assert (tmp_path / "out").read_text() == "x"


def test_export_to_an_unwritable_place_is_exit_5(run, tmp_path, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    elif subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("needs a read-only directory: tmpfs mounts are refused here")
    try:
        err = refused(capsys, ["export", str(run), "--out", str(ro / "models" / "arith")], 5)
        assert str(ro) in err
        assert list(ro.iterdir()) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=True)
        else:
            ro.chmod(0o755)


# -- D13: --out inside the run's own state; a full or failing disk ---------------------------


def _siblings(parent: Path) -> list[str]:
    """What an export leaves next to its DIR: its temporary and set-aside directories."""
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.mark.parametrize("where", [
    ".", "journal", "rows", "checkpoints", "checkpoints/step_000004/trainer",
    "checkpoints/step_000002", "checkpoints/abandoned-20250101T000000Z/new", "warmup",
    "warmup/checkpoints/new", "journal-abandoned-20250101T000000Z/new", "export/../journal/new",
    "link-to-trainer", "link-to-run/rows/new",
])
def test_d13_export_into_the_runs_own_state_is_exit_2_even_with_force(run, tmp_path, capsys, where) -> None:
    # An export into a checkpoint's trainer/ made the run's only resumable checkpoint
    # unrestorable ("trainer/config.json ... is not listed in MANIFEST.json"), one into
    # journal/ made the next start refuse the journal. Symlinks and `..` are resolved.
    (tmp_path / "link-to-trainer").symlink_to(run / "checkpoints" / "step_000004" / "trainer")
    (tmp_path / "link-to-run").symlink_to(run)
    out = tmp_path / where if where.startswith("link") else run / where
    before = tree(run)
    for extra in (["--force"], []):
        err = refused(capsys, ["export", str(run), "--out", str(out), *extra], 2)
        assert ("the run directory itself" if where == "." else "inside the run's own state") in err, err
        assert "RUN_DIR" not in err and str(run / "export" / "model") in err  # a place that is allowed
    assert tree(run) == before, "a refused export changed the run directory"
    assert not [p for p in run.iterdir() if p.name.startswith("journal-abandoned") or p.name == "export"]


def test_d13_export_elsewhere_under_the_run_dir_is_allowed_and_the_run_still_restores(run, tmp_path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert main(["export", str(copy), "--out", str(copy / "export" / "model")]) == 0
    assert (copy / "export" / "model" / "model.safetensors").is_file()
    assert main(["audit", "--all", str(copy / "checkpoints")]) == 0
    assert load_builtin(copy).weights_sha256 == load_builtin(run).weights_sha256


def _export_in_a_child(run: Path, out: Path, fsize: int) -> subprocess.CompletedProcess:
    """`rollkeep export` in its own process whose files may not grow past `fsize` bytes
    (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG, as a full disk's
    fails with ENOSPC), without root or a small mount."""
    import resource
    import signal
    import sys

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLKEEP_CRASH")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, "-m", "rollkeep", "export", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env, preexec_fn=limit)


def test_d13_export_on_a_full_disk_is_exit_5_and_leaves_nothing(run, tmp_path) -> None:
    # The model (~120 KB) does not fit; config.json (under 1 KiB) does and is written first.
    before = tree(run)
    out = tmp_path / "models" / "arith"
    got = _export_in_a_child(run, out, fsize=16 * 1024)
    assert got.returncode == 5, got.stderr
    err = got.stderr
    assert err.startswith("error: the filesystem failed while writing the exported model") and err.count("\n") == 1
    assert "Traceback" not in err and "errno 27" in err and "nothing of this export was left behind" in err
    assert not (tmp_path / "models").exists(), "the export left its parents or files behind"
    assert tree(run) == before


class _SafetensorErrorSave:
    """`safetensors.torch.save_file` on a full disk: part of the file, then safetensors'
    own exception, whose only trace of the errno is its text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __call__(self, tensors, filename, metadata=None) -> None:
        from safetensors import SafetensorError

        Path(filename).write_bytes(b"\0" * 1000)
        raise SafetensorError(self.text)


@pytest.mark.parametrize("failure", [
    "safetensors: No space left on device (os error 28)",
    "safetensors: No space left on device",
    *(f"tokenizer: {name}" for name in ("ENOSPC", "EDQUOT", "EFBIG", "EIO")),
])
def test_d13_export_on_a_failing_disk_is_exit_5_and_leaves_nothing(run, tmp_path, capsys, monkeypatch,
                                                                     failure) -> None:
    import errno

    import transformers.modeling_utils

    import rollkeep.export as ex

    kind, what = failure.split(": ", 1)
    if kind == "safetensors":
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                            _SafetensorErrorSave(f"Error while serializing: I/O error: {what}"))
        found = "No space left on device (errno 28)"
    else:
        n = getattr(errno, what)
        real = ex.hf_tokenizer

        class Full:
            def __init__(self, block_size: int) -> None:
                self.tok = real(block_size)

            def save_pretrained(self, path) -> None:
                self.tok.save_pretrained(path)  # written, then the next write fails
                raise OSError(n, os.strerror(n), str(Path(path) / "tokenizer.json"))

        monkeypatch.setattr(ex, "hf_tokenizer", Full)
        found = f"{os.strerror(n)} (errno {n})"
    out = tmp_path / "models" / "arith"
    err = refused(capsys, ["export", str(run), "--out", str(out)], 5)
    assert "the filesystem failed while writing the exported model" in err and found in err, err
    assert not (tmp_path / "models").exists()


def test_d13_force_on_a_full_disk_keeps_what_dir_held(run, tmp_path, capsys, monkeypatch) -> None:
    # --force replaces the exported names all or nothing: a failure after some were
    # replaced puts the old files back.
    import rollkeep.export as ex

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_text("old weights")
    before = tree(out)
    real, moved_in = os.rename, []

    def rename(src, dst) -> None:
        if Path(dst).parent == out and ".tmp-" in Path(src).parent.name:
            if len(moved_in) == 2:
                raise OSError(28, os.strerror(28), str(dst))
            moved_in.append(dst)
        real(src, dst)

    monkeypatch.setattr(ex.os, "rename", rename)
    err = refused(capsys, ["export", str(run), "--out", str(out), "--force"], 5)
    assert "moving the exported model into" in err and "errno 28" in err
    assert len(moved_in) == 2, "the failure did not land half-way"
    assert tree(out) == before, "what --out held was changed"
    assert _siblings(tmp_path) == []

    monkeypatch.setattr(ex.os, "rename", real)
    assert main(["export", str(run), "--out", str(out), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").stat().st_size > 1000
    assert _siblings(tmp_path) == []


def test_d13_force_when_putting_the_old_files_back_fails_too_deletes_nothing(run, tmp_path, capsys,
                                                                            monkeypatch) -> None:
    import rollkeep.export as ex

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    real = os.rename

    def rename(src, dst) -> None:
        if Path(dst).parent == out:  # every move into DIR fails, ours and the way back
            raise OSError(5, os.strerror(5), str(dst))
        real(src, dst)

    monkeypatch.setattr(ex.os, "rename", rename)
    err = refused(capsys, ["export", str(run), "--out", str(out), "--force"], 5)
    assert "putting its previous files back" in err and "nothing was deleted" in err
    (aside,) = [p for p in tmp_path.iterdir() if ".old-" in p.name]
    assert str(aside) in err and (aside / "config.json").read_text() == "{}"
