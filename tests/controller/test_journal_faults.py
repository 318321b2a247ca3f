"""Faults of the journal and the row log under a live run (`../shared/findings/
hostile-inputs-2.md`, part D, and issue 30's "durability errors are never ignored"): a
failed fsync of a journal or row segment stops the run with exit 5 wherever it happens,
the last flush included, and is never retried; a journal or row log removed under the live
run stops it before a checkpoint that names what is gone is published (D4); a read-only
journal/ or rows/ is refused before anything is written (D10).

Faults are injected two ways: strace's syscall injection on the real command line (the
exact fsync of one file fails with EIO, `when=1` counting per thread), and, where strace
cannot ptrace here, the same failure from the filesystem seam in a forked child."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hostile import main_child, rollkeep, train_args, tree

from rollkeep.controller import journaling
from rollkeep.controller.journaling import JournalThread
from rollkeep.core.errors import FilesystemError
from rollkeep.core.io.fs import FS, OSAppendFile
from rollkeep.core.journal.groupcommit import GroupCommit
from rollkeep.core.journal.segments import segment_name
from rollkeep.core.rollout.rowstore import RowStore
from rollkeep.trace import read_trace

pytestmark = pytest.mark.slow

JOURNAL_SEGMENT = "journal/" + segment_name(1)  # a fresh run's first segment
ROW_SEGMENT = "rows/00000000.rows"
# No flush but the last: the thread's tick never comes and no checkpoint is cut, so the one
# fsync of each segment is the final flush of `close()` (a SIGTERM stop without a final checkpoint).
LAST_FLUSH_ONLY = ["journal.flush_ms=10000", "journal.flush_events=100000000", "checkpoint.every_steps=1000",
                   "checkpoint.on_shutdown=false", "train.total_steps=50"]
STOP_AT_STEP_2 = {"ROLLKEEP_CRASH_AT": "ledger.step_committed:2", "ROLLKEEP_CRASH_SIGNAL": "TERM"}


def _strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    return subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"], capture_output=True).returncode == 0


needs_strace = pytest.mark.skipif(not _strace_works(), reason="strace cannot ptrace here (the forked-child "
                                  "tests below inject the same faults from the filesystem seam)")


def traced(run_dir: Path, target: str, *overrides: str, env_extra: dict[str, str] | None = None):
    """`rollkeep train` under strace: the first fsync of RUN_DIR/`target` on each thread
    fails with EIO. Returns (the process, the fsyncs of `target` strace saw)."""
    log = run_dir.parent / f"{run_dir.name}.strace"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLKEEP_CRASH")} | (env_extra or {})
    proc = subprocess.run(
        ["strace", "-f", "-qq", "-y", "-o", str(log), "-e", "trace=fsync", "-e", "inject=fsync:error=EIO:when=1",
         "-P", str(run_dir / target), sys.executable, "-m", "rollkeep", *train_args(run_dir, *overrides)],
        capture_output=True, text=True, timeout=120, env=env)
    return proc, [line for line in log.read_text().splitlines() if "fsync(" in line]


def one_paragraph(err: str) -> str:
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


def events(run_dir: Path) -> list[str]:
    return [x["event"] for x in read_trace(run_dir / "trace.jsonl")[0]]


# ---------------------------------------------------------------- durability errors


@needs_strace
@pytest.mark.parametrize("target, names", [(JOURNAL_SEGMENT, ("writing the journal", "journal")),
                                           (ROW_SEGMENT, ("writing the row log", "rows"))])
def test_an_eio_from_the_fsync_of_a_journal_or_row_segment_stops_the_run_with_exit_5(tmp_path, target, names):
    run = tmp_path / "run"
    proc, fsyncs = traced(run, target)
    assert any("(INJECTED)" in line for line in fsyncs), fsyncs
    assert proc.returncode == 5, proc.stderr
    doing, directory = names
    err = one_paragraph(proc.stderr)
    assert f"the filesystem failed while {doing}. File: {run / directory}." in err, err
    assert "run_finished" not in events(run) and "run_failed" in events(run)
    # Never retried: the failed fsync is the last one of that file (the writer is unusable).
    assert "(INJECTED)" in fsyncs[-1], fsyncs
    # What was durable before stands: the same command resumes and finishes, exactly once.
    again = rollkeep(*train_args(run))
    assert again.returncode == 0, again.stderr
    assert rollkeep("audit", str(run)).returncode == 0


@needs_strace
@pytest.mark.parametrize("target, doing", [(JOURNAL_SEGMENT, "writing the journal"),
                                           (ROW_SEGMENT, "writing the row log")])
def test_an_eio_in_the_last_flush_is_exit_5_not_a_finished_run(tmp_path, target, doing):
    """The only fsync of the segment is the last flush, at the run's end (the thread's final
    cycle, woken by `close()`): no event follows it for the loop to see it by. It used to be
    dropped: the run said it finished and exited 0 (then 143 here, a SIGTERM stop)."""
    run = tmp_path / "run"
    proc, fsyncs = traced(run, target, *LAST_FLUSH_ONLY, env_extra=STOP_AT_STEP_2)
    assert len(fsyncs) == 1 and "(INJECTED)" in fsyncs[0], fsyncs  # the last flush, and only it
    assert proc.returncode == 5, proc.stderr
    assert f"the filesystem failed while {doing}." in one_paragraph(proc.stderr)
    assert "run_finished" not in events(run) and "run_failed" in events(run)
    assert "stopped at step" not in proc.stdout  # no summary says the run ended well


def _failing_fsync(monkeypatch, part: str, when) -> None:
    """Every fsync of an open file under RUN_DIR/`part` fails with EIO once `when()` holds
    (patched before `main_child` forks: the child inherits it)."""
    real = OSAppendFile.fsync

    def fsync(self):
        if f"/{part}/" in os.readlink(f"/proc/self/fd/{self._fd}") and when():
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(self)

    monkeypatch.setattr(OSAppendFile, "fsync", fsync)


@pytest.mark.parametrize("part, doing", [("journal", "writing the journal"), ("rows", "writing the row log")])
def test_a_failed_last_flush_from_the_filesystem_seam_is_exit_5(tmp_path, monkeypatch, part, doing, capfd):
    """The same fault without strace: the fsyncs of `part` fail once `close()` began, in
    the same SIGTERM stop with no flush before the last."""
    closing = []
    real_close = JournalThread.close
    monkeypatch.setattr(JournalThread, "close", lambda self, **kw: (closing.append(1), real_close(self, **kw))[1])
    _failing_fsync(monkeypatch, part, lambda: bool(closing))
    monkeypatch.setenv("ROLLKEEP_CRASH_SIGNAL", "TERM")
    run = tmp_path / "run"
    code = main_child(train_args(run, *LAST_FLUSH_ONLY), crash_at="ledger.step_committed:2")
    err = capfd.readouterr().err
    assert code == 5, err
    assert f"the filesystem failed while {doing}." in one_paragraph(err)
    assert "run_finished" not in events(run)
    assert rollkeep(*train_args(run, "train.total_steps=6")).returncode == 0
    assert rollkeep("audit", str(run)).returncode == 0


class _FailOnce(FS):
    """The first fsync of an open journal segment fails; every fsync is counted."""

    def __init__(self) -> None:
        self.fsyncs = 0

    def open_append(self, path):
        f, fs = super().open_append(path), self

        class Counted:
            def __getattr__(self, name):
                return getattr(f, name)

            def fsync(self):
                fs.fsyncs += 1
                if fs.fsyncs == 1:
                    raise OSError(errno.EIO, "Input/output error (injected)")
                f.fsync()

        return Counted()


def test_a_failed_fsync_is_never_retried_and_every_later_sync_raises_it(tmp_path):
    """The writer is unusable after a failed fsync (the kernel may have dropped the pages):
    the thread's cycle fails, then the checkpoint's sync and `close()` raise the same error
    without touching the disk again; the run was never told, so `close()` raises it."""
    fs = _FailOnce()
    j = GroupCommit(tmp_path, next_seq=1, rows=RowStore(), flush_ms=10, flush_events=1, fs=fs)
    j.restart(0)
    j.release()
    with pytest.raises(FilesystemError, match="writing the journal") as first:
        j.cycle()
    j.fail(first.value)  # what the thread does with it
    for _ in range(3):
        with pytest.raises(FilesystemError) as again:
            j.sync()
        assert again.value is first.value
    j2 = GroupCommit(tmp_path / "b", next_seq=1, rows=RowStore(), flush_ms=10, flush_events=1, fs=_FailOnce())
    j2.restart(0)
    j2.release()
    with pytest.raises(FilesystemError):
        j2.cycle()
    with pytest.raises(FilesystemError):  # never raised to the run: close() does
        j2.close()
    j2.close()  # again: nothing
    assert fs.fsyncs == 1
    # Reported once (the run is failing of it): close() does not raise it a second time.
    j.close()
    assert fs.fsyncs == 1


# ---------------------------------------------------------------- D4


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    waited = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if path.exists():
            return
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {path} appeared"
        waited.wait(0.01)  # polling a file another process writes
    raise AssertionError(f"{path} did not appear within {timeout} s")


D4_RUN = ["data.epochs=1", "data.generated.n_rows=512", "train.total_steps=40", "checkpoint.every_steps=4",
          "checkpoint.keep_last=10", "trainer.step_sleep_ms=60", "engine.latency_ms=20"]


@pytest.mark.parametrize("part", ["rows", "journal"])
def test_D4_a_row_log_or_journal_removed_under_a_live_run_stops_it_before_the_next_checkpoint(tmp_path, part):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLKEEP_CRASH")}
    proc = subprocess.Popen([sys.executable, "-m", "rollkeep", *train_args(run, *D4_RUN)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(run / "checkpoints" / "LATEST", proc)
        first = (run / "checkpoints" / "LATEST").read_text().strip()
        published = sorted(p.name for p in (run / "checkpoints").iterdir())
        shutil.rmtree(run / part)
        assert proc.poll() is None, "the run ended before the removal: make it longer"
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 5, err
    assert f"RUN_DIR/{part} was removed under the live run. File: {run / part}." in one_paragraph(err)
    # Nothing was published after the removal: every checkpoint there names what is gone.
    assert (run / "checkpoints" / "LATEST").read_text().strip() == first
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == published
    assert "run_finished" not in events(run)
    audit = rollkeep("audit", str(run))
    if part == "journal":
        # The checkpoint counts on the journal that was removed: audit says so, and the
        # remedy it prints (resume from the checkpoint alone) works, exactly once.
        assert audit.returncode == 3 and "the journal is missing but the checkpoint counts on it" in audit.stderr
        again = rollkeep(*train_args(run, *D4_RUN, "journal.enabled=false"), timeout=120)
        assert again.returncode == 0, again.stderr
        assert rollkeep("audit", str(run)).returncode == 0
    else:
        # A fresh journaled run's checkpoint names its rows in the row log (it copies none):
        # if it names any, audit refuses it, naming the missing segment, as the stop said it might.
        named = json.loads((run / "checkpoints" / first / "MANIFEST.json").read_text())["rows"]["segments"]
        if named:
            assert audit.returncode == 3 and "Row segment 0 is missing" in audit.stderr, audit.stderr
        else:
            assert audit.returncode == 0, audit.stderr


def test_D4_a_removed_row_segment_is_named(tmp_path):
    """One segment removed (not the whole directory) is found by the listing before a
    checkpoint is published, and named."""
    seg = tmp_path / "rows" / "00000000.rows"
    seg.parent.mkdir()
    seg.write_bytes(b"")  # a segment an earlier process left: the new writer goes on at 1
    j = GroupCommit(tmp_path, next_seq=1, rows=RowStore(), flush_ms=10, flush_events=1)
    j.restart(0)
    j.release()
    seg.unlink()
    with pytest.raises(FilesystemError, match=r"rows/00000000.rows was removed under the live run"):
        with j.covering((1, 1), None):
            raise AssertionError("published")
    j.close()  # raised to the run already: not again


# ---------------------------------------------------------------- D10


@pytest.fixture(scope="module")
def tail(tmp_path_factory) -> Path:
    """A run stopped at step 8 with no final checkpoint: LATEST step_000006 and a journal
    tail after it, which a resume replays."""
    run = tmp_path_factory.mktemp("tail") / "run"
    proc = rollkeep(*train_args(run, "train.total_steps=14", "checkpoint.every_steps=3",
                                "checkpoint.on_shutdown=false"),
                    env_extra={"ROLLKEEP_CRASH_AT": "ledger.step_committed:8", "ROLLKEEP_CRASH_SIGNAL": "TERM"})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step_000006"
    return run


def _resume_args(run: Path) -> list[str]:
    return train_args(run, "train.total_steps=14", "checkpoint.every_steps=3")


def _bind_read_only(path: Path) -> bool:
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
        return False
    if subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", str(path)], check=True)
        return False
    return True


@pytest.mark.parametrize("part", ["journal", "rows"])
def test_D10_a_read_only_journal_or_rows_bind_mount_is_refused_before_anything_is_written(tmp_path, tail, part):
    run = tmp_path / "run"
    shutil.copytree(tail, run, symlinks=True)
    if not _bind_read_only(run / part):
        pytest.skip("needs root and bind mounts (the seam test below covers the same refusal)")
    try:
        before = tree(run)
        proc = rollkeep(*_resume_args(run))
        after = tree(run)
    finally:
        subprocess.run(["umount", str(run / part)], check=True)
    assert proc.returncode == 5, proc.stderr
    assert f"RUN_DIR/{part} is not writable; nothing was changed. File: {run / part}." in one_paragraph(proc.stderr)
    assert "Read-only file system" in proc.stderr
    assert after == before, "the refusal changed the run directory (trace, metrics, config history, a segment)"
    # Once writable, the same command resumes.
    assert rollkeep(*_resume_args(run)).returncode == 0


@pytest.mark.parametrize("part", ["journal", "rows"])
def test_D10_an_unwritable_journal_or_rows_from_the_filesystem_seam_changes_nothing(tmp_path, tail, part,
                                                                                    monkeypatch, capfd):
    """The same refusal where mounts are not possible: the seam says the directory takes
    no new file (EACCES, as for a non-root user without write permission)."""
    run = tmp_path / "run"
    shutil.copytree(tail, run, symlinks=True)
    real = FS.check_writable

    def check_writable(self, path):
        if Path(path) == run / part:
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real(self, path)

    monkeypatch.setattr(FS, "check_writable", check_writable)
    before = tree(run)
    code = main_child(_resume_args(run))
    err = capfd.readouterr().err
    assert code == 5, err
    assert f"RUN_DIR/{part} is not writable; nothing was changed" in one_paragraph(err)
    assert tree(run) == before


def test_D10_the_probe_leaves_nothing_behind(tmp_path):
    """`check_writable` creates an unnamed file: the journal directory, whose reader
    refuses anything but segments, is left as it was."""
    (tmp_path / "journal").mkdir()
    (tmp_path / "rows").mkdir()
    before = tree(tmp_path)
    journaling.check_writable(tmp_path)
    assert tree(tmp_path) == before
    assert json.dumps(sorted(os.listdir(tmp_path / "journal"))) == "[]"
