"""Weight directories (`rollkeep.cluster.weightdirs`): what servers load is what the trainer
had, in the source model's layout, published all-or-nothing, refused when damaged and
rewritten by the next publication.

Crashes and faults run on the simulated disk (`rollkeep.simulate.memfs`): it forgets what was
never fsynced at a power cut, and a frozen process can run no clean-up, as under SIGKILL."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_fixture import make_tiny_hf_model  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rollkeep.cluster import weightdirs as wd  # noqa: E402
from rollkeep.cluster.weightdirs import (  # noqa: E402
    MODEL,
    WEIGHTS,
    WeightsDirError,
    WeightsSourceError,
    load_state_dict,
    publish,
    retain,
    verify,
)
from rollkeep.config.sections import HFTrainerConfig  # noqa: E402
from rollkeep.core.errors import CheckpointError  # noqa: E402
from rollkeep.core.io.untrusted import safetensors_header  # noqa: E402
from rollkeep.simulate.memfs import MemFS, SimCrash  # noqa: E402
from rollkeep.trainers.hf import HFTrainer  # noqa: E402

RUN = Path("/run")
SRC = Path("/model")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def trainer(source) -> HFTrainer:
    """The hf trainer on the tiny model, its weights moved away from the source's (as after
    some training), so a directory that still held the source's weights would show."""
    t = HFTrainer(HFTrainerConfig(model_path=str(source)), temperature=1.0, seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in t.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return t


@pytest.fixture(scope="module")
def weights(trainer) -> dict[str, torch.Tensor]:
    return trainer.weights()  # what the trainer hands engines: tied names share one tensor


def mapped(weights: dict, fn) -> dict:
    """`fn` of every tensor, tied names still sharing one tensor."""
    done: dict[int, torch.Tensor] = {}
    return {k: done.setdefault(id(v), fn(v)) for k, v in weights.items()}


def header_of(path: Path) -> dict:
    return safetensors_header(path.read_bytes())


def mem_source(source: Path, seed: int = 0) -> MemFS:
    """A simulated disk holding the source model at SRC (durably) and an empty RUN."""
    fs = MemFS(random.Random(seed))
    fs.makedirs_durable(SRC)
    fs.makedirs_durable(RUN)
    for p in sorted(source.iterdir()):
        fs.write(SRC / p.name, p.read_bytes())
        fs.fsync(SRC / p.name)
    return fs


def entries(fs, run: Path = RUN) -> list[str]:
    return [name for name, _ in fs.listdir(run / "weights")]


# -- the round trip ----------------------------------------------------------------------


def test_round_trip_loads_in_transformers_with_the_same_logits(source, trainer, weights, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = publish(tmp_path, 3, weights, source_dir=source)
    assert out.path == tmp_path / "weights" / "v3" and out.version == 3
    assert verify(out.path) == out
    assert out.label == f"rollkeep:3:{out.digest[:16]}"
    names = sorted(p.name for p in out.path.iterdir())
    copied = sorted(p.name for p in source.iterdir() if p.name != MODEL)
    assert names == sorted([*copied, MODEL, WEIGHTS])
    for name in copied:  # config and tokenizer files copied byte for byte
        assert (out.path / name).read_bytes() == (source / name).read_bytes()
    # The digest is sha256sum's listing of every file but WEIGHTS.json, hashed.
    listing = "".join(f"{hashlib.sha256((out.path / n).read_bytes()).hexdigest()}  {n}\n"
                      for n in sorted(names) if n != WEIGHTS)
    assert out.digest == hashlib.sha256(listing.encode()).hexdigest()
    assert out.nbytes == sum((out.path / n).stat().st_size for n in names)

    loaded = load_state_dict(out.path)
    assert set(loaded) == set(header_of(source / MODEL)) - {"__metadata__"}
    for name, t in loaded.items():
        assert t.dtype == weights[name].dtype and torch.equal(t, weights[name]), name

    served = AutoModelForCausalLM.from_pretrained(out.path, local_files_only=True).eval()
    x = torch.tensor([[1, 5, 9, 17, 30, 4]])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(served(x).logits, trainer.model(x).logits)
        original = AutoModelForCausalLM.from_pretrained(source, local_files_only=True).eval()
        assert not torch.equal(original(x).logits, served(x).logits)  # the weights did move
    trainer.model.train()
    tok = AutoTokenizer.from_pretrained(out.path, local_files_only=True)
    assert tok("1+2=")["input_ids"] == AutoTokenizer.from_pretrained(source)("1+2=")["input_ids"]


def test_tied_duplicates_are_left_out_as_the_source_left_them_out(source, weights, tmp_path) -> None:
    assert weights["lm_head.weight"] is weights["transformer.wte.weight"]  # tied in the trainer
    out = publish(tmp_path, 0, weights, source_dir=source)
    written, original = header_of(out.path / MODEL), header_of(source / MODEL)
    assert set(written) == set(original) and "lm_head.weight" not in written
    for name, spec in original.items():
        if name != "__metadata__":
            assert (written[name]["dtype"], written[name]["shape"]) == (spec["dtype"], spec["shape"])
    # The same tensors without the tie: lm_head is then a tensor the source does not have.
    untied = {**weights, "lm_head.weight": weights["lm_head.weight"].clone()}
    with pytest.raises(WeightsSourceError, match="not tied") as e:
        publish(tmp_path, 1, untied, source_dir=source)
    assert e.value.field == "lm_head.weight"


def mismatched(weights: dict) -> dict[str, tuple[dict, str]]:
    wte = "transformer.wte.weight"
    return {
        "missing": ({k: v for k, v in weights.items() if k != "transformer.ln_f.bias"}, "transformer.ln_f.bias"),
        "shape": ({**weights, wte: weights[wte][:-1]}, wte),
        "dtype": ({**weights, "transformer.ln_f.bias": weights["transformer.ln_f.bias"].to(torch.int32)},
                  "transformer.ln_f.bias"),
        "not a tensor": ({**weights, "transformer.ln_f.bias": [0.0] * 32}, "transformer.ln_f.bias"),
        "extra": ({**weights, "head.bias": torch.zeros(3)}, "head.bias"),
    }


@pytest.mark.parametrize("case", ["missing", "shape", "dtype", "not a tensor", "extra"])
def test_a_state_dict_that_does_not_fit_the_source_is_refused_before_anything_is_written(
        case, source, weights, tmp_path) -> None:
    state, name = mismatched(weights)[case]
    with pytest.raises(WeightsSourceError) as e:
        publish(tmp_path, 2, state, source_dir=source)
    assert e.value.field == name and e.value.expected and e.value.found and e.value.remedy
    assert not (tmp_path / "weights").exists()


def test_a_source_without_config_or_checkpoint_is_refused(source, weights, tmp_path) -> None:
    for missing in ("config.json", MODEL):
        src = tmp_path / f"no-{missing}"
        shutil.copytree(source, src)
        (src / missing).unlink()
        with pytest.raises(WeightsSourceError, match=missing.split(".")[0]):
            publish(tmp_path / "run", 0, weights, source_dir=src)
    with pytest.raises(ValueError):
        publish(tmp_path, -1, weights, source_dir=source)
    with pytest.raises(TypeError):
        publish(tmp_path, 0, weights, source_dir=source, dtype=torch.int8)


def test_a_sharded_source_with_int_buffers_becomes_one_file_and_only_floats_are_cast(tmp_path) -> None:
    src = tmp_path / "sharded"
    src.mkdir()
    (src / "config.json").write_text("{}")
    a = {"a.weight": torch.randn(4, 3), "a.index": torch.arange(5)}
    b = {"b.weight": torch.randn(2, dtype=torch.float64), "b.mask": torch.tensor([True, False])}
    save_file(a, src / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(b, src / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = {"weight_map": {**dict.fromkeys(a, "model-00001-of-00002.safetensors"),
                            **dict.fromkeys(b, "model-00002-of-00002.safetensors")}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    state = {**a, **b}
    out = publish(tmp_path, 1, state, source_dir=src, dtype=torch.bfloat16)
    assert sorted(p.name for p in out.path.iterdir()) == ["WEIGHTS.json", "config.json", MODEL]
    loaded = load_state_dict(out.path)
    assert {k: v.dtype for k, v in loaded.items()} == {
        "a.weight": torch.bfloat16, "b.weight": torch.bfloat16, "a.index": torch.int64, "b.mask": torch.bool}
    assert torch.equal(loaded["a.weight"], a["a.weight"].to(torch.bfloat16))
    assert torch.equal(loaded["a.index"], a["a.index"]) and torch.equal(loaded["b.mask"], b["b.mask"])


def test_symlinks_of_a_hugging_face_cache_snapshot_are_followed_and_copied_as_files(source, weights, tmp_path) -> None:
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for p in source.iterdir():
        shutil.copy(p, blobs / hashlib.sha256(p.name.encode()).hexdigest())
        (snap / p.name).symlink_to(blobs / hashlib.sha256(p.name.encode()).hexdigest())
    (tmp_path / "run").mkdir()
    out = publish(tmp_path / "run", 0, weights, source_dir=snap)
    assert not any(p.is_symlink() for p in out.path.iterdir())
    assert out.digest == publish(tmp_path, 0, weights, source_dir=source).digest


# -- a dtype cast ------------------------------------------------------------------------


def test_a_bf16_publication_serves_the_bf16_cast_of_the_weights(source, trainer, weights, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = publish(tmp_path, 5, weights, source_dir=source, dtype=torch.bfloat16)
    assert {v["dtype"] for k, v in header_of(out.path / MODEL).items() if k != "__metadata__"} == {"BF16"}
    full = publish(tmp_path, 6, weights, source_dir=source)
    assert (out.path / MODEL).stat().st_size < 0.6 * (full.path / MODEL).stat().st_size
    for name, t in load_state_dict(out.path).items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, weights[name].to(torch.bfloat16))
    served = AutoModelForCausalLM.from_pretrained(out.path, dtype=torch.bfloat16).eval()
    reference = AutoModelForCausalLM.from_pretrained(full.path, dtype=torch.bfloat16).eval()
    x = torch.tensor([[1, 5, 9, 17]])
    with torch.no_grad():
        assert torch.equal(served(x).logits, reference(x).logits)


# -- republishing ------------------------------------------------------------------------


class Counting(MemFS):
    """Counts the calls that change the disk."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.changes: list[str] = []

    def mkdir(self, path):
        self.changes.append(f"mkdir {path}")
        super().mkdir(path)

    def write(self, path, data):
        self.changes.append(f"write {path}")
        super().write(path, data)

    def open_append(self, path):
        self.changes.append(f"open_append {path}")
        return super().open_append(path)

    def rename(self, src, dst):
        self.changes.append(f"rename {src}")
        super().rename(src, dst)

    def rmtree(self, path):
        self.changes.append(f"rmtree {path}")
        super().rmtree(path)


def counting_source(source: Path) -> Counting:
    fs = Counting(random.Random(0))
    fs.makedirs_durable(SRC)
    fs.makedirs_durable(RUN)
    for p in sorted(source.iterdir()):
        fs.write(SRC / p.name, p.read_bytes())
    fs.changes.clear()
    return fs


def test_republishing_a_verified_version_writes_nothing(source, weights) -> None:
    fs = counting_source(source)
    first = publish(RUN, 4, weights, source_dir=SRC, fs=fs)
    fs.changes.clear()
    again = publish(RUN, 4, weights, source_dir=SRC, fs=fs)
    assert again == first and fs.changes == []


def test_a_verified_version_holding_other_weights_is_replaced(source, weights) -> None:
    """After --resume-from an older checkpoint, version 4 of the abandoned timeline is still
    on disk and verifies; the new timeline's version 4 holds other weights."""
    fs = counting_source(source)
    old = publish(RUN, 4, mapped(weights, lambda v: v + 1), source_dir=SRC, fs=fs)
    new = publish(RUN, 4, weights, source_dir=SRC, fs=fs)
    assert new.digest != old.digest and verify(RUN / "weights" / "v4", fs=fs) == new
    assert entries(fs) == ["v4"]
    assert torch.equal(load_state_dict(new.path, fs=fs)["transformer.wte.weight"], weights["transformer.wte.weight"])


# -- damage: refused by verify, rewritten by publish --------------------------------------


def _rewrite(path: Path, edit) -> None:
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(edit(data))


def _weights_json(path: Path, edit) -> None:
    fields = json.loads((path / WEIGHTS).read_text())
    edit(fields)
    (path / WEIGHTS).write_text(json.dumps(fields))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


DAMAGE = {
    "flipped byte in the weights": (lambda d: _rewrite(d / MODEL, lambda b: _flip(b, len(b) // 2)), "damaged"),
    "truncated weights": (lambda d: _rewrite(d / MODEL, lambda b: b[:-4]), "damaged"),
    "edited config": (lambda d: _rewrite(d / "config.json", lambda b: b.replace(b"gelu_new", b"relu")), "damaged"),
    "missing tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "missing: tokenizer.json"),
    "extra file": (lambda d: (d / "pytorch_model.bin").write_bytes(b"x"), "not listed: pytorch_model.bin"),
    "extra directory": (lambda d: (d / "sub").mkdir(), "not listed: sub"),
    "symlink": (lambda d: (os.rename(d / "config.json", d / "c"), (d / "config.json").symlink_to("c")),
                "not listed: c"),
    "symlink only": (lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.json").symlink_to("/etc/hostname")),
                     "not a regular file"),
    "FIFO": (lambda d: ((d / "tokenizer.json").unlink(), os.mkfifo(d / "tokenizer.json")), "not a regular file"),
    "truncated WEIGHTS.json": (lambda d: _rewrite(d / WEIGHTS, lambda b: b[: len(b) // 2]), "not JSON"),
    "empty WEIGHTS.json": (lambda d: _rewrite(d / WEIGHTS, lambda b: b""), "not JSON"),
    "no WEIGHTS.json": (lambda d: (d / WEIGHTS).unlink(), "cannot be read"),
    "WEIGHTS.json a FIFO": (lambda d: ((d / WEIGHTS).unlink(), os.mkfifo(d / WEIGHTS)), "cannot be read"),
    "wrong digest": (lambda d: _weights_json(d, lambda f: f.update(digest="0" * 64)), "digest"),
    "wrong version": (lambda d: _weights_json(d, lambda f: f.update(version=8)), "another version"),
    "version a string": (lambda d: _weights_json(d, lambda f: f.update(version="7")), "another version"),
    "extra field": (lambda d: _weights_json(d, lambda f: f.update(note="hi")), "fields"),
    "size a float": (lambda d: _weights_json(d, lambda f: (f["files"][MODEL].update(size=1.5),
                                                            f.update(digest=wd.digest_of(f["files"])))), "list"),
    "path in a name": (lambda d: _weights_json(d, lambda f: (f["files"].update({"../x": f["files"]["config.json"]}),
                                                              f.update(digest=wd.digest_of(f["files"])))), "list"),
    "consistent lie": (lambda d: _weights_json(d, lambda f: (f["files"][MODEL].update(sha256="ab" * 32),
                                                              f.update(digest=wd.digest_of(f["files"])))), "damaged"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_directory_is_refused_by_verify_and_rewritten_by_publish(damage, source, weights, tmp_path) -> None:
    good = publish(tmp_path, 7, weights, source_dir=source)
    harm, says = DAMAGE[damage]
    harm(good.path)
    with pytest.raises(WeightsDirError, match=says) as e:
        verify(good.path)
    assert isinstance(e.value, CheckpointError)
    assert e.value.path and e.value.expected and e.value.found is not None and e.value.remedy
    with pytest.raises(WeightsDirError):
        load_state_dict(good.path)
    again = publish(tmp_path, 7, weights, source_dir=source)
    assert again == good and verify(good.path) == good
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v7"]  # the bad one is gone


def test_verify_refuses_a_directory_not_named_for_its_version(source, weights, tmp_path) -> None:
    good = publish(tmp_path, 1, weights, source_dir=source)
    os.rename(good.path, tmp_path / "weights" / "latest")
    with pytest.raises(WeightsDirError, match="name"):
        verify(tmp_path / "weights" / "latest")
    # A v1 that is a symlink to a good directory elsewhere is not trusted, and is replaced;
    # its target is left alone.
    good.path.symlink_to(tmp_path / "weights" / "latest")
    with pytest.raises(WeightsDirError, match="not a weight directory"):
        verify(good.path)
    assert publish(tmp_path, 1, weights, source_dir=source) == good
    assert not good.path.is_symlink() and verify(good.path) == good
    assert sorted(p.name for p in (tmp_path / "weights" / "latest").iterdir()) == sorted(
        p.name for p in good.path.iterdir())


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_damage_is_refused_or_harmless_and_republishing_repairs_it(data, source, weights) -> None:
    fs = mem_source(source)
    good = publish(RUN, 2, weights, source_dir=SRC, fs=fs)
    name = data.draw(st.sampled_from(sorted(n for n, _ in fs.listdir(good.path))), label="file")
    raw = fs.read(good.path / name)
    how = data.draw(st.sampled_from(["flip", "truncate", "append"]), label="how")
    if how == "flip":
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        bit = data.draw(st.integers(0, 7), label="bit")
        damaged = raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1:]
    elif how == "truncate":
        damaged = raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")]
    else:
        damaged = raw + data.draw(st.binary(min_size=1, max_size=16), label="tail")
    fs.unlink(good.path / name)
    fs.write(good.path / name, damaged)
    try:
        still = verify(good.path, fs=fs)
    except WeightsDirError:
        pass
    else:  # only WEIGHTS.json can change and still say the same (e.g. its whitespace)
        assert name == WEIGHTS and still == good
    assert publish(RUN, 2, weights, source_dir=SRC, fs=fs) == good
    assert verify(good.path, fs=fs) == good and entries(fs) == ["v2"]


# -- crashes and faults -------------------------------------------------------------------


class Dies(MemFS):
    """The simulated process dies at its n-th call to the disk (reads included)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls, self.die_at = 0, None

    def _alive(self) -> None:
        self.calls += 1
        if self.calls == self.die_at:
            self.freeze(SimCrash(f"killed at call {self.calls}"))
        super()._alive()


def dying_source(source: Path) -> Dies:
    fs = Dies(random.Random(0))
    fs.makedirs_durable(SRC)
    fs.makedirs_durable(RUN)
    for p in sorted(source.iterdir()):
        fs.write(SRC / p.name, p.read_bytes())
        fs.fsync(SRC / p.name)
    fs.fsync(SRC)
    return fs


@pytest.mark.parametrize("before", ["nothing", "damaged v5", "older version"])
def test_a_crash_at_every_call_leaves_no_version_or_a_verified_one(before, source, weights) -> None:
    """Kill the publication at each of its calls to the disk, with or without a power cut
    after it: `v5/` is then absent, the one that was there, or the new one verified; the next
    publication completes it and leaves no leftover."""
    new = mapped(weights, lambda v: v * 0.5)

    def prepared() -> tuple[Dies, str | None]:
        fs = dying_source(source)
        old = None
        if before == "damaged v5":
            publish(RUN, 5, weights, source_dir=SRC, fs=fs)
            fs.unlink(RUN / "weights" / "v5" / "config.json")
            fs.write(RUN / "weights" / "v5" / "config.json", b"{}")
            fs.fsync(RUN / "weights" / "v5" / "config.json")
            fs.fsync(RUN / "weights" / "v5")
        elif before == "older version":
            old = publish(RUN, 4, weights, source_dir=SRC, fs=fs).digest
        fs.calls = 0
        return fs, old

    fs, _ = prepared()
    expected = publish(RUN, 5, new, source_dir=SRC, fs=fs)
    total = fs.calls
    assert total > 20
    fs.power_cut()  # what publish returned is durable
    assert verify(RUN / "weights" / "v5", fs=fs) == expected
    for die_at in range(1, total + 1):
        for power_cut in (False, True):
            fs, old = prepared()
            fs.die_at = die_at
            with pytest.raises(SimCrash):
                publish(RUN, 5, new, source_dir=SRC, fs=fs)
            fs.die_at = None
            if power_cut:
                fs.power_cut()
            else:
                fs.kill()
            if fs.kind_of(RUN / "weights" / "v5") is not None:
                try:
                    assert verify(RUN / "weights" / "v5", fs=fs) == expected
                except WeightsDirError:
                    assert before == "damaged v5", (die_at, power_cut)  # the one that was there
            if old is not None:
                assert verify(RUN / "weights" / "v4", fs=fs).digest == old
            assert publish(RUN, 5, new, source_dir=SRC, fs=fs) == expected
            assert entries(fs) == (["v4", "v5"] if old else ["v5"]), (die_at, power_cut)


class Fails(MemFS):
    """From its n-th call of `kind` (write, fsync, rename, mkdir; "any": those and rmtree,
    unlink) the disk fails with EIO: that call only, or with `sticky` every later one too (a
    disk that died, so clean-up fails as well). A failed write may leave a prefix."""

    def __init__(self, kind: str | None = None, n: int = 0, *, sticky: bool = False) -> None:
        super().__init__(random.Random(n))
        self.kind, self.n, self.sticky = kind, n, sticky
        self.count = 0

    def _hit(self, what: str, path) -> None:
        if self.kind in (what, "any"):
            self.count += 1
            if self.count == self.n or (self.sticky and self.count > self.n):
                raise OSError(errno.EIO, f"injected {what} failure #{self.count}", str(path))

    def _fault(self, what, path):  # write, fsync, rename (an open file's writes and fsyncs too)
        self._hit(what, path)

    def mkdir(self, path):
        self._alive()
        self._hit("mkdir", path)
        super().mkdir(path)

    def rmtree(self, path):
        self._alive()
        self._hit("rmtree", path)
        super().rmtree(path)

    def unlink(self, path):
        self._alive()
        self._hit("unlink", path)
        super().unlink(path)


def failing_source(source: Path, kind: str, n: int, *, sticky: bool = False) -> Fails:
    fs = Fails()
    fs.makedirs_durable(RUN)
    fs.makedirs_durable(SRC)
    for p in sorted(source.iterdir()):
        fs.write(SRC / p.name, p.read_bytes())
    fs.kind, fs.n, fs.sticky = kind, n, sticky
    return fs


@pytest.mark.parametrize("kind", ["write", "fsync", "rename", "mkdir"])
def test_a_failed_call_leaves_no_version_and_raises_oserror(kind, source, weights) -> None:
    n = 1
    while True:
        fs = failing_source(source, kind, n)
        try:
            out = publish(RUN, 3, weights, source_dir=SRC, fs=fs)
        except OSError as e:
            assert "injected" in str(e)
            assert fs.kind_of(RUN / "weights") is None or entries(fs) == [], (kind, n)
            n += 1
            continue
        assert fs.count < n and verify(out.path, fs=fs) == out  # each call of `kind` failed once
        break
    assert n > 1


def test_a_disk_that_dies_mid_publication_leaves_no_version_or_a_verified_one(source, weights) -> None:
    """Every call from the n-th on fails, the clean-up's too; then the disk is replaced by
    one that works (the same files on it), and the next publication completes the version."""
    expected = publish(RUN, 3, weights, source_dir=SRC, fs=failing_source(source, None, 0))
    n = 1
    while True:
        fs = failing_source(source, "any", n, sticky=True)
        try:
            publish(RUN, 3, weights, source_dir=SRC, fs=fs)
        except OSError:
            pass
        else:
            break
        if fs.kind_of(RUN / "weights" / "v3") is not None:
            assert verify(RUN / "weights" / "v3", fs=fs) == expected, n
        fs.kind = None
        assert publish(RUN, 3, weights, source_dir=SRC, fs=fs) == expected
        assert entries(fs) == ["v3"], n
        n += 1
    assert n > 10


def test_a_real_fsync_failure_removes_the_temporary_directory(source, weights, tmp_path) -> None:
    from rollkeep.core.io.fs import FS

    class FailingFsync(FS):
        def __init__(self, n: int) -> None:
            self.n, self.count = n, 0

        def fsync(self, path):
            self.count += 1
            if self.count == self.n:
                raise OSError(errno.EIO, "injected fsync failure", str(path))
            super().fsync(path)

    clean = FailingFsync(0)
    (tmp_path / "clean").mkdir()
    publish(tmp_path / "clean", 1, weights, source_dir=source, fs=clean)
    assert clean.count >= 8
    for n in range(1, clean.count + 1):
        with pytest.raises(OSError, match="injected"):
            publish(tmp_path, 1, weights, source_dir=source, fs=FailingFsync(n))
        assert list((tmp_path / "weights").iterdir()) == [], n


def test_leftovers_of_a_crash_are_removed_at_the_next_publication(source, weights, tmp_path) -> None:
    root = tmp_path / "weights"
    for name in ("v2.tmp-00ff", "v9.bad-abc1"):
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(b"half")
    (root / "v3.tmp-1234").write_bytes(b"")
    (root / "README").write_text("not ours")
    publish(tmp_path, 2, weights, source_dir=source)
    assert sorted(p.name for p in root.iterdir()) == ["README", "v2"]


# -- retention ---------------------------------------------------------------------------


def small_source(fs: MemFS) -> None:
    """A one-tensor model at SRC, so retention examples publish many versions quickly."""
    fs.makedirs_durable(SRC)
    fs.makedirs_durable(RUN)
    from safetensors.torch import save

    fs.write(SRC / "config.json", b"{}")
    fs.write(SRC / MODEL, save({"w": torch.zeros(2, 3)}, metadata={"format": "pt"}))


@settings(max_examples=30, deadline=None)
@given(present=st.sets(st.integers(0, 7)), keep=st.sets(st.integers(0, 9)),
       leftovers=st.sets(st.sampled_from(["v1.tmp-ab", "v3.bad-0c", "v12.tmp-ff"])))
def test_retention_keeps_exactly_the_versions_asked_for(present, keep, leftovers) -> None:
    fs = MemFS(random.Random(0))
    small_source(fs)
    digests = {v: publish(RUN, v, {"w": torch.full((2, 3), float(v))}, source_dir=SRC, fs=fs).digest
               for v in sorted(present)}
    root = RUN / "weights"
    fs.makedirs_durable(root)
    for name in leftovers:
        fs.mkdir(root / name)
    fs.write(root / "notes.txt", b"mine")
    fs.mkdir(root / "v007")  # not a name of ours (a leading zero): never touched
    result = retain(RUN, keep, fs=fs)
    assert result.failed == ()
    assert set(result.removed) == {f"v{v}" for v in present - keep} | leftovers
    assert entries(fs) == sorted([*(f"v{v}" for v in present & keep), "notes.txt", "v007"])
    for v in present & keep:
        assert verify(root / f"v{v}", fs=fs).digest == digests[v]


def test_retention_reports_what_it_cannot_delete_and_keeps_going(source, weights) -> None:
    class NoRmtree(MemFS):
        def rmtree(self, path):
            if "v1" in Path(path).name:
                raise OSError(errno.EBUSY, "injected", str(path))
            super().rmtree(path)

    fs = NoRmtree(random.Random(0))
    small_source(fs)
    for v in (1, 2, 3):
        publish(RUN, v, {"w": torch.ones(2, 3)}, source_dir=SRC, fs=fs)
    result = retain(RUN, {3}, fs=fs)
    assert result.removed == ("v2",) and [name for name, _ in result.failed] == ["v1"]
    assert "injected" in result.failed[0][1]
    names = entries(fs)
    assert "v3" in names and "v1" not in names and "v2" not in names  # v1 is a leftover now
    with pytest.raises(ValueError):
        retain(RUN, {-1}, fs=fs)
