"""Tests for the checkpoint store: round trip, retention, republish, and restore steps 1-3
refusing every corruption of a published checkpoint without modifying anything on disk."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollkeep.core.checkpoint.store import (
    FS,
    LATEST,
    MANIFEST,
    CheckpointStore,
    OpenedCheckpoint,
    Published,
    _encode_manifest,
    checkpoint_name,
    open_path,
)
from rollkeep.core.errors import (
    CheckpointError,
    CheckpointNotFound,
    ManifestMismatch,
    SchemaUnsupported,
)

FILE_NAMES = (
    "ledger.msgpack",
    "rows.safetensors",
    "trainer/model.safetensors",
    "trainer/optim.bin",
)


def files_for(step: int, tag: str = "") -> dict[str, bytes]:
    """Same names and sizes for every step, different bytes: a file swapped in from
    another checkpoint is caught by its sha256, not by its size."""
    return {
        rel: b"".join(
            hashlib.sha256(f"{rel}|{step}|{tag}|{i}".encode()).digest() for i in range(1 + k)
        )
        for k, rel in enumerate(FILE_NAMES)
    }


def tree(root: Path) -> dict[str, str]:
    """Every path under root with its type and content hash: equal trees are identical."""
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


class NoSyncFS(FS):
    """For tests about reading: the bytes and names are the same, minus the fsync cost."""

    def fsync(self, path: Path) -> None:
        pass


def make_store(tmp: Path, steps=(1, 2), keep_last=None) -> CheckpointStore:
    """Published checkpoints of `steps` (files_for(step) each), LATEST naming the last.
    Writes without fsync (fast); the returned store writes with the real FS."""
    writer = CheckpointStore(tmp / "run" / "checkpoints", fs=NoSyncFS())
    for s in steps:
        writer.publish(s, files_for(s), {"weight_version": s}, keep_last=keep_last)
    return CheckpointStore(writer.root)


def rewrite_manifest(ckdir: Path, edit, *, checksum: bool = True) -> None:
    """Rewrite MANIFEST.json through `edit(dict)`, with a valid checksum (so only the edit
    is wrong) unless `checksum` is False."""
    m = json.loads((ckdir / MANIFEST).read_bytes())
    edit(m)
    if checksum:
        raw = _encode_manifest(m)
    else:
        m.pop("manifest_sha256", None)
        raw = (json.dumps(m, sort_keys=True, indent=2) + "\n").encode()
    (ckdir / MANIFEST).write_bytes(raw)


# -- names -------------------------------------------------------------------------------


def test_checkpoint_name():
    assert checkpoint_name(0) == "step_000000"
    assert checkpoint_name(12) == "step_000012"
    assert checkpoint_name(1234567) == "step_1234567"
    for bad in (-1, True, 1.0, "3"):
        with pytest.raises(ValueError):
            checkpoint_name(bad)


# -- round trip --------------------------------------------------------------------------


def test_fresh_store_reads_nothing_and_creates_nothing(tmp_path):
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    assert store.latest() is None
    assert store.list() == []
    assert store.cleanup_tmp() == []
    with pytest.raises(CheckpointNotFound) as ei:
        store.open()
    assert "LATEST" in str(ei.value) and "fresh run" in ei.value.remedy
    assert not (tmp_path / "run").exists()


def test_round_trip(tmp_path):
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    files = files_for(7)
    pub = store.publish(7, files, {"weight_version": 7, "schemas": {"ledger": 1}}, keep_last=3)
    assert isinstance(pub, Published)
    assert pub.name == "step_000007" and pub.path == store.root / "step_000007"
    manifest_size = (pub.path / MANIFEST).stat().st_size
    assert pub.bytes == sum(map(len, files.values())) + manifest_size
    assert (store.root / LATEST).read_bytes() == b"step_000007\n"
    assert store.latest() == "step_000007"

    ck = store.open()
    assert isinstance(ck, OpenedCheckpoint)
    assert ck.name == "step_000007" and ck.path == pub.path
    assert ck.files() == sorted(files)
    for rel, data in files.items():
        assert ck.read(rel) == data
    m = ck.manifest
    assert m["manifest_schema"] == 1 and m["name"] == "step_000007" and m["step"] == 7
    assert isinstance(m["created"], float)
    assert m["weight_version"] == 7 and m["schemas"] == {"ledger": 1}
    assert m["files"]["ledger.msgpack"] == {
        "size": len(files["ledger.msgpack"]),
        "sha256": hashlib.sha256(files["ledger.msgpack"]).hexdigest(),
    }
    assert store.open("step_000007").manifest == m
    assert open_path(pub.path).manifest == m
    assert store.open_path(pub.path).name == "step_000007"
    assert sorted(os.listdir(store.root)) == [LATEST, "step_000007"]


def test_empty_checkpoint_and_empty_files(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    store.publish(0, {}, {}, keep_last=None)
    assert store.open().files() == []
    store.publish(1, {"empty": b"", "d/also_empty": bytearray()}, {}, keep_last=None)
    ck = store.open()
    assert ck.read("empty") == b"" and ck.read("d/also_empty") == b""


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.tuples(
            st.sampled_from(["", "trainer", "rows_dir"]),
            st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,12}", fullmatch=True),
        ),
        st.binary(max_size=300),
        max_size=8,
    ),
    st.integers(min_value=0, max_value=10**7),
)
def test_round_trip_random_file_sets(raw_files, step):
    files = {(f"{d}/{n}" if d else n): data for (d, n), data in raw_files.items()}
    top = {rel for rel in files if "/" not in rel}
    files = {rel: v for rel, v in files.items() if rel.split("/")[0] not in top or "/" not in rel}
    files.pop(MANIFEST, None)
    with tempfile.TemporaryDirectory() as d:
        store = CheckpointStore(Path(d) / "checkpoints", fs=NoSyncFS())
        store.publish(step, files, {"note": "x"}, keep_last=1)
        ck = store.open()
        assert ck.name == checkpoint_name(step)
        assert ck.files() == sorted(files)
        assert {rel: ck.read(rel) for rel in files} == files


# -- retention ---------------------------------------------------------------------------


def test_latest_names_newest_and_retention_keeps_keep_last(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    for s in range(1, 6):
        store.publish(s, files_for(s), {}, keep_last=2)
        assert store.latest() == checkpoint_name(s)
        assert store.list() == [checkpoint_name(x) for x in range(max(1, s - 1), s + 1)]
    assert sorted(os.listdir(store.root)) == [LATEST, "step_000004", "step_000005"]
    assert store.open().read("ledger.msgpack") == files_for(5)["ledger.msgpack"]
    store.publish(6, files_for(6), {}, keep_last=None)
    assert store.list() == ["step_000004", "step_000005", "step_000006"]


def test_retention_orders_by_step_number_not_by_name(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    for s in (999_999, 1_000_000, 1_000_001):
        store.publish(s, {"f": b"%d" % s}, {}, keep_last=2)
    assert store.list() == ["step_1000000", "step_1000001"]


def test_retention_never_deletes_the_latest(tmp_path):
    store = make_store(tmp_path, steps=(1, 2, 3))
    # Leftovers of newer steps that LATEST never named (a crash before the commit point of
    # a run that was later resumed from an earlier checkpoint).
    shutil.copytree(store.root / "step_000003", store.root / "step_000009")
    shutil.copytree(store.root / "step_000003", store.root / "step_000010")
    store.publish(4, files_for(4), {}, keep_last=1)
    assert store.latest() == "step_000004"
    assert store.list() == ["step_000004", "step_000010"]
    assert store.open().name == "step_000004"


def test_keep_last_is_validated_before_anything_is_written(tmp_path):
    store = make_store(tmp_path)
    before = tree(store.root)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError):
            store.publish(3, files_for(3), {}, keep_last=bad)
    assert tree(store.root) == before


# -- republish ---------------------------------------------------------------------------


def test_republish_a_step_left_unpublished_by_a_crash(tmp_path):
    store = make_store(tmp_path)
    # A crash after P6 (directory renamed) and before P8 (LATEST replaced) of step 3.
    leftover = store.root / "step_000003"
    shutil.copytree(store.root / "step_000002", leftover)
    (leftover / "junk").write_bytes(b"half of something")
    assert store.latest() == "step_000002"

    store.publish(3, files_for(3, "again"), {}, keep_last=None)
    ck = store.open()
    assert ck.name == "step_000003"
    assert {rel: ck.read(rel) for rel in FILE_NAMES} == files_for(3, "again")
    assert sorted(os.listdir(store.root)) == [LATEST, "step_000001", "step_000002", "step_000003"]


def test_republishing_the_latest_step_writes_its_next_revision(tmp_path):
    """A later cut of the step LATEST names (a run stopping at that version after more
    custody changes) is published as `step_N.1`, `step_N.2`, ...: the directory LATEST
    names is never touched, and the old revision stays until retention drops it."""
    store = make_store(tmp_path)
    published = store.root / "step_000002"
    before = tree(published)
    first = store.publish(2, files_for(2, "other"), {}, keep_last=None)
    assert first.name == "step_000002.1" and store.latest() == "step_000002.1"
    assert tree(published) == before
    second = store.publish(2, files_for(2, "third"), {}, keep_last=2)
    assert second.name == "step_000002.2"
    assert store.list() == ["step_000002.1", "step_000002.2"]
    ck = store.open()
    assert (ck.manifest["name"], ck.manifest["step"]) == ("step_000002.2", 2)
    assert {rel: ck.read(rel) for rel in FILE_NAMES} == files_for(2, "third")
    assert store.publish(3, files_for(3), {}, keep_last=None).name == "step_000003"


def test_publishing_an_earlier_step_than_latest(tmp_path):
    store = make_store(tmp_path, steps=(5,))
    store.publish(3, files_for(3), {}, keep_last=None)
    assert store.latest() == "step_000003"
    assert store.list() == ["step_000003", "step_000005"]


# -- argument validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    "meta",
    [
        {"manifest_schema": 2},
        {"name": "x"},
        {"step": 1},
        {"created": 0.0},
        {"files": {}},
        {"manifest_sha256": "0" * 64},
        {"bad": float("nan")},
        {"bad": object()},
        {3: "non-string key"},
    ],
)
def test_bad_meta_is_refused_before_anything_is_written(tmp_path, meta):
    store = make_store(tmp_path)
    before = tree(store.root)
    with pytest.raises(ValueError):
        store.publish(3, files_for(3), meta, keep_last=1)
    assert tree(store.root) == before


@pytest.mark.parametrize(
    "files",
    [
        {"../escape": b""},
        {"/abs": b""},
        {"/".join("abcdefghi"): b""},  # deeper than MAX_DEPTH
        {"a/../b": b""},
        {"..": b""},
        {"": b""},
        {"a//b": b""},
        {"./a": b""},
        {"a/./b": b""},
        {"a/": b""},
        {"-option": b""},
        {MANIFEST: b""},
        {"a\\b": b""},
        {"a b": b""},
        {"a": b"", "a/b": b""},
    ],
)
def test_bad_file_names_are_refused(tmp_path, files):
    store = make_store(tmp_path)
    before = tree(store.root)
    with pytest.raises(ValueError):
        store.publish(3, files, {}, keep_last=1)
    assert tree(store.root) == before


def test_non_bytes_content_is_refused(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    with pytest.raises(TypeError):
        store.publish(1, {"a": "text"}, {}, keep_last=None)
    assert not store.root.exists()


# -- corruption of a published checkpoint: restore steps 1-3 refuse it, modify nothing -------

CORRUPTIONS = ("truncate", "flip", "delete", "swap")


def corrupt(store: CheckpointStore, rel: str, how: str) -> None:
    """Corrupt file `rel` of step_000002 (the published one); step_000001 is the donor."""
    target = store.root / "step_000002" / rel
    data = target.read_bytes()
    if how == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        i = len(data) // 2
        target.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
    elif how == "delete":
        target.unlink()
    elif how == "swap":
        donor = (store.root / "step_000001" / rel).read_bytes()
        assert donor != data
        target.write_bytes(donor)
    else:
        raise AssertionError(how)


def expected_error(rel: str, how: str) -> type[CheckpointError]:
    if rel == MANIFEST and how == "delete":
        return CheckpointNotFound  # step 1: the directory has no MANIFEST.json
    return ManifestMismatch


def assert_refused(store: CheckpointStore, exc: type[CheckpointError], names: str, **open_kw):
    """open() raises exactly `exc`, names the file, says what to do, changes nothing."""
    before = tree(store.root)
    with pytest.raises(CheckpointError) as ei:
        store.open(**open_kw)
    err = ei.value
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert names in str(err)
    assert err.path is not None and err.remedy
    assert tree(store.root) == before
    return err


@pytest.mark.parametrize("how", CORRUPTIONS)
@pytest.mark.parametrize("rel", [*FILE_NAMES, MANIFEST])
def test_corrupted_file_is_refused(tmp_path, rel, how):
    store = make_store(tmp_path)
    corrupt(store, rel, how)
    err = assert_refused(store, expected_error(rel, how), rel)
    assert err.path.endswith(rel)
    # The remedy points at the earlier checkpoint, which still opens.
    assert "step_000001" in err.remedy
    assert store.open("step_000001").read(FILE_NAMES[0]) == files_for(1)[FILE_NAMES[0]]
    # open_path (rollkeep inspect) runs the same checks.
    with pytest.raises(expected_error(rel, how)):
        open_path(store.root / "step_000002")


@pytest.mark.parametrize(
    "extra",
    ["unlisted.bin", "trainer/unlisted.bin", "newdir/", "trainer/deeper/", "MANIFEST.json.bak"],
)
def test_unlisted_entry_is_refused(tmp_path, extra):
    store = make_store(tmp_path)
    path = store.root / "step_000002" / extra
    if extra.endswith("/"):
        path.mkdir()
        extra = extra.rstrip("/")
    else:
        path.write_bytes(b"not listed")
    err = assert_refused(store, ManifestMismatch, extra)
    assert "not listed" in str(err)


def test_listed_file_replaced_by_symlink_is_refused(tmp_path):
    store = make_store(tmp_path)
    target = store.root / "step_000002" / "rows.safetensors"
    copy = tmp_path / "outside"
    copy.write_bytes(target.read_bytes())  # identical bytes, but not a file of the checkpoint
    target.unlink()
    target.symlink_to(copy)
    assert_refused(store, ManifestMismatch, "rows.safetensors")


def test_unlisted_symlink_is_refused(tmp_path):
    store = make_store(tmp_path)
    (store.root / "step_000002" / "link").symlink_to(store.root / "step_000001")
    assert_refused(store, ManifestMismatch, "link")


def test_checkpoint_directory_swapped_in_from_another_is_refused(tmp_path):
    store = make_store(tmp_path)
    shutil.rmtree(store.root / "step_000002")
    shutil.copytree(store.root / "step_000001", store.root / "step_000002")
    err = assert_refused(store, ManifestMismatch, MANIFEST)
    assert err.field == "name"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([*FILE_NAMES, MANIFEST]),
    st.floats(min_value=0, max_value=1, exclude_max=True),
    st.integers(min_value=1, max_value=255),
)
def test_any_single_byte_flip_is_refused(rel, where, mask):
    with tempfile.TemporaryDirectory() as d:
        store = make_store(Path(d))
        target = store.root / "step_000002" / rel
        data = bytearray(target.read_bytes())
        data[int(where * len(data))] ^= mask
        target.write_bytes(bytes(data))
        assert_refused(store, ManifestMismatch, rel)


# -- LATEST ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"step_000002",  # truncated: the newline is missing
        b"step_00",  # truncated
        b"",  # truncated to nothing
        b"step_000002\n\n",
        b"step_000002 \n",
        b"step_02\n",  # not canonical
        b"step_0000002\n",  # not canonical
        b"../step_000002\n",
        b"/abs/step_000002\n",
        b"\xffstep_000002\n",
    ],
)
def test_latest_with_bad_content_is_refused(tmp_path, content):
    store = make_store(tmp_path)
    (store.root / LATEST).write_bytes(content)
    assert_refused(store, CheckpointNotFound, LATEST)
    before = tree(store.root)
    with pytest.raises(CheckpointNotFound):
        store.latest()
    assert tree(store.root) == before


@pytest.mark.parametrize("i", range(len("step_000002\n")))
def test_latest_flipped_byte_is_refused(tmp_path, i):
    store = make_store(tmp_path)
    data = bytearray((store.root / LATEST).read_bytes())
    data[i] ^= 0xFF
    (store.root / LATEST).write_bytes(bytes(data))
    assert_refused(store, CheckpointNotFound, LATEST)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=11), st.integers(min_value=1, max_value=255))
def test_latest_random_flip_opens_nothing_torn(i, mask):
    """LATEST has no checksum (a person may point it at an earlier checkpoint), so a flip
    that spells another existing checkpoint opens that one; anything else is refused.
    Either way, never a torn checkpoint."""
    with tempfile.TemporaryDirectory() as d:
        store = make_store(Path(d), steps=(1, 2, 3))
        data = bytearray((store.root / LATEST).read_bytes())
        data[i] ^= mask
        (store.root / LATEST).write_bytes(bytes(data))
        try:
            ck = store.open()
        except CheckpointNotFound:
            return
        assert bytes(data) == (ck.name + "\n").encode()
        step = ck.manifest["step"]
        assert {rel: ck.read(rel) for rel in FILE_NAMES} == files_for(step)


def test_latest_deleted_is_refused(tmp_path):
    store = make_store(tmp_path)
    (store.root / LATEST).unlink()
    assert store.latest() is None
    err = assert_refused(store, CheckpointNotFound, LATEST)
    assert "step_000002" in err.remedy  # tells the user which checkpoints are there


@pytest.mark.parametrize("case", ["missing_dir", "no_manifest", "file_not_dir", "symlink_dir"])
def test_latest_naming_nothing_usable_is_refused(tmp_path, case):
    store = make_store(tmp_path)
    if case == "missing_dir":
        (store.root / LATEST).write_bytes(b"step_000099\n")  # swapped in from another run
        names = "step_000099"
    elif case == "no_manifest":
        (store.root / "step_000002" / MANIFEST).unlink()
        names = MANIFEST
    elif case == "file_not_dir":
        (store.root / "step_000003").write_bytes(b"")
        (store.root / LATEST).write_bytes(b"step_000003\n")
        names = "step_000003"
    else:
        (store.root / "step_000003").symlink_to(store.root / "step_000002")
        (store.root / LATEST).write_bytes(b"step_000003\n")
        names = "step_000003"
    assert_refused(store, CheckpointNotFound, names)


def test_latest_is_a_directory(tmp_path):
    store = make_store(tmp_path)
    (store.root / LATEST).unlink()
    (store.root / LATEST).mkdir()
    assert_refused(store, CheckpointNotFound, LATEST)


def test_open_by_bad_name_is_refused(tmp_path):
    store = make_store(tmp_path)
    for name in ("step_2", "../step_000002", "LATEST", "step_000002.tmp-ab"):
        with pytest.raises(CheckpointNotFound):
            store.open(name)


# -- restore step 2 on the manifest's own fields -----------------------------------------


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m.update(name="step_000001"), "name"),
        (lambda m: m.update(step=1), "step"),
        (lambda m: m.update(step=True), "step"),
        (lambda m: m.update(created="yesterday"), "created"),
        (lambda m: m.pop("created"), "created"),
        (lambda m: m.update(files=[]), "files"),
        (lambda m: m.pop("files"), "files"),
        (lambda m: m.update(manifest_schema="1"), "manifest_schema"),
        (lambda m: m.pop("manifest_schema"), "manifest_schema"),
        (lambda m: m["files"].update({"../x": {"size": 0, "sha256": "0" * 64}}), "files['../x']"),
        (lambda m: m["files"].update({"/x": {"size": 0, "sha256": "0" * 64}}), "files['/x']"),
        (lambda m: m["files"].update({"a/../b": {"size": 0, "sha256": "0" * 64}}), "a/../b"),
        (lambda m: m["files"].update({"a/b/c/d/e/f/g/h/i": {"size": 0, "sha256": "0" * 64}}), "a/b/c/d/e/f/g/h/i"),
        (lambda m: m["files"].update({"a/./b": {"size": 0, "sha256": "0" * 64}}), "a/./b"),
        (lambda m: m["files"]["ledger.msgpack"].update(size=-1), "size"),
        (lambda m: m["files"]["ledger.msgpack"].update(size=1.0), "size"),
        (lambda m: m["files"]["ledger.msgpack"].update(sha256="ABC"), "sha256"),
        (lambda m: m["files"]["ledger.msgpack"].update(extra=1), "ledger.msgpack"),
        (lambda m: m["files"].update({"trainer": {"size": 0, "sha256": "0" * 64}}), "trainer"),
        (lambda m: m.update(schemas="ledger:1"), "schemas"),
        (lambda m: m.update(schemas={"ledger": "1"}), "schemas"),
    ],
)
def test_manifest_fields_are_checked(tmp_path, edit, field):
    store = make_store(tmp_path)
    rewrite_manifest(store.root / "step_000002", edit)
    err = assert_refused(store, ManifestMismatch, MANIFEST)
    assert field in (err.field or "") + str(err)


def test_manifest_without_checksum_is_refused(tmp_path):
    store = make_store(tmp_path)
    rewrite_manifest(store.root / "step_000002", lambda m: None, checksum=False)
    err = assert_refused(store, ManifestMismatch, MANIFEST)
    assert err.field == "manifest_sha256"


def test_manifest_value_edited_without_checksum_is_refused(tmp_path):
    store = make_store(tmp_path)
    path = store.root / "step_000002" / MANIFEST
    raw = path.read_bytes()
    assert raw.count(b'"weight_version": 2') == 1
    path.write_bytes(raw.replace(b'"weight_version": 2', b'"weight_version": 3'))
    err = assert_refused(store, ManifestMismatch, MANIFEST)
    assert err.field == "manifest_sha256"


def test_manifest_not_in_canonical_form_is_refused(tmp_path):
    store = make_store(tmp_path)
    path = store.root / "step_000002" / MANIFEST
    m = json.loads(path.read_bytes())
    path.write_bytes(json.dumps(m).encode())  # same content, other layout
    assert_refused(store, ManifestMismatch, MANIFEST)


@pytest.mark.parametrize(
    "raw",
    [b"[]", b"null", b"{", b'{"a": NaN}', b'{"a": 1, "a": 2}', b"\xff\xfe"],
)
def test_manifest_that_is_not_a_json_object_is_refused(tmp_path, raw):
    store = make_store(tmp_path)
    (store.root / "step_000002" / MANIFEST).write_bytes(raw)
    assert_refused(store, ManifestMismatch, MANIFEST)


# -- restore step 3: schema versions -----------------------------------------------------


@pytest.mark.parametrize("checksum", [True, False])
def test_newer_manifest_schema_is_refused(tmp_path, checksum):
    store = make_store(tmp_path)
    rewrite_manifest(
        store.root / "step_000002", lambda m: m.update(manifest_schema=2), checksum=checksum
    )
    err = assert_refused(store, SchemaUnsupported, MANIFEST)
    assert err.field == "manifest_schema" and err.found == "2" and err.expected == "1"
    assert "newer rollkeep" in str(err) and "upgrade" in err.remedy


def test_older_manifest_schema_is_refused(tmp_path):
    store = make_store(tmp_path)
    rewrite_manifest(store.root / "step_000002", lambda m: m.update(manifest_schema=0))
    err = assert_refused(store, SchemaUnsupported, MANIFEST)
    assert "newer" not in str(err)


def test_component_schemas(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    store.publish(1, files_for(1), {"schemas": {"ledger": 1, "rows": 1}}, keep_last=None)
    store.publish(2, files_for(2), {"schemas": {"ledger": 3, "rows": 1}}, keep_last=None)
    assert store.open().name == "step_000002"  # no check asked for
    ok = {"ledger": {1, 2, 3}, "rows": {1}}
    assert store.open(supported=ok).name == "step_000002"

    err = assert_refused(store, SchemaUnsupported, "ledger", supported={"ledger": {1}, "rows": {1}})
    assert err.field == "schemas.ledger" and err.found == "3"
    assert "newer rollkeep" in str(err) and "step_000001" in err.remedy
    err = assert_refused(store, SchemaUnsupported, "ledger", supported={"ledger": {4}, "rows": {1}})
    assert "newer" not in str(err)
    err = assert_refused(store, SchemaUnsupported, "rows", supported={"ledger": {3}})
    assert err.field == "schemas.rows"
    assert store.open("step_000001", supported={"ledger": {1}, "rows": {1}}).name == "step_000001"


# -- reading after open ------------------------------------------------------------------


def test_read_reverifies_the_bytes(tmp_path):
    store = make_store(tmp_path)
    ck = store.open()
    target = store.root / "step_000002" / "ledger.msgpack"
    data = target.read_bytes()
    target.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(ManifestMismatch, match="changed after it was opened"):
        ck.read("ledger.msgpack")
    target.unlink()
    with pytest.raises(ManifestMismatch, match="ledger.msgpack"):
        ck.read("ledger.msgpack")
    for rel in ("unlisted", MANIFEST, "../step_000001/ledger.msgpack"):
        with pytest.raises(ManifestMismatch):
            ck.read(rel)


def test_open_path_needs_a_checkpoint_directory(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(CheckpointNotFound):
        open_path(store.root)
    with pytest.raises(CheckpointNotFound):
        open_path(tmp_path / "nowhere" / "step_000002")
    # A copied checkpoint keeps working under its own name, anywhere.
    shutil.copytree(store.root / "step_000002", tmp_path / "elsewhere" / "step_000002")
    ck = open_path(tmp_path / "elsewhere" / "step_000002")
    assert ck.read("ledger.msgpack") == files_for(2)["ledger.msgpack"]


def test_remedy_when_no_earlier_checkpoint_exists(tmp_path):
    store = make_store(tmp_path, steps=(1,))
    (store.root / "step_000001" / "rows.safetensors").write_bytes(b"")
    err = assert_refused(store, ManifestMismatch, "rows.safetensors")
    assert "no earlier checkpoint" in err.remedy


# -- cleanup -----------------------------------------------------------------------------


def test_cleanup_tmp_removes_only_leftovers(tmp_path):
    store = make_store(tmp_path)
    (store.root / "step_000003.tmp-0a1b").mkdir()
    (store.root / "step_000003.tmp-0a1b" / "f").write_bytes(b"x")
    (store.root / "LATEST.tmp-ff").write_bytes(b"step_000003\n")
    (store.root / "step_000001.tmp-12").symlink_to(store.root / "step_000001")
    (store.root / "notes.txt").write_bytes(b"mine")
    assert store.cleanup_tmp() == ["LATEST.tmp-ff", "step_000001.tmp-12", "step_000003.tmp-0a1b"]
    assert sorted(os.listdir(store.root)) == [LATEST, "notes.txt", "step_000001", "step_000002"]
    assert store.open("step_000001").name == "step_000001"
    assert store.cleanup_tmp() == []


def test_open_never_cleans_up(tmp_path):
    store = make_store(tmp_path)
    (store.root / "step_000003.tmp-0a1b").mkdir()
    before = tree(store.root)
    store.open()
    store.list()
    store.latest()
    assert tree(store.root) == before


# -- directories a trainer's save writes (P3) --------------------------------------------


def test_a_saved_directory_is_hashed_and_listed_at_any_depth(tmp_path):
    store = make_store(tmp_path)

    def save(d: Path) -> None:
        (d / "dcp").mkdir()
        (d / "dcp" / ".metadata").write_bytes(b"meta")
        (d / "dcp" / "__0_0.distcp").write_bytes(b"shard" * 1000)
        (d / "step.json").write_bytes(b'{"rollkeep_step": 3}')

    pub = store.publish(3, {"ledger.msgpack": b"L"}, {}, keep_last=None, saved={"trainer": save})
    ck = store.open()
    assert ck.files() == ["ledger.msgpack", "trainer/dcp/.metadata", "trainer/dcp/__0_0.distcp", "trainer/step.json"]
    assert ck.read("trainer/dcp/__0_0.distcp") == b"shard" * 1000
    assert pub.bytes == 1 + 4 + 5000 + 20 + (pub.path / "MANIFEST.json").stat().st_size


def _linked_dir(d: Path) -> None:
    (d / "real").mkdir()
    (d / "real" / "x").write_bytes(b"x")
    os.symlink(d / "real", d / "linked")


def _empty_subdir(d: Path) -> None:
    (d / "f").write_bytes(b"x")
    (d / "empty").mkdir()


@pytest.mark.parametrize("what, plant", [
    ("a symlink", lambda d: os.symlink("/etc/passwd", d / "model.bin")),
    ("a symlink", _linked_dir),
    ("a special file", lambda d: os.mkfifo(d / "pipe")),
    ("an empty directory", _empty_subdir),
    ("an empty directory", lambda d: None),  # nothing saved: no step recorded either
    ("a name the manifest cannot list", lambda d: (d / "a b").write_bytes(b"x")),
])
def test_a_save_that_writes_anything_but_regular_files_publishes_nothing(tmp_path, what, plant):
    store = make_store(tmp_path)
    before = tree(store.root)
    with pytest.raises(CheckpointError) as err:
        store.publish(3, {"ledger.msgpack": b"L"}, {}, keep_last=1, saved={"trainer": plant})
    assert what in str(err.value) and "nothing was published" in str(err.value) and err.value.remedy
    assert tree(store.root) == before  # LATEST unchanged, the temp directory removed
    assert store.latest() == "step_000002"


@pytest.mark.parametrize("error", [RuntimeError("disk quota of the trainer"),
                                   OSError(errno.ENOSPC, "No space left on device")])
def test_a_save_that_raises_publishes_nothing(tmp_path, error):
    store = make_store(tmp_path)
    before = tree(store.root)

    def save(d: Path) -> None:
        (d / "half").write_bytes(b"x")
        raise error

    with pytest.raises(type(error)):
        store.publish(3, {}, {}, keep_last=1, saved={"trainer": save})
    assert tree(store.root) == before


def test_a_nested_listed_path_through_a_symlinked_directory_is_refused_on_open(tmp_path):
    """A listed `trainer/dcp/x` whose `dcp` became a symlink (to a copy elsewhere, with the
    same bytes) is not followed: the link is an unlisted entry."""
    store = CheckpointStore(tmp_path / "ck")

    def save(d: Path) -> None:
        (d / "dcp").mkdir()
        (d / "dcp" / "x").write_bytes(b"x")

    pub = store.publish(1, {}, {}, keep_last=None, saved={"trainer": save})
    outside = tmp_path / "outside"
    shutil.copytree(pub.path / "trainer" / "dcp", outside)
    shutil.rmtree(pub.path / "trainer" / "dcp")
    os.symlink(outside, pub.path / "trainer" / "dcp")
    assert_refused(store, ManifestMismatch, "trainer/dcp")
