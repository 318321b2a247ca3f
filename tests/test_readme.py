"""The README's library example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_library_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "import rollkeep as rk" in b)
    exec(compile(example, "README.md", "exec"), {})


def test_readme_and_help_agree() -> None:
    """What the README says about the commands is what their --help says."""
    import argparse
    import io
    from contextlib import redirect_stdout

    from rollkeep.cli import chaos, main

    sub = argparse.ArgumentParser().add_subparsers()
    kills = next(a for a in chaos.add_parser(sub)._actions if "--kills" in a.option_strings)
    text = README.read_text()
    assert f"({kills.default} kills unless --kills says otherwise)" in text
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["bench", "--help"]) == 0
    assert "--quick" in out.getvalue() and "# everything small, about a minute and a half" in out.getvalue()
    assert "`--quick` for a smoke\nrun (about a minute and a half on 2 cores)" in text
    for command in ("train", "inspect", "audit", "chaos", "trace", "bench", "export"):
        assert f"rollkeep {command} " in text, command


def test_user_facing_text_cites_no_file_outside_the_repository() -> None:
    root = README.parent
    for path in [README, *sorted((root / "src").rglob("*.py")), *sorted((root / "docs").rglob("*.md"))]:
        text = path.read_text()
        for outside in ("DESIGN.md", "DESIGN §", "../shared", "reference/00"):
            assert outside not in text, f"{path.relative_to(root)} cites {outside!r}"
    assert (root / "docs" / "design.md").is_file()
