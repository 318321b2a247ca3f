"""The checkpoint store: publish a checkpoint atomically, open one read-only and verified.

Layout (docs/design.md §4)::

    RUN_DIR/checkpoints/                  the store's `root`
        LATEST                            "step_000012\\n": the newest published checkpoint
        step_000012/
            MANIFEST.json                 written last; lists every other file
            ledger.msgpack                (the caller's files; names may nest
            trainer/model.safetensors      up to manifest.MAX_DEPTH components)

A checkpoint is *published* when LATEST names it. Nothing else makes it so: a `step_*`
directory that LATEST does not name is a leftover (a publication that crashed before its
commit point, or an older checkpoint kept by retention) and no restore starts from it
unless a person points LATEST at it.


Atomic publication
==================

Written down the way SQLite's "Atomic Commit In SQLite" argues its rollback journal.

Assumptions
-----------

A1. `rename(2)` within one filesystem is atomic: after a crash, a reader finds the old
    name or the new one, never both or neither; renaming a file over an existing file
    replaces the target atomically.
A2. `fsync(2)` of a file makes its contents durable. `fsync(2)` of a directory makes its
    entries (creations, renames, removals) durable. Without fsync, the order in which
    data and names reach the disk is unspecified, and this protocol never relies on it.
A3. The whole `checkpoints/` tree is on one filesystem (temporary names live next to
    their final names, so every rename is within one directory of it).
A4. One writer per `checkpoints/` directory (the controller). Readers (`rollkeep inspect`)
    may run at any time; they never write.
A5. The process can stop between any two system calls (SIGKILL, preemption, power loss).
    Bit rot and hand edits are not prevented; they are detected (sha256 in the manifest,
    the manifest's own checksum) and refused by `open`.
A6. An fsync that returns an error may have lost the data ("fsyncgate"): the publication
    is abandoned, never retried on the same file.

Steps of `publish(step, files, meta, keep_last=...)`
----------------------------------------------------

Let N = `step_000012` (or a revision such as `step_000012.1`), and HEX a fresh random suffix each time one is needed.

P1. Pick the name N (`step_N`, or the next revision when LATEST names a checkpoint of
    the same step: see "Republishing a step"), validate the arguments and build
    MANIFEST.json's fields in memory (sizes, sha256s). Nothing on disk has changed yet; a
    bad argument raises ValueError (TypeError for content that is not bytes).
P2. Create `N.tmp-HEX/` (and its subdirectories). Create `checkpoints/` first if needed;
    fsync its parent (at the first publication of every process, whoever created it).
P3. Write each file and fsync it.                              [crash point publish.file_written]
    Then each directory of `saved` (the trainer's): create `N.tmp-HEX/D/`, call its
    `save(dir)`, which writes files into it (any depth), then walk it without following
    anything: each regular file is hashed (streamed) and fsynced [publish.file_written],
    and listed as `D/<relative path>`; a symlink, FIFO, socket or device, an empty
    directory, an empty `D/` or a name the manifest cannot list raises CheckpointError.
    Then fsync each subdirectory, so the files' names are durable.
P4. Add the saved files to the manifest, compute its checksum; write MANIFEST.json,
    fsync it, fsync `N.tmp-HEX/`.                              [publish.manifest_written]
    The manifest is written last, so a directory with a manifest has all its files.
P5. If a directory N already exists, it is a leftover that LATEST does not name (see
    "Republishing a step" below): rename it aside to `N.tmp-HEX`.
P6. Rename `N.tmp-HEX/` to `N/`, fsync `checkpoints/`.          [publish.dir_renamed]
P7. Write `LATEST.tmp-HEX` containing "N\\n", fsync it.        [publish.latest_written]
P8. **Rename `LATEST.tmp-HEX` over `LATEST`. This is the commit point.** Then fsync
    `checkpoints/` so the commit is durable.                  [publish.latest_replaced]
P9. Delete the directory moved aside in P5. Retention: every `step_*` directory that is
    neither among the `keep_last` newest (by step number) nor named by LATEST is renamed to
    `step_*.tmp-HEX`, `checkpoints/` is fsynced, then the renamed tree is deleted.
                                                  [publish.retention, once per deleted one]

What a crash leaves
-------------------

- Before P8 (in P2-P7): LATEST still names the previous checkpoint, whose directory no
  step touched (P5 moves aside only a directory that LATEST does not name). A restore
  opens the previous checkpoint, or finds a fresh run if there was none. Leftovers:
  `N.tmp-HEX/` (P2-P5, complete or not), the aside `N.tmp-HEX/` (P5-P7), a complete but
  unpublished `N/` (P6-P7), `LATEST.tmp-HEX` (P7). `cleanup_tmp()` removes every
  `*.tmp-*`; an unpublished `N/` stays until the next publication of step N moves it
  aside (P5) or retention deletes it.
- After P8: LATEST names N, whose files and manifest were made durable in P3-P4 and whose
  name was made durable in P6 before LATEST could name it. Power loss after the rename
  but before the fsync of P8 leaves the old LATEST or the new one (A1), and each names a
  complete, durable directory.
- In P9: directories being deleted are first renamed to `*.tmp-*` names, with the rename
  made durable before the first file is removed, so a crash never leaves a half-deleted
  `step_*` directory, only a `*.tmp-*` one for `cleanup_tmp()`.

So at every instant LATEST names a complete checkpoint or does not exist: the old one
before the commit point, the new one after it. Never a torn one. The tests in
`tests/test_store_crash.py` SIGKILL a real process at every crash point above and fail
every n-th write, fsync, rename and mkdir of a publication.

Errors during publication
-------------------------

An OSError (or any exception) before the commit point undoes what this publication did, as
far as it can (best effort: the tmp directory and LATEST.tmp are removed, an unpublished N
it created is removed, a directory moved aside in P5 is moved back), then propagates.
The previous checkpoint stays published. An error after the commit point also propagates,
but the new checkpoint *is* published (`latest()` says so); what remains are leftovers for
`cleanup_tmp()` or checkpoints retention did not get to delete.

Republishing a step
-------------------

A checkpoint of step N is named `step_N`; a later cut of the same step (a run that stops
at the version of its last periodic checkpoint, after drops or sealed work that the
checkpoint does not hold) is the next *revision* `step_N.R` (R = 1, 2, ...). `publish`
picks the name in P1: revision R+1 when LATEST names `step_N.R` (or `step_N`, R = 0),
else `step_N`. So a publication never writes to the name LATEST holds: replacing a
published directory would take two renames (aside, then in), and a crash between them
would leave LATEST naming nothing.

A crash between P6 and P8 leaves a complete directory that LATEST does not name; after the
restart, the run reaches the same name again and publishes it again. P5 renames the old
directory aside before P6 renames the new one in. That is safe because LATEST does not
name the old one: no reader can be sent to it, so the instant at which the name is missing
or refers to the new directory harms nobody. The old directory is deleted only after the
commit point, so until then a failed publication can put it back as it found it.

Resuming from an older checkpoint
---------------------------------

`rollkeep train --resume-from step_K` restores a checkpoint other than LATEST's on
purpose. After the restore chain has passed on it (nothing changed before), `set_aside`
moves every newer checkpoint directory into `abandoned-<UTC time>/` (mkdir, fsync the
store, one rename each, fsync both), then `point_latest` replaces LATEST with `step_K`
(the commit point, as P7-P8). Nothing is deleted, and a later publication of the same
names cannot touch the abandoned ones (they no longer carry those names in the store).
A crash before the commit point leaves LATEST naming a directory that has moved; the same
`--resume-from` command completes it.

Why the manifest checks itself, and LATEST does not
---------------------------------------------------

Every file's sha256 is in MANIFEST.json, and MANIFEST.json carries `manifest_sha256`, the
sha256 of its canonical compact JSON without that key; `open` also requires the file to be
byte-for-byte the canonical form rollkeep writes. So any change to the manifest, down to
one flipped bit in a timestamp, is refused. LATEST carries no checksum: it holds only a
name, and the documented remedy for a bad checkpoint is a person writing an earlier
checkpoint's name into it. A corruption that turns it into the name of another complete,
verified checkpoint is indistinguishable from that edit, and restores a consistent
checkpoint; anything else is refused (LATEST must be exactly `step_NNNNNN` and a newline).


Opening a checkpoint (restore steps 1-3) is `rollkeep.core.checkpoint.manifest`'s: what it checks,
and why the manifest checks itself, is written down there.

"""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollkeep.core import crashpoints
from rollkeep.core.checkpoint.manifest import (
    _NO_SCHEMA_CHECK,
    LATEST,
    MANIFEST,
    MANIFEST_SCHEMA,
    OpenedCheckpoint,
    _decode_json,
    _encode_manifest,
    _is_int,
    _latest_remedy,
    _open_dir,
    _oserror_text,
    _parse_latest,
    _relpath_problem,
    _step_of,
    ancestors,
    checkpoint_name,
    checkpoint_order,
    open_path,
    read_manifest,
)
from rollkeep.core.checkpoint.publication import check_files, manifest_fields, saved_files
from rollkeep.core.errors import CheckpointNotFound
from rollkeep.core.io.fs import DIR, FS

__all__ = [
    "FS",
    "LATEST",
    "MANIFEST",
    "MANIFEST_SCHEMA",
    "CheckpointStore",
    "OpenedCheckpoint",
    "Published",
    "checkpoint_name",
    "checkpoint_order",
    "open_path",
]

_TMP_RE = re.compile(r"(?:step_\d{6,}(?:\.[1-9]\d*)?|LATEST)\.tmp-[0-9a-f]+")
ABANDONED_PREFIX = "abandoned-"


def _tmp_suffix() -> str:
    return ".tmp-" + secrets.token_hex(8)


# -- results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    """What `publish` wrote: `bytes` counts the files and MANIFEST.json; `write_seconds` is
    the wall time of the whole `publish` call."""

    name: str
    path: Path
    bytes: int
    write_seconds: float


# -- the store ---------------------------------------------------------------------------


class CheckpointStore:
    """The `checkpoints/` directory of one run. See the module docstring for the protocol.

    `fs` is the filesystem seam (tests pass one that fails on purpose); the default does
    the real system calls.
    """

    def __init__(self, root: Path, *, fs: FS | None = None) -> None:
        self.root = Path(root)
        self._fs = fs if fs is not None else FS()
        self._root_durable = False  # whether this process has fsynced the root's parent

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.root)!r})"

    # -- writing -------------------------------------------------------------------------

    def publish(
        self,
        step: int,
        files: Mapping[str, bytes],
        meta: Mapping[str, Any],
        *,
        keep_last: int | None,
        saved: Mapping[str, Callable[[Path], None]] | None = None,
        check_saved: Callable[[str, int, Callable[[int], bytes], Callable[[], bytes]], None] | None = None,
    ) -> Published:
        """Publish a checkpoint of `step` holding `files` (relative path -> bytes) and the
        files each `saved[D](dir)` writes into the directory `D/` it is given, with `meta`
        merged into its MANIFEST.json; then keep only the `keep_last` newest checkpoints
        (None keeps all). `check_saved(rel, size, prefix, whole)` is called for every file a
        save wrote (`prefix(n)`: its first n bytes; `whole()`: all of them) and may raise to
        publish nothing. Steps P1-P9 of the module docstring."""
        t0 = time.perf_counter()
        fs, root = self._fs, self.root
        saved = dict(saved or {})

        # P1: validate everything and build the manifest before touching the disk.
        name = self._next_name(step)
        if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        entries = check_files(files)
        tops = {rel.split("/")[0] for rel, _ in entries}
        for d in saved:
            if not isinstance(d, str) or "/" in d or _relpath_problem(d) is not None or d in tops:
                raise ValueError(f"saved directory {d!r}: one path component, not one of the files'")
        fields = manifest_fields(name, step, entries, meta)
        manifest_bytes = _encode_manifest(fields)
        if _encode_manifest(_decode_json(manifest_bytes)) != manifest_bytes:
            raise ValueError("meta does not survive a JSON round trip unchanged")
        subdirs = sorted(ancestors(rel for rel, _ in entries), key=lambda d: (d.count("/"), d))
        final = root / name
        saved_bytes = 0

        self._ensure_root()
        tmp = root / (name + _tmp_suffix())
        made_tmp = False
        aside: Path | None = None
        renamed = False
        latest_tmp: Path | None = None
        committed = False
        try:
            # P2-P3: every file, durable, under a name no reader looks at.
            fs.mkdir(tmp)
            made_tmp = True
            for d in subdirs:
                fs.mkdir(tmp / d)
            for rel, view in entries:
                fs.write(tmp / rel, view)
                fs.fsync(tmp / rel)
                crashpoints.hit(crashpoints.PUBLISH_FILE_WRITTEN)
            for d, save in sorted(saved.items()):
                fs.mkdir(tmp / d)
                save(tmp / d)
                listed, dirs = saved_files(fs, tmp, d)
                for rel, size, digest in listed:
                    if check_saved is not None:
                        path = tmp / rel
                        check_saved(rel, size, lambda n, p=path: fs.read_prefix(p, n), lambda p=path: fs.read(p))
                    fs.fsync(tmp / rel)
                    crashpoints.hit(crashpoints.PUBLISH_FILE_WRITTEN)
                    fields["files"][rel] = {"size": size, "sha256": digest}
                    saved_bytes += size
                subdirs += dirs
            for d in sorted(subdirs, key=lambda d: (-d.count("/"), d)):  # the deepest first
                fs.fsync(tmp / d)
            if saved:
                manifest_bytes = _encode_manifest(fields)
            # P4: the manifest last, so a manifest vouches for files already durable.
            fs.write(tmp / MANIFEST, manifest_bytes)
            fs.fsync(tmp / MANIFEST)
            fs.fsync(tmp)
            crashpoints.hit(crashpoints.PUBLISH_MANIFEST_WRITTEN)
            # P5: an unpublished leftover of the same step goes aside (LATEST does not
            # name it: checked in P1).
            if fs.kind_of(final) is not None:
                aside_path = root / (name + _tmp_suffix())
                fs.rename(final, aside_path)
                aside = aside_path
            # P6: the directory gets its final name, durably, before LATEST can name it.
            fs.rename(tmp, final)
            renamed = True
            fs.fsync(root)
            crashpoints.hit(crashpoints.PUBLISH_DIR_RENAMED)
            # P7
            latest_tmp = root / (LATEST + _tmp_suffix())
            fs.write(latest_tmp, (name + "\n").encode("ascii"))
            fs.fsync(latest_tmp)
            crashpoints.hit(crashpoints.PUBLISH_LATEST_WRITTEN)
            # P8: THE COMMIT POINT.
            fs.rename(latest_tmp, root / LATEST)
            committed = True
            fs.fsync(root)
            crashpoints.hit(crashpoints.PUBLISH_LATEST_REPLACED)
        except BaseException:
            if not committed:
                self._undo(
                    final,
                    tmp=tmp if made_tmp and not renamed else None,
                    ours=renamed,
                    aside=aside,
                    latest_tmp=latest_tmp,
                )
            raise

        # P9: only now may anything older go.
        if aside is not None:
            fs.rmtree(aside)
        self._retain(keep_last, name)
        total = sum(len(view) for _, view in entries) + saved_bytes + len(manifest_bytes)
        return Published(name, final, total, time.perf_counter() - t0)

    def _next_name(self, step: int) -> str:
        """The name a new checkpoint of `step` gets: `step_N`, or the next revision
        `step_N.R` when LATEST names a checkpoint of the same step (never LATEST's own
        name: the directory LATEST names is never touched)."""
        latest = checkpoint_order(self._latest_or_none() or "")
        if latest is None or latest[0] != step:
            return checkpoint_name(step)
        return checkpoint_name(step, latest[1] + 1)

    def set_aside(self, names: list[str]) -> str | None:
        """Move the checkpoint directories `names` into a new `abandoned-<UTC time>/`
        directory of the store (nothing is deleted) and return its name; None if `names`
        is empty. Each move is a rename, made durable before this returns. See "Resuming
        from an older checkpoint" in the module docstring."""
        if not names:
            return None
        fs, root = self._fs, self.root
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = root / f"{ABANDONED_PREFIX}{stamp}"
        n = 1
        while fs.kind_of(aside) is not None:
            n += 1
            aside = root / f"{ABANDONED_PREFIX}{stamp}-{n}"
        fs.mkdir(aside)
        fs.fsync(root)
        for name in names:
            if checkpoint_order(name) is None:
                raise ValueError(f"{name!r} is not a checkpoint name")
            fs.rename(root / name, aside / name)
        fs.fsync(aside)
        fs.fsync(root)
        return aside.name

    def point_latest(self, name: str) -> None:
        """Make LATEST name the existing checkpoint directory `name` (P7-P8 alone)."""
        if checkpoint_order(name) is None or self._fs.kind_of(self.root / name) != DIR:
            raise ValueError(f"{name!r} is not a checkpoint directory of {self.root}")
        fs = self._fs
        latest_tmp = self.root / (LATEST + _tmp_suffix())
        try:
            fs.write(latest_tmp, (name + "\n").encode("ascii"))
            fs.fsync(latest_tmp)
            fs.rename(latest_tmp, self.root / LATEST)
        except BaseException:
            if fs.kind_of(latest_tmp) is not None:
                with contextlib.suppress(OSError):
                    fs.unlink(latest_tmp)
            raise
        fs.fsync(self.root)

    def cleanup_tmp(self) -> list[str]:
        """Remove the `*.tmp-*` leftovers of interrupted publications and deletions, and
        return their names (sorted) for the caller to report. Call it at start-up, never
        while a publication may be running; `open` never calls it."""
        removed: list[str] = []
        for name, kind in self._scan():
            if _TMP_RE.fullmatch(name) is None:
                continue
            if kind == DIR:
                self._fs.rmtree(self.root / name)
            else:
                self._fs.unlink(self.root / name)
            removed.append(name)
        return sorted(removed)

    # -- reading -------------------------------------------------------------------------

    def latest(self) -> str | None:
        """The name in LATEST, or None when there is no LATEST (a fresh run). A LATEST that
        does not hold exactly one valid name and a newline raises CheckpointNotFound."""
        path = self.root / LATEST
        try:
            raw = self._fs.read(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointNotFound(
                "LATEST cannot be read",
                path=str(path),
                expected="a regular file holding a checkpoint name",
                found=_oserror_text(e),
                remedy=self._latest_remedy(),
            ) from e
        name = _parse_latest(raw)
        if name is None:
            shown = raw[:80]
            hint = " (truncated?)" if raw and not raw.endswith(b"\n") else ""
            raise CheckpointNotFound(
                "LATEST does not hold a checkpoint name",
                path=str(path),
                expected="'step_NNNNNN' (or 'step_NNNNNN.R') followed by one newline",
                found=f"{shown!r}{'...' if len(raw) > 80 else ''}{hint}",
                remedy=self._latest_remedy(),
            )
        return name

    def list(self) -> list[str]:
        """Names of the checkpoint directories present (`step_NNNNNN`, not `*.tmp-*`),
        sorted by step. Unverified: `open` one to trust it."""
        names = [name for name, kind in self._scan() if _step_of(name) is not None and kind == DIR]
        return sorted(names, key=lambda n: checkpoint_order(n) or (0, 0))

    def open(
        self,
        name: str | None = None,
        *,
        supported: Mapping[str, AbstractSet[int]] = _NO_SCHEMA_CHECK,
    ) -> OpenedCheckpoint:
        """Open and verify a checkpoint (restore steps 1-3), modifying nothing on disk.
        `name` None opens the one LATEST names. `supported` maps each component of the
        manifest's `schemas` to the versions the caller reads (empty: no check)."""
        if name is None:
            name = self.latest()
            if name is None:
                names = self.list()
                raise CheckpointNotFound(
                    "no checkpoint is published: LATEST is missing",
                    path=str(self.root / LATEST),
                    expected="a LATEST file naming the newest checkpoint",
                    found="no LATEST"
                    + (f" (checkpoint directories present: {', '.join(names)})" if names else ""),
                    remedy=self._latest_remedy(),
                )
            return _open_dir(self.root / name, supported, via_latest=True, fs=self._fs)
        if _step_of(name) is None:
            raise CheckpointNotFound(
                f"{name!r} is not a checkpoint name",
                path=str(self.root / name),
                expected="a name of the form step_NNNNNN (or step_NNNNNN.R, a later cut of that step)",
                found=repr(name),
                remedy=self._latest_remedy(),
            )
        return _open_dir(self.root / name, supported, via_latest=False, fs=self._fs)

    def open_path(
        self,
        path: Path,
        *,
        supported: Mapping[str, AbstractSet[int]] = _NO_SCHEMA_CHECK,
    ) -> OpenedCheckpoint:
        """Same as the module function `open_path` (any checkpoint directory, anywhere)."""
        return open_path(path, supported=supported, fs=self._fs)

    # -- internals -----------------------------------------------------------------------

    def manifests(self) -> list[tuple[Path, dict[str, Any] | None]]:
        """Every checkpoint directory of the store, published or set aside in an
        `abandoned-*/` directory, with its manifest (`read_manifest`: None where it cannot be
        trusted). Unverified beyond the manifest's own checksum: for retention of what they
        reference, which keeps everything on a None."""
        out = []
        for name, kind in self._scan():
            if kind != DIR:
                continue
            if _step_of(name) is not None:
                out.append(self.root / name)
            elif name.startswith(ABANDONED_PREFIX):
                out += [self.root / name / sub for sub, k in self._fs.listdir(self.root / name)
                        if k == DIR and _step_of(sub) is not None]
        return [(path, read_manifest(path, self._fs)) for path in out]

    def _scan(self) -> list[tuple[str, str]]:
        try:
            return self._fs.listdir(self.root)
        except FileNotFoundError:
            return []

    def _latest_or_none(self) -> str | None:
        """LATEST's name, or None if it is missing or not a valid name (publish only
        needs to know which directory must not be touched)."""
        try:
            return _parse_latest(self._fs.read(self.root / LATEST))
        except OSError:
            return None

    def _latest_remedy(self) -> str:
        return _latest_remedy(self.root, self.list())

    def _ensure_root(self) -> None:
        """Create `checkpoints/` (and any missing parent) and make its name durable. Its
        parent is fsynced at the first publication of every process, not only when this one
        creates it: an earlier process may have created it and died (or failed its fsync)
        before the name was durable, and a power cut would then take every checkpoint."""
        missing: list[Path] = []
        p = self.root
        while self._fs.kind_of(p) is None:
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            self._fs.mkdir(d)
            self._fs.fsync(d.parent)
        if not self._root_durable:
            self._fs.fsync(self.root.parent)
            self._root_durable = True

    def _undo(
        self,
        final: Path,
        *,
        tmp: Path | None,
        ours: bool,
        aside: Path | None,
        latest_tmp: Path | None,
    ) -> None:
        """Best-effort undo of a publication that failed before its commit point: remove
        what it created (`tmp`; `final` if `ours`, i.e. the rename of P6 happened; the
        LATEST temp file) and move back the directory it moved aside in P5. Each step may
        fail (the disk that failed may keep failing); what stays behind is then a
        `*.tmp-*` for `cleanup_tmp()` or an unpublished `step_*` for the next publish."""
        fs = self._fs

        def attempt(fn: Any, *args: Any) -> bool:
            try:
                fn(*args)
                return True
            except OSError:
                return False

        if latest_tmp is not None and fs.kind_of(latest_tmp) is not None:
            attempt(fs.unlink, latest_tmp)
        if ours:
            # Rename our unpublished directory out of the way before deleting it, so that
            # no half-deleted step_* directory is ever visible.
            doomed = final.with_name(final.name + _tmp_suffix())
            if attempt(fs.rename, final, doomed):
                attempt(fs.rmtree, doomed)
        if tmp is not None and fs.kind_of(tmp) is not None:
            attempt(fs.rmtree, tmp)
        if aside is not None and fs.kind_of(final) is None:
            attempt(fs.rename, aside, final)

    def _retain(self, keep_last: int | None, latest: str) -> None:
        if keep_last is None:
            return
        names = self.list()
        keep = set(names[-keep_last:]) | {latest}
        for old in names:
            if old in keep:
                continue
            doomed = self.root / (old + _tmp_suffix())
            self._fs.rename(self.root / old, doomed)
            self._fs.fsync(self.root)
            crashpoints.hit(crashpoints.PUBLISH_RETENTION)
            self._fs.rmtree(doomed)
