"""Every `--flag` written after a `rollkeep <command>` in the README, docs/*.md and the
messages in src/ is one of that command's options (issue 28). That the commands themselves
exist is tests/test_readme.py's `test_d15_every_rollkeep_command_named_exists`."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from rollkeep.cli import ALIASES, COMMANDS, _load

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = sorted((ROOT / "src" / "rollkeep").rglob("*.py"))

# A command, not prose ("rollkeep writes ..."): right after a backtick, a quote, `bin/`,
# `-m `, `$ ` or at the start of a line of a code block; the rest of the line is its arguments.
_MENTION = re.compile(r"(?:^|[`'\"(]|bin/|-m |\$ )rollkeep ([a-z][a-z-]*)([^`'\"\n]*)", re.M)
# In the code a quote opens prose too (f"rollkeep cannot read ..."): only backticks there.
_MESSAGE = re.compile(r"(?:`|bin/|-m )rollkeep ([a-z][a-z-]*)([^`'\"\n]*)")


def _code_text(page: Path) -> str:
    """The page's code: fenced blocks and inline code spans, one per line."""
    text = page.read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return "\n".join([*blocks, *("`" + span for span in re.findall(r"`([^`\n]+)`", rest))])


def mentions() -> list[tuple[str, str, str]]:
    """(where, command, rest of its line) for each command-shaped mention."""
    out = []
    for path in PAGES:
        for m in _MENTION.finditer(_code_text(path)):
            out.append((str(path.relative_to(ROOT)), m.group(1), m.group(2)))
    for path in SOURCES:
        for m in _MESSAGE.finditer(path.read_text()):
            out.append((str(path.relative_to(ROOT)), m.group(1), m.group(2)))
    return out


def _options(command: str) -> set[str]:
    sub = argparse.ArgumentParser().add_subparsers()
    made = _load(command).add_parser(sub)
    parser = made if isinstance(made, argparse.ArgumentParser) else sub.choices[command]
    return {opt for action in parser._actions for opt in action.option_strings}


def test_mentions_are_found() -> None:
    """The scan sees the mentions it is meant to, so the tests below cannot pass on nothing."""
    found = {(where, command) for where, command, _ in mentions()}
    assert ("README.md", "train") in found and ("README.md", "report") in found
    assert any(where.startswith("src/") and command == "report" for where, command in found)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_named_flag_exists(command: str) -> None:
    options = _options(command)
    wrong = sorted({(where, flag) for where, named, rest in mentions()
                    if ALIASES.get(named, named) == command
                    for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest) if flag not in options})
    assert not wrong, f"flags of `rollkeep {command}` it does not have: {wrong}"
