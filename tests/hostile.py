"""Helpers of the hostile-input tests: the real command line, a tree digest that shows a
refusal changed nothing, and a forger who recomputes a manifest's hashes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from run_harness import DEFAULTS, FAST

from rollkeep.cli import main
from rollkeep.core.checkpoint.store import _encode_manifest


def rollkeep(*args: str, timeout: float = 60, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real command line in a subprocess (a hang is a failed test, not a stuck suite)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLKEEP_CRASH")} | (env_extra or {})
    return subprocess.run([sys.executable, "-m", "rollkeep", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def train_args(run_dir: Path, *overrides: str) -> list[str]:
    return ["train", DEFAULTS, *FAST, f"run_dir={run_dir}", *overrides]


def tree(root: Path) -> str:
    """Names, types, link targets and bytes of everything under `root`."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(f"{p.relative_to(root)}|{p.lstat().st_mode}".encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def refused(capsys, code: int, args: list[str], expected: int) -> str:
    """Run `rollkeep ARGS` in-process; it must exit `expected` with one error paragraph."""
    capsys.readouterr()
    assert code == expected or main(args) == expected
    err = capsys.readouterr().err
    assert one_paragraph(err), err
    return err


def one_paragraph(err: str) -> bool:
    """An error as `rollkeep` prints one: `error: ...`, no traceback, no blank line (a list of
    problems is one `  - ...` line each)."""
    return err.startswith("error: ") and "Traceback" not in err and "\n\n" not in err.strip() and err.endswith("\n")


def refuses(capsys, args: list[str], expected: int, root: Path) -> str:
    before = tree(root)
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    assert code == expected, err
    assert one_paragraph(err), err
    assert tree(root) == before, "a refusal changed the run directory"
    return err


def rehash(ck: Path) -> None:
    """Recompute MANIFEST.json for the files now in `ck`, as a forger would."""
    m = json.loads((ck / "MANIFEST.json").read_text())
    m["files"] = {
        str(p.relative_to(ck)): {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(ck.rglob("*")) if p.is_file() and p.name != "MANIFEST.json"
    }
    m.pop("manifest_sha256")
    (ck / "MANIFEST.json").write_bytes(_encode_manifest(m))


def edit_manifest(ck: Path, **fields) -> None:
    m = json.loads((ck / "MANIFEST.json").read_text())
    m.update(fields)
    m.pop("manifest_sha256")
    (ck / "MANIFEST.json").write_bytes(_encode_manifest(m))




def main_child(args: list[str], crash_at: str | None = None) -> int:
    """`rollkeep ARGS` (in-process `main`) in a forked child that `ROLLKEEP_CRASH_AT` can
    SIGKILL: its wait status as a negative signal number or its exit code."""
    import signal
    import traceback

    from rollkeep.core import crashpoints

    pid = os.fork()
    if pid == 0:
        code = 1
        signal.alarm(120)
        try:
            os.environ.pop("ROLLKEEP_CRASH_AT", None)
            if crash_at is not None:
                os.environ["ROLLKEEP_CRASH_AT"] = crash_at
            crashpoints._reload_from_env()
            code = main(args)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
