"""The `rollkeep` command line.

Each subcommand is a small module in this package exposing `add_parser(subparsers)` and
`run(args) -> int`. Only the module of the subcommand being run is imported, so
`rollkeep inspect` never pays for torch, and a subcommand whose module is not written yet
answers "not available yet" instead of breaking the others.

Errors: a `RollkeepError` escaping a subcommand is printed as one paragraph on stderr,
`error: <what, file, field, expected, found, what to do>` (one line, or one line per
problem when it lists problems), with no traceback, and its class
picks the exit code (`EXIT_CODES`, listed in `rollkeep --help`).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from rollkeep.core.errors import (
    CheckpointError,
    CustodyError,
    ExternalError,
    RollkeepError,
    UserInputError,
)
from rollkeep.version import rollkeep_version

__all__ = ["ALIASES", "COMMANDS", "EXIT_CODES", "exit_code", "main"]

#: Exit code per error class, most specific first. 0 is success; 1 is reserved for
#: crashes (an uncaught exception other than these); 130 is Ctrl-C.
EXIT_CODES: tuple[tuple[type[RollkeepError], int], ...] = (
    (UserInputError, 2),
    (CheckpointError, 3),
    (CustodyError, 4),
    (ExternalError, 5),
)
EXIT_UNAVAILABLE = 2  # a subcommand whose module does not exist yet

# Subcommand -> one-line help. The order is the order of `rollkeep --help`.
COMMANDS: dict[str, str] = {
    "train": "run or resume a training job (resumes from RUN_DIR/checkpoints/LATEST)",
    "inspect": "show what a checkpoint holds and what a restore from it would do (read-only)",
    "audit": "verify checkpoints: files, schemas, ledger, custody audit, rows (read-only)",
    "report": "report reused, regenerated and lost work per restart of a run (RUN_DIR/report/)",
    "chaos": "kill/resume torture run with a pass/fail report",
    "simulate": "deterministic simulation of whole runs with crashes and disk faults",
    "bench": "benchmarks of the custody core",
    "export": "write the trained built-in model as a Hugging Face model directory",
    "serve": "serve a local model over HTTP with vLLM or SGLang routes (server mode)",
}

#: Other names of a subcommand: `rollkeep trace` is `rollkeep report` (its first name).
ALIASES: dict[str, str] = {"trace": "report"}

_EPILOG = """\
exit codes:
  0  success
  1  crash (a bug: please report the traceback)
  2  bad input: command line, config or dataset (UserInputError), a subcommand
     that is not available yet, or user code that stopped the run (a reward
     function or environment raising SystemExit/KeyboardInterrupt, too many of its
     calls hung at once, a custom trainer whose save() fails), after its final
     checkpoint
  3  a checkpoint is missing, corrupt, torn or does not match this run (CheckpointError)
  4  a custody rule would be broken: a bug in rollkeep or its caller (CustodyError)
  5  something outside rollkeep failed: engine, filesystem (a full or read-only disk, a
     failed fsync), every engine replica gone, prompts run out to failures (ExternalError)
  130, 143  `train` stopped by SIGINT / SIGTERM after its final checkpoint: requeue it,
     the same command resumes (0 means training finished or its data ran out)

examples:
  rollkeep train config.yaml
  rollkeep inspect runs/a
  rollkeep audit --all runs/a/checkpoints
  rollkeep report runs/a
  rollkeep export runs/a --out models/a
  rollkeep serve models/a --port 8101
  rollkeep <command> --help
"""


def exit_code(err: RollkeepError) -> int:
    """The exit code for an error, by its class (see `EXIT_CODES`)."""
    for cls, code in EXIT_CODES:
        if isinstance(err, cls):
            return code
    return 1


def error_paragraph(err: RollkeepError) -> str:
    """`str(err)` as one paragraph: what, file, field, expected, found, what to do. An
    error that lists several problems (`  - ...` lines, e.g. a config with many mistakes)
    keeps one line per problem (even when it lists one); everything else is joined into
    one line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    listed = [line for line in lines if line.startswith("- ")]
    if not listed:
        return " ".join(lines)
    out: list[str] = []
    for line in lines:
        if line.startswith("- "):
            out.append("  " + line)
        elif out and not out[-1].startswith("  - "):
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n".join(out)


def print_error(err: RollkeepError) -> None:
    print(f"error: {error_paragraph(err)}", file=sys.stderr)


def _load(name: str) -> ModuleType | None:
    """The module of subcommand `name`, or None if it does not exist yet. A module that
    exists but needs a package that is not installed is the user's to fix (exit 2)."""
    modname = f"{__name__}.{name}"
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name == modname:
            return None
        missing = (e.name or "?").split(".")[0]
        raise UserInputError(
            f"`rollkeep {name}` needs the Python package {missing!r}, which is not installed",
            expected=f"{missing} importable",
            found=str(e),
            remedy="install the extra that provides it, e.g. pip install 'rollkeep[torch]' "
            "(see the optional dependencies in pyproject.toml)",
        ) from e


class _VersionAction(argparse.Action):
    """`--version`, which reads the package metadata only when asked (see
    `rollkeep_version`)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show program's version number and exit"):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"rollkeep {rollkeep_version()}")  # stdout, as argparse's own version action
        parser.exit()


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The top-level parser. Only `command`'s module is imported and builds its own
    subparser; the others appear in `--help` with their one-line summary."""
    parser = argparse.ArgumentParser(
        prog="rollkeep",
        description="Exactly-once prompt custody and kill-anywhere resume for asynchronous "
        "RL post-training.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        module = _load(name) if name == command else None
        if module is None:
            aliases = [a for a, of in ALIASES.items() if of == name]
            sub.add_parser(name, help=summary, description=summary, aliases=aliases)
            continue
        made = module.add_parser(sub)
        p = made if isinstance(made, argparse.ArgumentParser) else sub.choices[name]
        p.set_defaults(run=module.run)
    return parser


def _exit_status(code: object) -> int:
    """The int a SystemExit carries (argparse exits 0 for --help, 2 for a usage error)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `rollkeep` command line and return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The top level has only options that stop (--help, --version), so the first
    # non-option word is the subcommand.
    command = next((a for a in argv if not a.startswith("-")), None)
    command = ALIASES.get(command, command)
    try:
        if command in COMMANDS and _load(command) is None:
            print(f"rollkeep {command}: not available yet", file=sys.stderr)
            return EXIT_UNAVAILABLE
        parser = build_parser(command)
        try:
            args, extra = parser.parse_known_args(argv)
            # `key=value` overrides may follow options (`chaos cfg.yaml --kills 4 seed=3`);
            # argparse stops collecting positionals at the first option, so gather the rest.
            overrides = [a for a in extra if "=" in a and not a.startswith("-")]
            if len(overrides) != len(extra) or (overrides and not hasattr(args, "overrides")):
                parser.error("unrecognized arguments: " + " ".join(extra))
            if overrides:
                args.overrides.extend(overrides)
        except SystemExit as e:
            return _exit_status(e.code)
        if getattr(args, "run", None) is None:
            parser.print_help(sys.stderr)
            return 2
        return int(args.run(args))
    except RollkeepError as err:
        print_error(err)
        return exit_code(err)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `rollkeep inspect PATH | head`: the reader left early. Point stdout at /dev/null
        # so the interpreter's final flush does not fail again, and exit like SIGPIPE does.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass
        return 141
