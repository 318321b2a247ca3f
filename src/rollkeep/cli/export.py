"""`rollkeep export RUN_DIR --out DIR`: the trained model as a Hugging Face model directory."""

from __future__ import annotations

import argparse

HELP = """\
Write the model of RUN_DIR's latest checkpoint (or --checkpoint NAME) as a Hugging Face
model directory: GPT-2 architecture (config.json, model.safetensors), the character
tokenizer (tokenizer.json, tokenizer_config.json), generation_config.json, and
rollkeep_export.json (which run, checkpoint and step it came from; names only, no absolute
path). An hf run (trainer.name: hf) exports its transformers model: the architecture and
tokenizer of the run's trainer.model_path with the checkpoint's weights, in the dtype of
the trainer's master weights (trainer.dtype, float32 by default). It loads offline with
transformers.AutoModelForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR),
and continues training with engine.name=hf / trainer.name=hf (configs/hf.yaml).

The checkpoint goes through the restore chain first (read-only: nothing in RUN_DIR
changes), and the written model is loaded back and compared with the checkpoint's before it
is moved into DIR (log-probs within 1e-4). Runs of trainer.name torch and hf export
(toy and custom trainers have no model to export). DIR must be new or empty; --force writes into a non-empty
DIR, replacing the files of the same names (all of them or, on a failure, none) and keeping
every other file. DIR may not be RUN_DIR itself nor inside the run's own state
(checkpoints/, journal/, journal-abandoned-*/, rows/, warmup/), even with --force; elsewhere
under RUN_DIR (e.g. RUN_DIR/export/NAME) is fine. The model is written next to DIR first
and moved in at the end: a failed export (a full disk too) leaves nothing behind.

examples:
  rollkeep export runs/arith --out models/arith
  rollkeep export runs/arith --out models/arith-100 --checkpoint step_000100
  rollkeep train configs/hf.yaml                 # RL continues from models/arith

exit codes: 2 bad RUN_DIR or DIR (or no model to export), 3 no checkpoint or one that
fails a check, 5 DIR cannot be written (read-only, no space left, an I/O error).
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export",
        help="write the trained model (torch or hf run) as a Hugging Face model directory",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a torch or hf run")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (new or empty)")
    p.add_argument("--checkpoint", metavar="NAME", help="export this checkpoint (e.g. step_000100) instead of LATEST")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty DIR: replace the exported files, keep the others")
    return p


def run(args: argparse.Namespace) -> int:
    from ..export import export

    r = export(args.run_dir, args.out, force=args.force, checkpoint=args.checkpoint)
    print(f"exported {r.checkpoint} (step {r.step}) of {args.run_dir} to {r.out}: {', '.join(r.files)}")
    print(f"checked: transformers reloads it offline; log-probs within {r.max_logprob_diff:.1e} of rollkeep's")
    if r.replaced:
        print(f"replaced in {r.out}: {', '.join(r.replaced)}")
    if r.kept:
        print(f"kept in {r.out} (not part of the export): {', '.join(r.kept)}")
    return 0
