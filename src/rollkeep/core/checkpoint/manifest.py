"""A checkpoint directory as it is read: its name, its manifest, and the checks that make
it trusted (restore steps 1-3). The store (`rollkeep.core.checkpoint.store`) writes what this reads.

Opening a checkpoint (restore steps 1-3 of docs/design.md §5)
========================================================

`open` and `open_path` modify nothing on disk, ever: they never clean up, repair or
rename. Each refusal is an exception naming the file, the field, what was expected, what
was found, and what to do:

1. `CheckpointNotFound`: LATEST exists, holds a valid name, and names a directory that
   exists and has a MANIFEST.json.
2. `ManifestMismatch`: MANIFEST.json is a JSON object in canonical form with a correct
   checksum and the reserved keys with the right types; its name and step match the
   directory; every listed path is relative, normalised (no '.', '..' or empty component)
   and at most `MAX_DEPTH` components deep; every directory on the way is a real directory
   (a symlink is refused, so nothing listed resolves outside the checkpoint);
   every listed file is a regular file with the listed size and sha256; nothing else is in
   the directory (no unlisted file or directory is trusted).
3. `SchemaUnsupported`: `manifest_schema` is 1, and each entry of an optional `schemas`
   object (e.g. {"ledger": 1, "rows": 1}) is in the `supported` versions the caller
   passes. `manifest_schema` is read right after the manifest's checksum, before its other
   fields, because it decides how they are read; so a newer manifest is reported as
   "written by a newer rollkeep", and a corrupted one as a mismatch.

Time of check and time of use: `open` hashes every listed file (streaming, so memory
stays small even for model weights) but keeps no bytes; `OpenedCheckpoint.read` reads the
whole file again and checks its size and sha256 against the manifest before returning the
bytes. So the bytes a caller gets are exactly the bytes the manifest lists, even if the file
changed after `open`; the price is hashing the files that are read twice.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import CheckpointNotFound, ManifestMismatch, SchemaUnsupported
from ..io.fs import DEFAULT_FS, DIR, FS
from ..io.untrusted import loads_json
from .meta import CheckpointMeta, read_meta

MANIFEST = "MANIFEST.json"
LATEST = "LATEST"
MANIFEST_SCHEMA = 1

# Keys of MANIFEST.json that belong to the store; `meta` may not set them.
RESERVED_KEYS = frozenset(
    {"manifest_schema", "name", "step", "created", "files", "manifest_sha256"}
)

_NAME_RE = re.compile(r"step_(\d{6,})(?:\.([1-9]\d*))?")
# A leading "." is allowed (torch.distributed.checkpoint writes `.metadata`), "." and ".."
# are not (`_relpath_problem`), nor a leading "-" (a path must never read as an option).
_COMPONENT_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9._-]*")
#: The most path components a listed file may have (a trainer's sharded state nests).
MAX_DEPTH = 8
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_NO_SCHEMA_CHECK: Mapping[str, AbstractSet[int]] = MappingProxyType({})


def checkpoint_name(step: int, revision: int = 0) -> str:
    """`step_{step:06d}`, or `step_{step:06d}.{revision}` for a later cut of the same step
    (see "Republishing a step")."""
    for what, v in (("step", step), ("revision", revision)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"checkpoint {what} must be an int >= 0, got {v!r}")
    return f"step_{step:06d}" + (f".{revision}" if revision else "")


def checkpoint_order(name: str) -> tuple[int, int] | None:
    """(step, revision) of a canonical checkpoint name, or None if it is not one."""
    m = _NAME_RE.fullmatch(name)
    if m is None:
        return None
    key = (int(m.group(1)), int(m.group(2) or 0))
    return key if checkpoint_name(*key) == name else None


def _step_of(name: str) -> int | None:
    """The step a canonical checkpoint name stands for, or None if it is not one."""
    key = checkpoint_order(name)
    return None if key is None else key[0]


def _relpath_problem(rel: object) -> str | None:
    """Why `rel` is not an acceptable file path inside a checkpoint, or None if it is."""
    if not isinstance(rel, str):
        return f"a path must be a string, not {type(rel).__name__}"
    parts = rel.split("/")
    if len(parts) > MAX_DEPTH:
        return f"at most {MAX_DEPTH - 1} levels of subdirectory are allowed"
    for part in parts:
        if not _COMPONENT_RE.fullmatch(part) or part in (".", ".."):
            return (
                "each path component must be non-empty, start with a letter, digit, '_' or "
                "'.', and use only letters, digits, '.', '_', '-' (relative, normalised, no "
                "'.' or '..')"
            )
    if rel == MANIFEST:
        return f"{MANIFEST} is written by the store itself"
    return None


# -- the manifest's own encoding ---------------------------------------------------------


def _canonical_compact(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _encode_manifest(fields: Mapping[str, Any]) -> bytes:
    """MANIFEST.json bytes for `fields`: canonical indented JSON with `manifest_sha256`
    set to the sha256 of the canonical compact JSON of the other keys."""
    body = {k: v for k, v in fields.items() if k != "manifest_sha256"}
    full = dict(body, manifest_sha256=hashlib.sha256(_canonical_compact(body)).hexdigest())
    text = json.dumps(full, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False)
    return (text + "\n").encode("ascii")


def _decode_json(raw: bytes) -> Any:
    """Strict JSON (no duplicate keys, no NaN, bounded nesting). Raises ValueError."""
    return loads_json(raw)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint that passed restore steps 1-3. `manifest` is the parsed MANIFEST.json."""

    name: str
    path: Path
    manifest: dict[str, Any]
    _expected: Mapping[str, tuple[int, str]] = field(repr=False, compare=False)
    _fs: FS = field(default=DEFAULT_FS, repr=False, compare=False)

    @cached_property
    def meta(self) -> CheckpointMeta:
        """The manifest's meta, typed (`meta.read_meta`: a value of the wrong type is
        ManifestMismatch, raised here at the first read)."""
        return read_meta(self.manifest, path=str(self.path / MANIFEST))

    @property
    def fs(self) -> FS:
        """The filesystem it was opened through (what sits next to it is read through it too)."""
        return self._fs

    def files(self) -> list[str]:
        """The listed files, sorted."""
        return sorted(self._expected)

    def read(self, relpath: str) -> bytes:
        """The bytes of a listed file, checked again against its size and sha256 (so they
        are exactly the bytes the manifest lists, whatever happened since `open`)."""
        file = self.path / relpath
        if relpath not in self._expected:
            raise ManifestMismatch(
                f"checkpoint {self.name} has no file {relpath!r}",
                path=str(file),
                field=f"files[{relpath!r}]",
                expected=f"a file listed in {MANIFEST}",
                found=f"listed: {', '.join(self.files()) or 'none'}",
                remedy=_earlier_remedy(self.path, self._fs),
            )
        size, digest = self._expected[relpath]
        try:
            data = self._fs.read(file)
        except OSError as e:
            raise ManifestMismatch(
                f"{relpath} of checkpoint {self.name} cannot be read any more",
                path=str(file),
                expected="the file verified when the checkpoint was opened",
                found=_oserror_text(e),
                remedy=_earlier_remedy(self.path, self._fs),
            ) from e
        found = hashlib.sha256(data).hexdigest()
        if len(data) != size or found != digest:
            raise ManifestMismatch(
                f"{relpath} of checkpoint {self.name} changed after it was opened",
                path=str(file),
                field=f"files[{relpath!r}]",
                expected=f"size {size}, sha256 {digest}",
                found=f"size {len(data)}, sha256 {found}",
                remedy="make sure nothing else writes into the checkpoint directory; "
                + _earlier_remedy(self.path, self._fs),
            )
        return data

    def size(self, relpath: str) -> int:
        """The listed size of a listed file."""
        return self._expected[relpath][0]

    def read_prefix(self, relpath: str, n: int) -> bytes:
        """At most the first `n` bytes of a listed file, *not* checked against its sha256
        (`open` hashed the whole file): for reading a header, such as the step a trainer
        file declares, without reading gigabytes of weights twice."""
        if relpath not in self._expected:
            raise KeyError(relpath)
        return self._fs.read_prefix(self.path / relpath, n)


def _parse_latest(raw: bytes) -> str | None:
    if not raw.endswith(b"\n"):
        return None
    try:
        name = raw[:-1].decode("ascii")
    except UnicodeDecodeError:
        return None
    return name if _step_of(name) is not None else None


def open_path(
    path: Path,
    *,
    supported: Mapping[str, AbstractSet[int]] = _NO_SCHEMA_CHECK,
    fs: FS = DEFAULT_FS,
) -> OpenedCheckpoint:
    """Open and verify the checkpoint directory `path` (restore steps 1-3 without LATEST;
    for `rollkeep inspect PATH`). Modifies nothing on disk."""
    path = Path(path)
    if _step_of(path.name) is None:
        raise CheckpointNotFound(
            f"{path} is not a checkpoint directory",
            path=str(path),
            expected="a directory named step_NNNNNN holding a MANIFEST.json",
            found=f"a path named {path.name!r}",
            remedy="pass a checkpoint directory such as RUN_DIR/checkpoints/step_000012 "
            "(a copied checkpoint keeps its step_NNNNNN name)",
        )
    return _open_dir(path, supported, via_latest=False, fs=fs)


# -- verification (restore steps 1-3) ----------------------------------------------------


def _oserror_text(e: OSError) -> str:
    return e.strerror or str(e)


def _earlier_remedy(ckdir: Path, fs: FS = DEFAULT_FS) -> str:
    """What to do about a bad checkpoint: name the newest earlier one, if any."""
    root, step = ckdir.parent, checkpoint_order(ckdir.name)
    try:
        names = [name for name, kind in fs.listdir(root) if kind == DIR]
    except OSError:
        names = []
    earlier = sorted(
        (s, n) for n in names if (s := checkpoint_order(n)) is not None and (step is None or s < step)
    )
    if earlier:
        prev = earlier[-1][1]
        return (
            f"restore from an earlier checkpoint: check it with "
            f"`rollkeep inspect {root / prev}`, then set LATEST to it "
            f"(write '{prev}' and a newline into {root / LATEST})"
        )
    return (
        f"no earlier checkpoint exists in {root}; start a fresh run in a new RUN_DIR "
        f"and keep this one for inspection"
    )


def _latest_remedy(root: Path, names: list[str]) -> str:
    if names:
        return (
            f"checkpoint directories present: {', '.join(names)}; check one with "
            f"`rollkeep inspect {root / names[-1]}`, then set LATEST to it (write "
            f"'{names[-1]}' and a newline into {root / LATEST}); or start a fresh run in "
            f"a new RUN_DIR"
        )
    return f"there is nothing to restore in {root}; start a fresh run"


def read_manifest(ckdir: Path, fs: FS = DEFAULT_FS) -> dict[str, Any] | None:
    """The MANIFEST.json of `ckdir` if it parses and its own checksum holds, else None. Reads
    no other file: for decisions that keep everything when in doubt (row segment retention),
    never for a restore (`open_path` runs steps 1-3)."""
    try:
        manifest = _decode_json(fs.read(Path(ckdir) / MANIFEST))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or "manifest_sha256" not in manifest:
        return None
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    ok = manifest["manifest_sha256"] == hashlib.sha256(_canonical_compact(body)).hexdigest()
    return manifest if ok else None


def _open_dir(
    ckdir: Path, supported: Mapping[str, AbstractSet[int]], *, via_latest: bool, fs: FS = DEFAULT_FS
) -> OpenedCheckpoint:
    name = ckdir.name
    step = _step_of(name)
    assert step is not None
    o = _Opening(
        name=name,
        ckdir=ckdir,
        mpath=ckdir / MANIFEST,
        remedy=_earlier_remedy(ckdir, fs),
        named=f"LATEST names {name}, but" if via_latest else f"checkpoint {name}:",
        fs=fs,
    )
    raw = _read_manifest_file(o)  # step 1
    manifest = _parse_manifest(o, raw)  # step 2 (first half)
    _check_manifest_schema(o, manifest)  # step 3 (first half)
    _check_reserved_keys(o, manifest, step)  # step 2 (second half)
    expected = _listed_files(o, manifest.get("files"))
    _check_directory_files(o, expected)
    _check_component_schemas(o, manifest.get("schemas"), supported)  # step 3 (second half)
    return OpenedCheckpoint(name, ckdir, manifest, MappingProxyType(expected), fs)


@dataclass(frozen=True)
class _Opening:
    """What every check of `_open_dir` names in its error: the checkpoint, its manifest's
    path, and the remedy (restore from an earlier checkpoint)."""

    name: str
    ckdir: Path
    mpath: Path
    remedy: str
    named: str  # how an error of step 1 starts
    fs: FS

    def bad(self, what: str, field: str | None, expected: str, found: str) -> ManifestMismatch:
        """A problem of the manifest itself."""
        return ManifestMismatch(
            f"{MANIFEST} of {self.name}: {what}",
            path=str(self.mpath),
            field=field,
            expected=expected,
            found=found,
            remedy=self.remedy,
        )

    def mismatch(self, rel: str, what: str, exp: str, found: str) -> ManifestMismatch:
        """A listed file that is not what the manifest says."""
        return ManifestMismatch(
            f"{rel} of checkpoint {self.name}: {what}",
            path=str(self.ckdir / rel),
            field=f"files[{rel!r}]",
            expected=exp,
            found=found,
            remedy=self.remedy,
        )


def _read_manifest_file(o: _Opening) -> bytes:
    """Step 1: the directory exists and has a manifest."""
    kind = o.fs.kind_of(o.ckdir)
    if kind is None:
        raise CheckpointNotFound(
            f"{o.named} its directory does not exist",
            path=str(o.ckdir),
            expected="a checkpoint directory",
            found="No such file or directory",
            remedy=o.remedy,
        )
    if kind != DIR:
        raise CheckpointNotFound(
            f"{o.named} it is not a directory",
            path=str(o.ckdir),
            expected="a directory (not a symlink)",
            found=o.fs.describe(o.ckdir),
            remedy=o.remedy,
        )
    try:
        return o.fs.read(o.mpath)
    except FileNotFoundError as e:
        raise CheckpointNotFound(
            f"{o.named} it has no {MANIFEST} (the manifest is written last, so the "
            f"checkpoint is incomplete or damaged)",
            path=str(o.mpath),
            expected=f"{MANIFEST} in the checkpoint directory",
            found="no such file",
            remedy=o.remedy,
        ) from e
    except OSError as e:
        raise ManifestMismatch(
            f"{MANIFEST} of {o.name} cannot be read",
            path=str(o.mpath),
            expected="a readable regular file",
            found=_oserror_text(e),
            remedy=o.remedy,
        ) from e


def _parse_manifest(o: _Opening, raw: bytes) -> dict[str, Any]:
    """Step 2 (first half): the manifest itself: a JSON object whose checksum holds, in the
    canonical form rollkeep writes."""
    try:
        manifest = _decode_json(raw)
    except ValueError as e:  # includes UnicodeDecodeError and JSONDecodeError
        raise o.bad("it does not parse as JSON", None, "a UTF-8 JSON object", str(e)) from e
    if not isinstance(manifest, dict):
        raise o.bad("it is not a JSON object", None, "a JSON object", type(manifest).__name__)
    if "manifest_sha256" in manifest:
        claimed = manifest["manifest_sha256"]
        body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
        actual = hashlib.sha256(_canonical_compact(body)).hexdigest()
        if claimed != actual:
            raise o.bad(
                "its checksum does not match its content (corrupted or edited)",
                "manifest_sha256",
                f"sha256 of the other keys' canonical JSON, {actual}",
                repr(claimed),
            )
        if _encode_manifest(manifest) != raw:
            raise o.bad(
                "it is not byte-for-byte in the form rollkeep writes (corrupted or edited)",
                None,
                "canonical JSON: sorted keys, 2-space indent, ASCII, one final newline",
                f"{len(raw)} bytes that differ from it",
            )
    return manifest


def _check_manifest_schema(o: _Opening, manifest: dict[str, Any]) -> None:
    """Step 3 (first half): manifest_schema decides how the rest is read."""
    schema = manifest.get("manifest_schema")
    if not _is_int(schema):
        raise o.bad("manifest_schema is missing or not an int", "manifest_schema", "1", repr(schema))
    if schema != MANIFEST_SCHEMA:
        newer = schema > MANIFEST_SCHEMA
        raise SchemaUnsupported(
            f"{MANIFEST} of {o.name} has manifest_schema {schema}"
            + ("; it was written by a newer rollkeep" if newer else ""),
            path=str(o.mpath),
            field="manifest_schema",
            expected=str(MANIFEST_SCHEMA),
            found=str(schema),
            remedy=("upgrade rollkeep (pip install -U rollkeep), or " if newer else "") + o.remedy,
        )


def _check_reserved_keys(o: _Opening, manifest: dict[str, Any], step: int) -> None:
    """Step 2 (second half): the reserved keys and their types, `files` aside."""
    if "manifest_sha256" not in manifest:
        raise o.bad("manifest_sha256 is missing", "manifest_sha256", "a sha256 hex string", "none")
    if manifest.get("name") != o.name:
        raise o.bad(
            "it belongs to another checkpoint (swapped or copied in?)",
            "name",
            repr(o.name),
            repr(manifest.get("name")),
        )
    if manifest.get("step") != step or not _is_int(manifest.get("step")):
        raise o.bad(
            "its step does not match the directory", "step", str(step), repr(manifest.get("step"))
        )
    created = manifest.get("created")
    if not (_is_int(created) or isinstance(created, float)) or not math.isfinite(created):
        raise o.bad("created is not a unix time", "created", "a finite number", repr(created))


def _listed_files(o: _Opening, listed: Any) -> dict[str, tuple[int, str]]:
    """Step 2 (second half): `files`, each listed path -> (size, sha256); no path both a
    file and a directory."""
    if not isinstance(listed, dict):
        raise o.bad(
            "files is not an object", "files", "an object path -> {size, sha256}", repr(listed)
        )
    expected: dict[str, tuple[int, str]] = {}
    for rel, entry in listed.items():
        fld = f"files[{rel!r}]"
        problem = _relpath_problem(rel)
        if problem is not None:
            raise o.bad(f"listed path {rel!r} is not allowed", fld, problem, repr(rel))
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            raise o.bad(f"the entry of {rel} is malformed", fld, "{size, sha256}", repr(entry))
        size, digest = entry["size"], entry["sha256"]
        if not _is_int(size) or size < 0:
            raise o.bad(f"the size of {rel} is malformed", fld + ".size", "an int >= 0", repr(size))
        if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
            raise o.bad(
                f"the sha256 of {rel} is malformed", fld + ".sha256", "64 hex digits", repr(digest)
            )
        expected[rel] = (size, digest)
    for d in sorted(ancestors(expected)):
        if d in expected:
            raise o.bad(
                f"{d} is listed both as a file and as a directory",
                f"files[{d!r}]",
                "distinct file and directory names",
                d,
            )
    return expected


def _check_directory_files(o: _Opening, expected: dict[str, tuple[int, str]]) -> None:
    """Step 2 (second half): the directory holds exactly the listed files, each of its
    listed size and sha256."""
    unlisted_remedy = (
        "an unlisted file is never trusted; if you added it by hand, move it out of the "
        "checkpoint directory; otherwise " + o.remedy
    )
    for rel in _walk(o.ckdir, ancestors(expected), o.fs):
        if rel not in expected and rel != MANIFEST:
            raise ManifestMismatch(
                f"{rel} in checkpoint {o.name} is not listed in {MANIFEST}",
                path=str(o.ckdir / rel),
                field="files",
                expected=f"only the files listed in {MANIFEST}",
                found=f"an unlisted entry {rel!r}",
                remedy=unlisted_remedy,
            )
    for rel, (size, digest) in sorted(expected.items()):
        try:
            found_size, found_digest = o.fs.hash(o.ckdir / rel)
        except OSError as e:
            raise o.mismatch(
                rel,
                "it is missing" if isinstance(e, FileNotFoundError) else "it cannot be read",
                f"a regular file of {size} bytes",
                _oserror_text(e),
            ) from e
        if found_size != size:
            raise o.mismatch(
                rel, "wrong size (truncated or replaced?)", f"{size} bytes", f"{found_size} bytes"
            )
        if found_digest != digest:
            raise o.mismatch(rel, "wrong sha256 (corrupted or replaced)", digest, found_digest)


def _check_component_schemas(
    o: _Opening, schemas: Any, supported: Mapping[str, AbstractSet[int]]
) -> None:
    """Step 3 (second half): component schema versions."""
    if schemas is None:
        return
    if not isinstance(schemas, dict) or not all(_is_int(v) for v in schemas.values()):
        raise o.bad("schemas is malformed", "schemas", "an object component -> int", repr(schemas))
    if not supported:
        return
    for comp, version in sorted(schemas.items()):
        versions = supported.get(comp)
        if versions is not None and version in versions:
            continue
        newer = versions is None or (bool(versions) and version > max(versions))
        raise SchemaUnsupported(
            f"checkpoint {o.name} holds {comp} in schema version {version}, which this "
            f"rollkeep cannot read"
            + ("; it was written by a newer rollkeep" if newer else ""),
            path=str(o.mpath),
            field=f"schemas.{comp}",
            expected=(
                f"one of the versions {sorted(versions)}"
                if versions is not None
                else f"one of the components {sorted(supported)}"
            ),
            found=str(version),
            remedy=("upgrade rollkeep (pip install -U rollkeep), or " if newer else "") + o.remedy,
        )


def ancestors(paths: Iterable[str]) -> set[str]:
    """Every directory the relative `paths` lie in ("a/b/c" -> "a", "a/b")."""
    out: set[str] = set()
    for rel in paths:
        parts = rel.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return out


def _walk(ckdir: Path, subdirs: set[str], fs: FS, rel: str = "") -> list[str]:
    """Every entry of a checkpoint directory, as relative paths; a directory that a listed
    file lies in is entered (only a real directory: `listdir` does not follow a symlink),
    anything else (a symlink, an unlisted directory, a FIFO) is returned as is, to be
    refused if it is not a listed regular file."""
    out: list[str] = []
    for name, kind in fs.listdir(ckdir / rel if rel else ckdir):
        path = f"{rel}/{name}" if rel else name
        if path in subdirs and kind == DIR:
            out.extend(_walk(ckdir, subdirs, fs, path))
        else:
            out.append(path)
    return out
