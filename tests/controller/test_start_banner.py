"""What `rollkeep train` says before and after a run: the start-up banner (the job in
plain lines), the resume's plain line, and the end's outputs and next commands (which
name only commands that exist)."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

from run_harness import config

from rollkeep.cli import main
from rollkeep.controller.banner import model_text, resume_line, start_banner
from rollkeep.controller.summary import outputs_lines


class _Model:
    def parameters(self):
        class P:
            def __init__(self, n: int) -> None:
                self.n = n

            def numel(self) -> int:
                return self.n

        return [P(400_000), P(12_345)]


class _Trainer:
    model = _Model()


def test_the_banner_names_the_job(tmp_path) -> None:
    cfg = config(tmp_path / "run", "train.total_steps=30", "data.generated.n_rows=96")
    lines = start_banner(cfg, config_file="configs/toy.yaml", dataset_rows=96, eval_rows=128, evaluates=True,
                         trainer=_Trainer(), resume=None)
    text = "\n".join(lines)
    assert lines[0].endswith("train configs/toy.yaml")
    assert f"run_dir     {tmp_path / 'run'} (new)" in text
    assert "96 rows (built-in arith)" in text and "eval 128 rows (held out)" in text
    assert "0.41M parameters" in text and "engine toy, trainer toy" in text
    assert f"steps       30 x {cfg.train.num_prompts_per_step} prompts x {cfg.rollout.group_size} completions" in text
    assert "metrics.jsonl, samples.jsonl, checkpoints/" in text
    resumed = "\n".join(start_banner(cfg, config_file=None, dataset_rows=96, eval_rows=None, evaluates=False,
                                     trainer=object(), resume="step_000012"))
    assert "(defaults)" in resumed and "(resumes from checkpoint step_000012)" in resumed
    assert "no eval" in resumed and "samples.jsonl" not in resumed
    assert model_text(object(), "toy") == "no weights (a fake trainer)"


def test_the_resume_line_says_in_plain_words_what_was_lost() -> None:
    line = resume_line(step=166, total_steps=2000, source="checkpoint step_000166", steps_redone=[], groups_lost=0)
    assert line == "resuming at step 166 of 2000 from checkpoint step_000166; nothing lost"
    line = resume_line(step=250, total_steps=2000, source="checkpoint step_000250", steps_redone=[251, 296],
                       groups_lost=0, regenerated=106)
    assert "steps 251-296: trained after it, lost with the process, trained again; no prompt lost" in line
    assert "106 unfinished completion(s) are generated again" in line
    line = resume_line(step=4, total_steps=12, source="the journal", steps_redone=[], groups_lost=3)
    assert "3 prompt group(s) in flight were LOST" in line and "nothing lost" not in line


def test_the_end_names_the_outputs_and_only_commands_that_exist(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "samples.jsonl").write_text("")
    torch = "\n".join(outputs_lines(str(tmp_path), checkpoint="step_000030", trainer="torch"))
    assert "metrics.jsonl (per step), samples.jsonl (eval samples), checkpoints/step_000030" in torch
    assert f"rollkeep report {tmp_path}" in torch and f"rollkeep export {tmp_path} --out DIR" in torch
    toy = "\n".join(outputs_lines(str(tmp_path), checkpoint="step_000030", trainer="toy"))
    assert "rollkeep export" not in toy  # only the torch and hf trainers' models export
    assert "rollkeep export" in "\n".join(outputs_lines(str(tmp_path), checkpoint="step_000030", trainer="hf"))
    for command in ("report", "export"):  # both are commands: their --help exits 0
        with redirect_stdout(io.StringIO()):
            try:
                main([command, "--help"])
            except SystemExit as e:
                assert e.code == 0
