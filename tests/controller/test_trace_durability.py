"""The trace's durability rule in the real runner (docs/design.md §8): a checkpoint never
covers a commit the durable trace lacks. Every replacement of LATEST (the commit point)
comes after an fsync of the trace that holds every step the checkpoint covers, and a
failed fsync stops the run before that checkpoint is published."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from run_harness import DEFAULTS, FAST, check, config

from rollkeep.cli import main
from rollkeep.controller import train
from rollkeep.core.checkpoint.store import LATEST
from rollkeep.core.io.fs import FS, OSAppendFile
from rollkeep.trace import parse_trace


def test_every_checkpoint_publication_fsyncs_the_trace_with_its_commits_first(tmp_path, monkeypatch):
    history: list[tuple[str, int, int]] = []  # ("fsync", inode, durable size) | ("latest", step, 0)
    real_fsync, real_rename = OSAppendFile.fsync, FS.rename

    def fsync(self):
        st = os.fstat(self._fd)
        real_fsync(self)
        history.append(("fsync", st.st_ino, st.st_size))

    def rename(self, src, dst):
        if Path(dst).name == LATEST:
            name = Path(src).read_text().strip()  # e.g. step_000004 or step_000004.1
            history.append(("latest", int(name.removeprefix("step_").split(".")[0]), 0))
        real_rename(self, src, dst)

    monkeypatch.setattr(OSAppendFile, "fsync", fsync)
    monkeypatch.setattr(FS, "rename", rename)
    cfg = config(tmp_path / "run")
    train(cfg)

    trace = Path(cfg.run_dir) / "trace.jsonl"
    ino, data = trace.stat().st_ino, trace.read_bytes()
    publications = [i for i, h in enumerate(history) if h[0] == "latest"]
    assert len(publications) >= 6  # 12 steps, a checkpoint every 2
    previous = -1
    for i in publications:
        step = history[i][1]
        syncs = [h for h in history[previous + 1 : i] if h[0] == "fsync" and h[1] == ino]
        assert len(syncs) == 1, f"checkpoint of step {step}: {len(syncs)} trace fsyncs before it"
        durable, _ = parse_trace(data[: syncs[0][2]])
        committed = {x["step"] for x in durable if x["event"] == "step_committed"}
        assert set(range(1, step + 1)) <= committed, f"step {step}'s checkpoint, durable trace {committed}"
        previous = i


def test_a_failed_trace_fsync_stops_the_run_before_that_checkpoint_is_published(tmp_path, monkeypatch, capsys):
    real_fsync, calls = OSAppendFile.fsync, [0]

    def failing(self):
        calls[0] += 1
        if calls[0] == 2:  # the second checkpoint's
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(self)

    monkeypatch.setattr(OSAppendFile, "fsync", failing)
    run = tmp_path / "run"
    # The journal's fsyncs go through the same append files: this test is the trace's.
    args = ["train", DEFAULTS, *FAST, f"run_dir={run}", "journal.enabled=false"]
    assert main(args) == 5
    err = capsys.readouterr().err
    assert "syncing the trace" in err and "trace.jsonl" in err and "Traceback" not in err
    assert (run / "checkpoints" / LATEST).read_text() == "step_000002\n"  # the first one stands
    monkeypatch.undo()
    assert main(args) == 0  # resumes from it, exactly once
    check(config(run))
