"""`--json` means one thing in every subcommand (issue 28): print the result as one JSON
object on stdout. `bench` and `chaos` write a file with `--json-out PATH`; their older
`--json PATH` still does."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollkeep.cli import _load

TOY = str(Path(__file__).resolve().parents[2] / "configs" / "toy.yaml")


def _parse(command: str, *argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    made = _load(command).add_parser(sub)
    parser = made if isinstance(made, argparse.ArgumentParser) else sub.choices[command]
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("command", ["inspect", "report", "bench", "chaos"])
def test_a_bare_json_flag_means_json_on_stdout(command: str) -> None:
    positional = ["runs/a"] if command in ("inspect", "report") else []
    assert _parse(command, *positional, "--json").json in (True, "-")
    assert not _parse(command, *positional).json


@pytest.mark.parametrize("command", ["bench", "chaos"])
def test_a_json_file_is_json_out_and_the_old_spelling_still_works(command: str) -> None:
    assert _parse(command, "--json-out", "r.json").json == "r.json"
    assert _parse(command, "--json", "r.json").json == "r.json"


def test_chaos_json_prints_only_json_on_stdout(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "rollkeep", "chaos", TOY, "--kills", "0",
                          "--workdir", str(tmp_path), "train.total_steps=3", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["passed"] is True and report["steps"] == 3
    assert "PASS" in out.stderr
