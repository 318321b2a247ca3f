"""`rollkeep serve` refuses bad input before it listens: one paragraph on stderr, exit 2, no
traceback (run in process: the refusals come before anything would serve)."""

from __future__ import annotations

import socket

import pytest

from rollkeep import cli
from rollkeep.cli import main


def refused(capsys, *argv: str) -> str:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_serve_is_a_subcommand_with_examples(capsys):
    assert "serve" in cli.COMMANDS
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "rollkeep serve models/arith --port 8101" in out and "--exit-with-parent" in out


def test_a_model_dir_that_is_missing_or_not_a_model(capsys, tmp_path, dirs):
    err = refused(capsys, str(tmp_path / "nope"), "--port", "0")
    assert err.startswith("error: MODEL_DIR ") and "nothing at that path" in err and err.count("\n") == 1
    err = refused(capsys, str(dirs["empty"]), "--port", "0")
    assert "without config.json" in err


@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--max-batch-size", "0"], "--max-batch-size"),
    (["--port-file", "/no/such/dir/port"], "--port-file"),
])
def test_bad_options(capsys, dirs, argv, says):
    assert says in refused(capsys, str(dirs["base"]), *argv)


@pytest.mark.parametrize("argv", [["--flavor", "tgi"], ["--port", "eighty"], ["--bogus"]])
def test_bad_flags_are_usage_errors(capsys, dirs, argv):
    assert "usage:" in refused(capsys, str(dirs["base"]), *argv)


def test_a_port_that_is_taken(capsys, dirs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refused(capsys, str(dirs["base"]), "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port 0" in err
