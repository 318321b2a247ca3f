"""The README and the pages under docs/ as written: their Python examples run, what they say
about the commands is what the commands do, and every link between them leads somewhere."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = README.parent
# The user-facing pages: the README (the landing page) and every page it links under docs/.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path = README) -> list[str]:
    """The ```python blocks of a page: code a user would copy."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def all_python_blocks() -> list[str]:
    return [block for page in PAGES for block in python_blocks(page)]


def pages_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_example_runs_as_written(page: Path) -> None:
    for block in python_blocks(page):
        exec(compile(block, str(page.relative_to(ROOT)), "exec"), {"__name__": "example"})


def test_the_examples_are_there() -> None:
    """The library example (docs/library.md) and the environment (docs/multiturn.md) are
    found, so the test above cannot pass on pages that lost them."""
    blocks = all_python_blocks()
    assert any("import rollkeep as rk" in b for b in blocks)
    assert any("class GuessEnv" in b for b in blocks)
    assert any("def score(completion: str, row: dict) -> float:" in b for b in blocks)


def test_readme_and_help_agree() -> None:
    """What the README and docs/ say about the commands is what their --help says."""
    import argparse
    import io
    from contextlib import redirect_stdout

    from rollkeep.cli import chaos, main

    sub = argparse.ArgumentParser().add_subparsers()
    kills = next(a for a in chaos.add_parser(sub)._actions if "--kills" in a.option_strings)
    text = pages_text()
    assert f"({kills.default} kills unless --kills says otherwise)" in text
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--help"]) == 0
    assert "--quick" in out.getvalue() and "# everything small, about a minute and a half" in out.getvalue()
    assert "`--quick` for a smoke\nrun (about a minute and a half on 2 cores)" in text
    for command in ("train", "inspect", "audit", "chaos", "report", "trace", "bench", "export"):
        assert f"rollkeep {command} " in text, command


# `rollkeep WORD` where WORD is a command name (lowercase); placeholders (COMMAND, <command>,
# {name}) are not. After the start of a command line or a separator, `python -m`, a path.
_NAMED = re.compile(r"(?:^|[\s/;&|(`])rollkeep ([a-z][a-z-]*)\b")
# A quoted message naming a command: "rollkeep report RUN_DIR", "rollkeep export --out",
# "rollkeep trace runs/a"; not prose such as "rollkeep cannot read".
_QUOTED = re.compile(r"[\"']rollkeep ([a-z][a-z-]*)(?=[\"'`]| (?:-|[A-Z_]{2,}\b|[\w.-]*/|\{))")


def _named_in_markdown(text: str) -> list[str]:
    """Commands named in the shell code blocks and the inline code of a markdown text."""
    names = []
    for lang, block in re.findall(r"```([a-z]*)\n(.*?)```", text, flags=re.S):
        if lang in ("bash", "sh", "shell", "console"):  # not python, not a directory tree
            names += _NAMED.findall(block)
    for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        names += _NAMED.findall(span)
    return names


def test_d15_every_rollkeep_command_named_exists() -> None:
    """Every `rollkeep <command>` that the README, the docs, the messages and comments of
    src/rollkeep and each command's --help name is a subcommand the parser knows, and runs
    (`--help` exits 0). train's summary named `rollkeep report`, which did not exist."""
    import argparse
    import io
    from contextlib import redirect_stdout

    from rollkeep.cli import build_parser, main

    sub = next(a for a in build_parser(None)._actions if isinstance(a, argparse._SubParsersAction))
    known = set(sub.choices)
    root = ROOT
    named: dict[str, set[str]] = {}  # command -> where it is named
    for path in [README, *sorted((root / "docs").rglob("*.md"))]:
        for name in _named_in_markdown(path.read_text()):
            named.setdefault(name, set()).add(str(path.relative_to(root)))
    for path in sorted((root / "src" / "rollkeep").rglob("*")):
        if path.suffix not in (".py", ".yaml"):
            continue
        text = path.read_text()
        for span in re.findall(r"`([^`\n]+)`", text):  # within a line: no span across comments
            for name in _NAMED.findall(span):
                named.setdefault(name, set()).add(str(path.relative_to(root)))
        for name in _QUOTED.findall(text):
            named.setdefault(name, set()).add(str(path.relative_to(root)))
    helps = {"rollkeep --help": []} | {f"rollkeep {c} --help": [c, "--help"] for c in sorted(known)}
    for where, argv in helps.items():
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(argv or ["--help"]) == 0, where
        for line in out.getvalue().splitlines():  # the examples: `  rollkeep export runs/a ...`
            m = re.match(r"\s+(?:\$ )?rollkeep ([a-z][a-z-]*)\b", line)
            if m:
                named.setdefault(m.group(1), set()).add(where)
    unknown = {name: sorted(where) for name, where in named.items() if name not in known}
    assert not unknown, f"commands named that do not exist: {unknown}"
    # The scan found what is there (a regex that matches nothing would pass the check above).
    assert {"train", "inspect", "audit", "chaos", "simulate", "report", "bench", "export"} <= set(named)
    assert "src/rollkeep/controller/summary.py" in named["report"]


def test_user_facing_text_cites_no_file_outside_the_repository() -> None:
    root = ROOT
    for path in [README, *sorted((root / "src").rglob("*.py")), *sorted((root / "docs").rglob("*.md"))]:
        text = path.read_text()
        for outside in ("DESIGN.md", "DESIGN §", "../shared", "reference/00"):
            assert outside not in text, f"{path.relative_to(root)} cites {outside!r}"
    assert (root / "docs" / "design.md").is_file()


def _anchors(text: str) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_every_page_is_linked_from_the_readme_and_every_link_leads_somewhere() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists (and a heading
    of it, for `page.md#heading`), and every page under docs/ is linked from the README."""
    linked: set[Path] = set()
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            assert dest.exists(), f"{where} names no file"
            if anchor:
                assert anchor in _anchors(dest.read_text()), f"{where}: no such heading"
            if page == README:
                linked.add(dest)
    assert {p.resolve() for p in PAGES[1:]} <= linked, "pages under docs/ that the README does not link"
