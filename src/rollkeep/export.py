"""`rollkeep export RUN_DIR --out DIR`: the trained model as a Hugging Face model directory.

An `hf` run (`trainer.name: hf`) is a transformers model already: its architecture and
tokenizer are those of the run's `trainer.model_path` (from the checkpoint's config), its
weights the checkpoint's master weights (`trainer/model.safetensors`, or the shards of a
sharded checkpoint, read by the trainer's own `load`). They are written as `save_pretrained`
writes them, safetensors only, in the dtype of the master weights (`trainer.dtype`: float32
by default, not the base model's bf16: the weights as trained), with the base model's
tokenizer files; and checked by reloading, as below. The rest of this docstring is about
the built-in GPT (`trainer.name: torch`).

    load_builtin(run_dir)      the checkpoint's model, through the restore chain (read-only)
    gpt2_state_dict(model)     its weights under GPT2LMHeadModel's names
    hf_tokenizer(block_size)   the character tokenizer as a transformers tokenizer
    export(run_dir, out)       write DIR: config.json, generation_config.json,
                               model.safetensors, tokenizer files, rollkeep_export.json

The built-in GPT (`rollkeep.models.gpt`) is GPT-2's architecture: learned absolute position
embeddings, pre-norm blocks (LayerNorm eps 1e-5, with bias), one fused q|k|v projection,
scaled dot-product attention with a causal mask, a 4x MLP, a final LayerNorm and an output
head tied to the token embedding. Two differences are mapped here: its MLP uses the exact
GELU (`nn.GELU()`), so the exported config says `activation_function: gelu` (GPT-2's own
is the tanh approximation, `gelu_new`); and its projections are `nn.Linear` (weight
`[out, in]`) where GPT-2 has `Conv1D` (weight `[in, out]`), so every projection weight is
transposed.

The tokenizer is a BPE model with no merges over the same vocabulary in the same order
(`<pad>` 0, `<bos>` 1, `<eos>` 2, then the characters), so every character is one token
with rollkeep's id; a character outside the vocabulary becomes `?`, as in rollkeep; and a
post-processor puts `<bos>` in front of every encoded text, as `CharTokenizer.encode`
does. Completions end at `<eos>`. So `tokenizer(prompt)` gives the ids rollkeep's engine
sees, and the `hf` engine and trainer continue from the directory with the same ids.

Before anything is moved into DIR the written directory is loaded back with
`AutoModelForCausalLM` / `AutoTokenizer` (offline) and its log-probs are compared with the
checkpoint's model on probe prompts; a difference above `TOLERANCE` is refused. DIR is
written next to itself first (`.DIR.tmp-<hex>/`) and moved into place at the end; any
failure on the way, a full disk included, removes the temporary directory, so a failed
export leaves DIR as it was.

Refusals (one paragraph, nothing modified): RUN_DIR missing (exit 2); no checkpoint, or
one that fails the restore chain (exit 3); a run with no model to export (exit 2: only
`trainer.name: torch` and `hf` export); DIR inside the run's own state (exit 2, see
`RUN_STATE`); DIR a file, or a non-empty directory without `--force` (exit 2); DIR not
writable, or the disk full or failing while writing or reading back (exit 5: ENOSPC,
EDQUOT, EFBIG, EIO, also when safetensors or tokenizers wrap them in their own exception).

With `--force` the exported files replace those of the same name in DIR; other files are
kept and listed. The replacement is all or nothing: the old files of those names are first
moved aside into `.DIR.old-<hex>/` next to DIR, then the exported ones are moved in, then
the old ones deleted; a failure in between moves everything back. Only a kill in that
window (renames, milliseconds) leaves the old files in `.DIR.old-<hex>/`, never deleted.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core.checkpoint.store import CheckpointStore
from .core.errors import CheckpointError, ExternalError, FilesystemError, UserInputError
from .core.journal.durable import JOURNAL_DIR, ROWS_DIR
from .core.restore.chain import restore_chain
from .version import rollkeep_version

__all__ = ["ExportResult", "Loaded", "RUN_STATE", "TOLERANCE", "export", "gpt2_state_dict", "hf_tokenizer",
           "load_builtin"]

TOLERANCE = 1e-4  # largest |log-prob difference| accepted between the two models
PROVENANCE = "rollkeep_export.json"
_PROBES = ("0+0=", "12+34=", "99+99=", "7+58=", "Hello, world?")
_SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2: rollkeep's PAD, BOS, EOS
#: What of RUN_DIR is the run's own state (docs/design.md §4): DIR may be neither RUN_DIR
#: itself nor inside one of these (nor `journal-abandoned-*/`). An export there adds files
#: the next start refuses (a checkpoint's `trainer/config.json` is not in its manifest, a
#: journal file is not a segment) or that retention deletes. Elsewhere under RUN_DIR
#: (e.g. RUN_DIR/export/NAME) is not read by the run and is allowed.
RUN_STATE = ("checkpoints", JOURNAL_DIR, ROWS_DIR, "warmup")
_ABANDONED_JOURNAL = f"{JOURNAL_DIR}-abandoned-"
# Errors of a full or failing disk that libraries (safetensors, tokenizers) report only in
# their own exception's text, e.g. "I/O error: No space left on device (os error 28)".
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.EACCES)


@dataclass
class Loaded:
    """The built-in model of one checkpoint."""

    model: Any  # rollkeep.models.gpt.GPT, eval mode
    tokenizer: Any  # rollkeep.models.tokenizer.CharTokenizer
    checkpoint: str
    step: int
    config: dict[str, Any]  # the checkpoint's semantic config (MANIFEST.json `config`)
    weights_sha256: str
    kind: str = "torch"  # "torch": the built-in GPT; "hf": a transformers model (trainer.name hf)
    base_model: str | None = None  # hf: the name of trainer.model_path (no directory)

    def logits(self, ids: Any) -> Any:
        return self.model(ids) if self.kind == "torch" else self.model(input_ids=ids).logits


@dataclass
class ExportResult:
    out: Path
    checkpoint: str
    step: int
    files: list[str]
    max_logprob_diff: float
    replaced: list[str] = field(default_factory=list)  # --force: files of DIR overwritten
    kept: list[str] = field(default_factory=list)  # --force: other files of DIR, untouched


# ================================================================ reading the checkpoint


def load_builtin(run_dir: str | Path, *, checkpoint: str | None = None, allow_hf: bool = False) -> Loaded:
    """The checkpoint's built-in GPT (LATEST, or `checkpoint`), after the restore chain
    (steps 1-6, read-only) and the trainer's own checks of its files. `allow_hf`: an hf
    run's transformers model too (`kind` "hf")."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserInputError(
            f"run directory {run_dir} does not exist" if not run_dir.exists()
            else f"{run_dir} is not a directory",
            path=str(run_dir),
            expected="the run_dir of a `rollkeep train` run",
            found="no such directory" if not run_dir.exists() else "a file",
            remedy="pass the run_dir of a training run (the directory holding checkpoints/)",
        )
    store = CheckpointStore(run_dir / "checkpoints")
    if checkpoint is None and not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(
            f"{run_dir} has no checkpoint to export",
            path=str(run_dir / "checkpoints"),
            expected="checkpoints/ with a published checkpoint",
            found="no checkpoints directory",
            remedy="run `rollkeep train` until it publishes a checkpoint (every "
            "checkpoint.every_steps steps, and when it stops), then export",
        )
    if checkpoint is not None and not (store.root / checkpoint).is_dir():
        names = store.list() if store.root.is_dir() else []
        raise UserInputError(
            f"--checkpoint {checkpoint}: {run_dir} has no such checkpoint",
            path=str(store.root / checkpoint),
            expected=f"one of {', '.join(names)}" if names else "a published checkpoint",
            found="no such directory",
            remedy="name a checkpoint of RUN_DIR/checkpoints, or leave --checkpoint out for LATEST's",
        )
    restored = restore_chain(store, name=checkpoint, source=None, config=None)
    config = restored.meta.config
    trainer_cfg = config.get("trainer")
    name = trainer_cfg.get("name") if isinstance(trainer_cfg, dict) else None
    if name not in ("torch", "hf") or (not allow_hf and name == "hf"):
        raise UserInputError(
            f"checkpoint {restored.name} of {run_dir} has no model that exports",
            path=str(restored.checkpoint.path / "MANIFEST.json"),
            field="config.trainer.name",
            expected="torch (the built-in GPT) or hf (a transformers model): the toy and custom "
            "trainers have no model to export",
            found=repr(name),
            remedy="export a run trained with trainer.name: torch or hf",
        )
    if name == "hf":
        return _load_hf(restored, trainer_cfg, config)

    import torch

    from .config import TorchTrainerConfig
    from .models.gpt import GPT, GPTConfig
    from .models.tokenizer import CharTokenizer
    from .trainers.grpo import TorchTrainer

    tcfg = _trainer_config(TorchTrainerConfig, restored, trainer_cfg)
    tokenizer = CharTokenizer()
    m = tcfg.model
    gpt_cfg = GPTConfig(vocab_size=m.vocab_size or tokenizer.vocab_size, n_layer=m.n_layer,
                        n_head=m.n_head, n_embd=m.n_embd, block_size=m.block_size, dropout=m.dropout)
    engine_cfg = config.get("engine") if isinstance(config.get("engine"), dict) else {}
    rng = torch.get_rng_state()  # the trainer seeds and restores the global generator
    try:
        trainer = TorchTrainer(tcfg, model=GPT(gpt_cfg), tokenizer=tokenizer,
                               temperature=float(engine_cfg.get("temperature", 1.0)), seed=0,
                               max_completion_length=int(engine_cfg.get("max_new_tokens", 8)))
        trainer.load(restored.trainer_dir, step=restored.ledger.version)  # every file and tensor checked
    finally:
        torch.set_rng_state(rng)
    return Loaded(model=trainer.model.eval(), tokenizer=tokenizer, checkpoint=restored.name,
                  step=restored.ledger.version, config=config, weights_sha256=trainer.weights_sha256())


def _trainer_config(cls: Any, restored: Any, trainer_cfg: dict[str, Any]) -> Any:
    """The checkpoint's trainer section as `cls`, or a CheckpointError naming its MANIFEST."""
    try:
        return cls.model_validate(trainer_cfg)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {restored.name}: its trainer config is not one this rollkeep reads",
            path=str(restored.checkpoint.path / "MANIFEST.json"),
            field="config.trainer",
            found=" ".join(str(e).split())[:300],
            remedy="export with the rollkeep version that wrote the checkpoint",
        ) from None


def _load_hf(restored: Any, trainer_cfg: dict[str, Any], config: dict[str, Any]) -> Loaded:
    """An hf run's checkpoint: the architecture and tokenizer of the run's
    `trainer.model_path`, with the checkpoint's master weights (one `model.safetensors`, or
    the shards of a sharded checkpoint), every file checked by the trainer's `load`."""
    import torch

    from .config import HFTrainerConfig
    from .trainers.hf import HFTrainer

    tcfg = _trainer_config(HFTrainerConfig, restored, trainer_cfg)
    engine_cfg = config.get("engine") if isinstance(config.get("engine"), dict) else {}
    rng = torch.get_rng_state()  # the trainer seeds and restores the global generator
    try:
        trainer = HFTrainer(tcfg, temperature=float(engine_cfg.get("temperature", 1.0)), seed=0,
                            max_completion_length=int(engine_cfg.get("max_new_tokens", 8)))
        trainer.load(restored.trainer_dir, step=restored.ledger.version)  # every file and tensor checked
    finally:
        torch.set_rng_state(rng)
    model = trainer.model.cpu().eval()
    return Loaded(model=model, tokenizer=trainer.tokenizer, checkpoint=restored.name,
                  step=restored.ledger.version, config=config, weights_sha256=trainer.weights_sha256(),
                  kind="hf", base_model=Path(tcfg.model_path).name)


# ================================================================ mapping to GPT-2


def gpt2_config(loaded: Loaded) -> Any:
    from transformers import GPT2Config

    from .models.tokenizer import BOS, EOS, PAD

    c = loaded.model.cfg
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=4 * c.n_embd,
        activation_function="gelu",  # nn.GELU(): exact erf GELU, not GPT-2's gelu_new
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        scale_attn_weights=True,  # 1 / sqrt(head size), as rollkeep's attention
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )


def gpt2_state_dict(model: Any) -> dict[str, Any]:
    """rollkeep GPT state dict -> GPT2LMHeadModel's names; `nn.Linear` weights
    transposed into GPT-2's `Conv1D` layout. The tied head is left to `tie_word_embeddings`."""
    sd = model.state_dict()
    out = {
        "transformer.wte.weight": sd["wte.weight"],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
        "transformer.ln_f.bias": sd["ln_f.bias"],
    }
    for i in range(model.cfg.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
            out[f"{dst}{b}.weight"] = sd[f"{src}{a}.weight"]
            out[f"{dst}{b}.bias"] = sd[f"{src}{a}.bias"]
        for a, b in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                     ("mlp.0", "mlp.c_fc"), ("mlp.2", "mlp.c_proj")):
            out[f"{dst}{b}.weight"] = sd[f"{src}{a}.weight"].t().contiguous()  # [out, in] -> [in, out]
            out[f"{dst}{b}.bias"] = sd[f"{src}{a}.bias"]
    return {k: v.detach().clone() for k, v in out.items()}


def hf_tokenizer(block_size: int) -> Any:
    """`CharTokenizer` as a `PreTrainedTokenizerFast` (same ids, `<bos>` prepended)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    from .models.tokenizer import _CHARS, _SPECIAL, BOS, CharTokenizer

    assert len(_SPECIAL_NAMES) == _SPECIAL
    vocab = {name: i for i, name in enumerate(_SPECIAL_NAMES)}
    vocab.update({c: i + _SPECIAL for i, c in enumerate(_CHARS)})
    assert len(vocab) == CharTokenizer().vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="?"))  # unknown char -> "?", as rollkeep
    tok.decoder = decoders.Fuse()  # join characters without spaces
    tok.add_special_tokens(list(_SPECIAL_NAMES))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        model_max_length=block_size, padding_side="right",
    )


# ================================================================ export


def export(run_dir: str | Path, out: str | Path, *, force: bool = False,
           checkpoint: str | None = None) -> ExportResult:
    """Write the checkpoint's built-in GPT into `out` as a Hugging Face model directory
    (see the module docstring for what is checked and refused)."""
    out = Path(out)
    _check_not_run_state(Path(run_dir), out)
    _check_out(out, force)
    loaded = load_builtin(run_dir, checkpoint=checkpoint, allow_hf=True)
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise UserInputError(
            "rollkeep export needs the transformers library, which is not installed",
            expected="transformers importable",
            found=str(e),
            remedy="pip install 'rollkeep[hf]'",
        ) from None
    from transformers.utils import logging as hf_logging

    made = _make_parents(out)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights: 100%" twice says nothing here
    try:
        try:
            tmp.mkdir()
            (_write if loaded.kind == "torch" else _write_hf)(loaded, tmp, run_dir)
            diff = verify(loaded, tmp)
        except Exception as e:
            err = _os_error(e)
            if err is None:
                raise
            raise _fs_error(err, f"writing the exported model next to {out}", out) from None
        if not diff <= TOLERANCE:
            raise ExternalError(
                "the exported model does not reproduce the checkpoint's model",
                path=str(out),
                expected=f"log-probs within {TOLERANCE:g} of rollkeep's on the probe prompts",
                found=f"a largest difference of {diff:.3g} (transformers {transformers.__version__})",
                remedy="report it with the transformers version; nothing was written to the output",
            )
        try:
            replaced, kept = _move_into_place(tmp, out)
        except OSError as e:
            raise _fs_error(e, f"moving the exported model into {out}", out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(made):  # parents this export created, if still empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    files = sorted(p.name for p in out.iterdir() if p.name not in kept)
    return ExportResult(out=out, checkpoint=loaded.checkpoint, step=loaded.step, files=files,
                        max_logprob_diff=diff, replaced=replaced, kept=kept)


def _check_not_run_state(run_dir: Path, out: Path) -> None:
    """Refuse an `out` that is RUN_DIR or inside its state, after resolving symlinks and
    `..` in both (so a symlink to a checkpoint's trainer/ is refused too)."""
    try:
        run, target = run_dir.resolve(), out.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise UserInputError(
            f"--out {out} cannot be resolved",
            path=str(out),
            expected="a path whose symlinks resolve",
            found=str(e),
            remedy="choose another --out",
        ) from None
    if not target.is_relative_to(run):
        return
    rel = target.relative_to(run).parts
    if rel and rel[0] not in RUN_STATE and not rel[0].startswith(_ABANDONED_JOURNAL):
        return
    raise UserInputError(
        f"--out {out} is the run directory itself" if not rel else f"--out {out} is inside the run's own state",
        path=str(out),
        expected=f"a directory outside {run_dir}, or under it but outside its "
        f"{'/, '.join(RUN_STATE)}/ and {_ABANDONED_JOURNAL}*/ (e.g. {run_dir / 'export' / 'model'})",
        found=str(target) if not rel else f"{target} (in {rel[0]}/ of the run)",
        remedy="choose another --out: exported files there would be taken for the run's own "
        "(its next start refuses a checkpoint or journal holding them), with or without --force",
    )


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind `e`: `e` itself, one it was raised from, or one that a library
    reports only in its exception's text (safetensors' `SafetensorError: Error while
    serializing: I/O error: No space left on device (os error 28)`). None: not an I/O error."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        text = str(cur)
        m = re.search(r"\(os error (\d+)\)", text)
        if m:
            return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
        for n in _DISK_ERRNOS:
            if os.strerror(n) in text:
                return OSError(n, os.strerror(n))
        if "I/O error" in text:
            return OSError(errno.EIO, " ".join(text.split())[:300])
        cur = cur.__cause__ or cur.__context__
    return None


def _fs_error(err: OSError, doing: str, out: Path) -> FilesystemError:
    return FilesystemError(
        f"the filesystem failed while {doing}",
        path=str(err.filename if err.filename is not None else out),
        expected="a writable directory with free space for the model",
        found=f"{err.strerror or err} (errno {err.errno})" if err.errno else str(err),
        remedy="free space or fix the permissions, then export again; nothing of this export "
        "was left behind, and what --out held before is as it was",
    )


def _check_out(out: Path, force: bool) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserInputError(
            f"--out {out} exists and is not a directory",
            path=str(out),
            expected="a new or empty directory (or, with --force, a directory to write into)",
            found="a symlink" if out.is_symlink() else "a file",
            remedy="choose another --out, or move the file away yourself",
        )
    if out.is_dir():
        try:
            names = sorted(p.name for p in out.iterdir())
        except OSError as e:
            raise FilesystemError.of(e, f"reading --out {out}") from None
        if names and not force:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise UserInputError(
                f"--out {out} is not empty",
                path=str(out),
                expected="a new or empty directory",
                found=f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: {shown}",
                remedy="choose another --out, or pass --force to overwrite the exported files "
                "there (other files are kept; nothing is deleted)",
            )


def _make_parents(out: Path) -> list[Path]:
    """Create the missing parents of `out`; return those created (outermost first)."""
    missing = []
    p = out.parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    made = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except OSError as e:
            for m in reversed(made):
                m.rmdir()
            raise FilesystemError.of(e, f"creating the parent directories of {out}") from None
        made.append(d)
    return made


def _write(loaded: Loaded, tmp: Path, run_dir: str | Path) -> None:
    import torch
    from transformers import GenerationConfig, GPT2LMHeadModel

    config = gpt2_config(loaded)
    with torch.device("cpu"):
        model = GPT2LMHeadModel(config)
    missing, unexpected = model.load_state_dict(gpt2_state_dict(loaded.model), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise AssertionError(f"GPT-2 mapping: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    engine = loaded.config.get("engine") if isinstance(loaded.config.get("engine"), dict) else {}
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, max_new_tokens=int(engine.get("max_new_tokens", 8)),
    )
    model.save_pretrained(tmp, safe_serialization=True)
    hf_tokenizer(loaded.model.cfg.block_size).save_pretrained(tmp)
    # transformers 5 names the class TokenizersBackend, which 4.x does not know; both
    # load PreTrainedTokenizerFast.
    tok_config = tmp / "tokenizer_config.json"
    data = json.loads(tok_config.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config.write_text(json.dumps(data, indent=2) + "\n")
    _write_provenance(loaded, tmp, run_dir)


def _write_hf(loaded: Loaded, tmp: Path, run_dir: str | Path) -> None:
    """An hf run: the trained model as `save_pretrained` writes it (config.json,
    generation_config.json, model.safetensors, sharded above its size limit) in the dtype of
    the trainer's master weights (`trainer.dtype`, float32 by default: the weights as
    trained, not rounded back to the base model's bf16), and the base model's tokenizer
    files, unchanged."""
    loaded.model.save_pretrained(tmp, safe_serialization=True)
    loaded.tokenizer.tok.save_pretrained(tmp)
    _write_provenance(loaded, tmp, run_dir)


def _write_provenance(loaded: Loaded, tmp: Path, run_dir: str | Path) -> None:
    """rollkeep_export.json: names only (no absolute path: the directory moves and is shared)."""
    meta = {
        "run_dir": Path(run_dir).resolve().name,
        "checkpoint": loaded.checkpoint,
        "step": loaded.step,
        "trainer": loaded.kind,
        "weights_sha256": loaded.weights_sha256,
        "rollkeep_version": rollkeep_version(),
    }
    if loaded.base_model is not None:
        meta["base_model"] = loaded.base_model
        meta["dtype"] = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    (tmp / PROVENANCE).write_text(json.dumps(meta, indent=1) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.iterdir():  # safetensors writes 0600; give every file the usual mode
        f.chmod(0o666 & ~umask)


def verify(loaded: Loaded, path: Path) -> float:
    """Load `path` back the way a user does (offline) and return the largest |difference|
    of log_softmax over the vocabulary, at every position of the probe prompts."""
    import torch
    from torch.nn import functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True).eval()
    worst = 0.0
    with torch.inference_mode():
        for text in _PROBES:
            ids = loaded.tokenizer.encode(text)
            if tok(text)["input_ids"] != ids:
                return float("inf")  # the tokenizers disagree: nothing else can match
            x = torch.tensor([ids])
            a = F.log_softmax(loaded.logits(x).double(), dim=-1)
            b = F.log_softmax(hf(input_ids=x).logits.double(), dim=-1)
            worst = max(worst, float((a - b).abs().max()))
    return worst


def _move_into_place(tmp: Path, out: Path) -> tuple[list[str], list[str]]:
    """Rename `tmp` to `out` (new or empty), or, into a non-empty `out` (--force), replace
    the files of the exported names, all or nothing (see the module docstring). Returns
    (replaced, kept)."""
    if not out.exists():
        os.rename(tmp, out)
        return [], []
    existing = sorted(p.name for p in out.iterdir())
    if not existing:
        os.rename(tmp, out)  # POSIX: a directory replaces an empty one atomically
        return [], []
    ours = sorted(p.name for p in tmp.iterdir())
    for name in ours:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            raise IsADirectoryError(21, "a directory is in the way of an exported file", str(target))
    aside = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
    aside.mkdir()
    moved_aside: list[str] = []
    moved_in: list[str] = []
    try:
        for name in ours:
            if os.path.lexists(out / name):
                os.rename(out / name, aside / name)
                moved_aside.append(name)
        for name in ours:
            os.rename(tmp / name, out / name)
            moved_in.append(name)
    except BaseException:
        try:  # back as it was: renames within the directories just renamed from
            for name in reversed(moved_in):
                os.rename(out / name, tmp / name)
            for name in reversed(moved_aside):
                os.rename(aside / name, out / name)
            aside.rmdir()
        except OSError as e:
            raise FilesystemError(
                f"the filesystem failed while moving the exported model into {out}, and again "
                "while putting its previous files back",
                path=str(aside),
                expected="renames within one directory to succeed",
                found=f"{e.strerror or e} (errno {e.errno})",
                remedy=f"the files of {out} that the export was replacing are in {aside}: move them "
                "back by hand; nothing was deleted",
            ) from None
        raise
    shutil.rmtree(aside, ignore_errors=True)  # the replaced files: the export is in place
    tmp.rmdir()
    return [n for n in existing if n in ours], [n for n in existing if n not in ours]
