"""docs/config.md is the config reference generated from the field docstrings of
`rollkeep.config.sections`: a key added, removed, renamed or re-documented without
regenerating it fails here."""

from __future__ import annotations

import re
from pathlib import Path

from rollkeep.config import config_paths
from rollkeep.config.reference import COMMAND, render

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config.md"


def test_docs_config_md_is_the_generated_reference() -> None:
    assert PAGE.read_text() == render(), (
        f"docs/config.md is not what the config models generate; regenerate it: {COMMAND}"
    )


def test_the_reference_names_every_key_with_its_docstring() -> None:
    text = render()
    named = set(re.findall(r"^\| `([a-z_.]+)` \|", text, flags=re.M))
    sections = {p for p in config_paths() if p not in named}
    # Every leaf key has a row; what has no row is a section, and it has a heading.
    assert named <= config_paths()
    for section in sections:
        assert f"`{section}`" in text, section
    for row in re.findall(r"^\| `[a-z_.]+` \|.*$", text, flags=re.M):
        meaning = row.rsplit("|", 2)[-2].strip()
        assert meaning, row  # no key without a description
    assert "| `trainer.micro_batch_size` | int, ≥ 1 | `64` | under some values (below) |" in text
    assert "| `rollout.max_infra_attempts` | int, ≥ 1, ≤ 255 | `3` | no |" in text
