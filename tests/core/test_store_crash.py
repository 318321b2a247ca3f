"""Crash recovery of checkpoint publication, tested the way SQLite tests its commit:

(a) a real process publishing a checkpoint is SIGKILLed at every named crash point
    (`rollkeep.core.crashpoints`), then the parent restores: LATEST names the old or the
    new checkpoint, never a torn one, with exactly one of the two contents; and
    `cleanup_tmp()` removes exactly the leftovers;
(b) in process, the n-th write / fsync / rename / mkdir of one publication fails with
    OSError, for every n: the old checkpoint stays published and the directory is left as
    it was found (or, when the failure comes after the commit point, the new one is
    published).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollkeep.core import crashpoints
from rollkeep.core.checkpoint.store import FS, LATEST, CheckpointStore

FILE_NAMES = (
    "ledger.msgpack",
    "rows.safetensors",
    "trainer/model.safetensors",
    "trainer/optim.bin",
)
SRC = str(Path(crashpoints.__file__).resolve().parents[2])  # the dir holding rollkeep/
SIGKILLED = -signal.SIGKILL


def files_for(step: int, tag: str = "") -> dict[str, bytes]:
    return {
        rel: b"".join(
            hashlib.sha256(f"{rel}|{step}|{tag}|{i}".encode()).digest() for i in range(1 + 40 * k)
        )
        for k, rel in enumerate(FILE_NAMES)
    }


def tree(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = "file:" + hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def contents(store: CheckpointStore) -> tuple[str, dict[str, bytes]]:
    """Open what LATEST names (restore steps 1-3) and read every file."""
    ck = store.open()
    assert ck.files() == sorted(FILE_NAMES)
    return ck.name, {rel: ck.read(rel) for rel in FILE_NAMES}


def leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".tmp-" in n)


def base_store(tmp_path: Path) -> CheckpointStore:
    """Steps 1 and 2 published; LATEST names step_000002."""
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    for s in (1, 2):
        store.publish(s, files_for(s), {}, keep_last=None)
    return store


# -- crashpoints -------------------------------------------------------------------------

CHILD = r"""
import json, sys
from pathlib import Path
from rollkeep.core.checkpoint.store import CheckpointStore
root, step, tag, keep = sys.argv[1:5]
files = {k: bytes.fromhex(v) for k, v in json.loads(sys.stdin.read()).items()}
CheckpointStore(Path(root)).publish(int(step), files, {"tag": tag}, keep_last=int(keep))
print("survived", flush=True)
"""


def run_child(
    code: str, args: list[str], crash_at: str | None, stdin: str = ""
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(crashpoints.ENV_VAR, None)
    if crash_at is not None:
        env[crashpoints.ENV_VAR] = crash_at
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def publish_in_child(
    store: CheckpointStore, step: int, tag: str, crash_at: str | None, keep_last=1
):
    files = {k: v.hex() for k, v in files_for(step, tag).items()}
    proc = run_child(
        CHILD, [str(store.root), str(step), tag, str(keep_last)], crash_at, json.dumps(files)
    )
    return proc


def test_publication_points_are_registered():
    assert set(crashpoints.PUBLISH_POINTS) <= crashpoints.POINTS
    assert len(crashpoints.PUBLISH_POINTS) == 6
    with pytest.raises(ValueError):
        crashpoints.register("bad:name")


@pytest.mark.parametrize(
    "value, parsed",
    [(None, None), ("", None), ("a.b", ("a.b", 1)), ("a.b:1", ("a.b", 1)), ("a.b:12", ("a.b", 12))],
)
def test_crash_at_parsing(value, parsed):
    assert crashpoints._parse(value) == parsed


@pytest.mark.parametrize("value", ["a:0", "a:-1", "a:x", ":3", "a:"])
def test_crash_at_parsing_rejects(value):
    with pytest.raises(ValueError):
        crashpoints._parse(value)


def test_hit_is_a_no_op_unless_targeted(monkeypatch):
    monkeypatch.delenv(crashpoints.ENV_VAR, raising=False)
    crashpoints._reload_from_env()
    for _ in range(3):
        crashpoints.hit("publish.file_written")
    monkeypatch.setenv(crashpoints.ENV_VAR, "some.other.point:2")
    crashpoints._reload_from_env()
    try:
        for _ in range(3):
            crashpoints.hit("publish.file_written")  # not the target: survives
    finally:
        monkeypatch.delenv(crashpoints.ENV_VAR)
        crashpoints._reload_from_env()


def test_hit_kills_at_the_nth_call():
    code = (
        "from rollkeep.core import crashpoints\n"
        "for i in range(1, 6):\n"
        "    crashpoints.hit('other')\n"
        "    print(i, flush=True)\n"
        "    crashpoints.hit('test.point')\n"
    )
    proc = run_child(code, [], "test.point:3")
    assert proc.returncode == SIGKILLED
    assert proc.stdout.split() == ["1", "2", "3"]
    proc = run_child(code, [], "test.point")
    assert proc.returncode == SIGKILLED and proc.stdout.split() == ["1"]
    proc = run_child(code, [], None)
    assert proc.returncode == 0 and proc.stdout.split() == ["1", "2", "3", "4", "5"]


# -- (a) SIGKILL at every crash point ----------------------------------------------------

# Publishing step 3 with keep_last=1 over steps 1 and 2: four files, and retention deletes
# two checkpoints, so every point and every repetition of it is reached.
# point -> (published afterwards, leftovers cleanup_tmp must report, unpublished step_000003)
CRASHES = {
    "publish.file_written:1": ("old", ["step_000003.tmp-"], False),
    "publish.file_written:2": ("old", ["step_000003.tmp-"], False),
    "publish.file_written:4": ("old", ["step_000003.tmp-"], False),
    "publish.manifest_written": ("old", ["step_000003.tmp-"], False),
    "publish.dir_renamed": ("old", [], True),
    "publish.latest_written": ("old", ["LATEST.tmp-"], True),
    "publish.latest_replaced": ("new", [], False),
    "publish.retention:1": ("new", ["step_000001.tmp-"], False),
    "publish.retention:2": ("new", ["step_000002.tmp-"], False),
}


def test_every_publication_point_is_crashed_here():
    assert {c.split(":")[0] for c in CRASHES} == set(crashpoints.PUBLISH_POINTS)


@pytest.mark.parametrize("crash_at", CRASHES)
def test_sigkill_at_every_crash_point(tmp_path, crash_at):
    outcome, expect_left, unpublished = CRASHES[crash_at]
    store = base_store(tmp_path)
    old = contents(store)

    proc = publish_in_child(store, 3, "first", crash_at)
    assert proc.returncode == SIGKILLED, proc.stderr
    assert "survived" not in proc.stdout

    # Restore right after the crash, before any cleanup: all or nothing.
    got = contents(store)
    new = ("step_000003", files_for(3, "first"))
    assert got == (old if outcome == "old" else new)
    assert ("step_000003" in store.list()) == (unpublished or outcome == "new")

    # Start-up cleanup reports exactly the leftovers, and changes nothing published.
    left = store.cleanup_tmp()
    assert [n.split("tmp-")[0] + "tmp-" for n in left] == expect_left
    assert leftovers(store.root) == []
    assert contents(store) == got

    # The resumed run publishes step 3 again (moving an unpublished step_000003 aside).
    if outcome == "old":
        store.publish(3, files_for(3, "second"), {}, keep_last=1)
        assert contents(store) == ("step_000003", files_for(3, "second"))
    else:
        store.publish(4, files_for(4), {}, keep_last=1)
    assert len(store.list()) == 1 and leftovers(store.root) == []


@pytest.mark.parametrize(
    "crash_at", [c for c, v in CRASHES.items() if v[0] == "old"] + ["publish.latest_replaced"]
)
def test_sigkill_while_republishing_over_a_leftover(tmp_path, crash_at):
    """A first crash leaves an unpublished step_000003 and a LATEST.tmp (no cleanup);
    the republication of step 3 is then killed at each point in turn. The first
    attempt's content is never published; the old or the second attempt's is."""
    store = base_store(tmp_path)
    old = contents(store)
    assert publish_in_child(store, 3, "first", "publish.latest_written").returncode == SIGKILLED

    proc = publish_in_child(store, 3, "second", crash_at)
    assert proc.returncode == SIGKILLED, proc.stderr
    got = contents(store)
    expected = (
        old
        if CRASHES.get(crash_at, ("new",))[0] == "old"
        else ("step_000003", files_for(3, "second"))
    )
    assert got == expected

    store.cleanup_tmp()
    assert leftovers(store.root) == []
    assert contents(store) == got


def test_publish_survives_without_crash_point(tmp_path):
    store = base_store(tmp_path)
    proc = publish_in_child(store, 3, "first", None)
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr
    assert contents(store) == ("step_000003", files_for(3, "first"))
    assert store.list() == ["step_000003"]


# -- (b) the n-th write / fsync / rename / mkdir fails -----------------------------------

KINDS = ("write", "fsync", "rename", "mkdir")


class FaultyFS(FS):
    """Counts calls by kind; the `fail_at`-th call of `kind` raises OSError(EIO), and with
    `sticky` so does every later call of that kind (a disk that died)."""

    def __init__(self, kind: str | None = None, fail_at: int = 0, sticky: bool = False):
        self.kind, self.fail_at, self.sticky = kind, fail_at, sticky
        self.calls = dict.fromkeys((*KINDS, "rmtree", "unlink"), 0)
        self.committed = False
        self.failed = False

    def _enter(self, kind: str) -> None:
        self.calls[kind] += 1
        n = self.calls[kind]
        if kind == self.kind and (n == self.fail_at or (self.sticky and n > self.fail_at)):
            self.failed = True
            raise OSError(5, f"injected failure of {kind} #{n}")

    def mkdir(self, path):
        self._enter("mkdir")
        super().mkdir(path)

    def write(self, path, data):
        self._enter("write")
        super().write(path, data)

    def fsync(self, path):
        # Counted and failed on purpose, but not performed: what an fsync makes durable
        # cannot be observed without pulling the power, and skipping it keeps this fast.
        self._enter("fsync")

    def rename(self, src, dst):
        self._enter("rename")
        super().rename(src, dst)
        if Path(dst).name == LATEST:
            self.committed = True

    def rmtree(self, path):
        self._enter("rmtree")
        super().rmtree(path)

    def unlink(self, path):
        self._enter("unlink")
        super().unlink(path)


def scenario(tmp_path: Path, leftover: bool) -> Path:
    """A template `checkpoints/` to copy for each case: steps 1 and 2 published and, with
    `leftover`, a complete but unpublished step_000003 (a crash between P6 and P8), which
    P5 then moves aside."""
    store = base_store(tmp_path / "template")
    if leftover:
        shutil.copytree(store.root / "step_000002", store.root / "step_000003")
        (store.root / "step_000003" / "junk").write_bytes(b"from the first attempt")
    return store.root


def count_calls(template: Path, tmp_path: Path) -> dict[str, int]:
    root = tmp_path / "count" / "checkpoints"
    shutil.copytree(template, root)
    fs = FaultyFS()
    CheckpointStore(root, fs=fs).publish(3, files_for(3, "new"), {}, keep_last=1)
    return fs.calls


@pytest.mark.parametrize("leftover", [False, True], ids=["clean", "leftover"])
@pytest.mark.parametrize("kind", KINDS)
def test_nth_call_fails(tmp_path, kind, leftover):
    template = scenario(tmp_path, leftover)
    calls = count_calls(template, tmp_path)
    assert calls["write"] == len(FILE_NAMES) + 2  # files, MANIFEST.json, LATEST.tmp
    assert calls["rename"] == 2 + 2 + leftover  # dir, LATEST, retention x2, aside
    new = ("step_000003", files_for(3, "new"))
    for sticky in (False, True):
        for n in range(1, calls[kind] + 1):
            store = CheckpointStore(tmp_path / f"{kind}-{n}-{sticky}" / "checkpoints")
            shutil.copytree(template, store.root)
            old = contents(store)
            before = tree(store.root)

            fs = FaultyFS(kind, n, sticky)
            with pytest.raises(OSError, match="injected"):
                CheckpointStore(store.root, fs=fs).publish(3, files_for(3, "new"), {}, keep_last=1)
            assert fs.failed

            # Whatever failed, LATEST names a complete checkpoint: the old one before the
            # commit point, the new one after it. Never a torn one.
            got = contents(store)
            assert got == (new if fs.committed else old), (kind, n, sticky)
            if not fs.committed and not sticky:
                # The undo put everything back as it was found.
                assert tree(store.root) == before, (kind, n)
            # Start-up cleanup (on a disk that works again) leaves no trace either way.
            store.cleanup_tmp()
            assert leftovers(store.root) == []
            assert contents(store) == got
            if not fs.committed:
                if not sticky:
                    assert tree(store.root) == before, (kind, n)
                CheckpointStore(store.root, fs=FaultyFS()).publish(
                    3, files_for(3, "new"), {}, keep_last=1
                )
                assert contents(store) == new
                assert store.list() == ["step_000003"]


def test_failure_before_root_exists_leaves_no_checkpoint(tmp_path):
    for kind in ("mkdir", "fsync"):
        root = tmp_path / kind / "run" / "checkpoints"
        with pytest.raises(OSError):
            CheckpointStore(root, fs=FaultyFS(kind, 1)).publish(1, files_for(1), {}, keep_last=1)
        store = CheckpointStore(root)
        assert store.latest() is None
        store.cleanup_tmp()
        store.publish(1, files_for(1), {}, keep_last=1)
        assert contents(store) == ("step_000001", files_for(1))
