"""`data.chat_template` (issue 27): refused, before anything runs, with an engine whose
tokenizer has no chat template (toy, torch); otherwise the one place that decides it
(`controller.build.with_chat_template`) turns the prompt's template on for the engine
(`data.chat_template or engine.chat_template`) and the episodes' for `data.chat_template`
alone."""

from __future__ import annotations

import pytest
from run_harness import DEFAULTS, FAST

from rollkeep.cli import main
from rollkeep.config import load_config
from rollkeep.controller.build import with_chat_template
from rollkeep.core.errors import ConfigError

HF = ["engine.name=hf", "engine.model_path=/nowhere", "trainer.name=hf", "trainer.model_path=/nowhere"]


@pytest.mark.parametrize("backend", [["engine.name=toy", "trainer.name=toy"],
                                     ["engine.name=torch", "trainer.name=torch"]])
def test_an_engine_without_a_hugging_face_tokenizer_refuses_data_chat_template(backend) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*backend, "data.chat_template=true"])
    engine = backend[0].split("=")[1]
    assert e.value.field == "data.chat_template"
    assert f"needs `engine.name: hf`, `vllm` or `remote` (a Hugging Face tokenizer); found `engine.name: {engine}`" \
        in str(e.value) and "set data.chat_template=false" in str(e.value)


def test_rollkeep_train_exits_2_and_runs_nothing(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", DEFAULTS, *FAST, f"run_dir={run}", "data.chat_template=true"]) == 2
    err = capsys.readouterr().err
    assert "data.chat_template" in err and "Nothing was run" in err and "Traceback" not in err
    assert not run.exists()


def test_the_effective_setting_is_data_or_engine_chat_template() -> None:
    plain = load_config(None, HF)
    assert with_chat_template(plain) is plain and plain.engine.chat_template is False
    engine_only = load_config(None, [*HF, "engine.chat_template=true"])
    assert with_chat_template(engine_only) is engine_only  # the prompt only, as it always was
    data = load_config(None, [*HF, "data.chat_template=true"])
    effective = with_chat_template(data)
    assert effective.engine.chat_template is True and effective.data.chat_template is True
    assert data.engine.chat_template is False  # the user's config is left as it was (checkpoints record it)
    assert load_config(None, []).data.chat_template is False
