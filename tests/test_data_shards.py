"""Shard writer and Dataset reader: round trip, resume refusal, tamper detection."""

from __future__ import annotations

import json
import re

import pytest
import torch

from draftsmith.data.shards import MANIFEST, Dataset, Sample, ShardWriter, verify
from draftsmith.errors import DraftsmithError

HEADER = {"aux_layer_ids": [0, 2], "hidden_size": 8, "target": {"fingerprint": "abc"}}
IDENTITY = ("aux_layer_ids", "hidden_size", "target")


def make_samples(n: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 3 + i % 5
        out.append(Sample(
            f"s{seed}-{i}", torch.randint(0, 100, (t,), generator=g),
            torch.rand(t, generator=g) > 0.5, torch.randn(t, 2, 8, generator=g),
            torch.randn(t, 8, generator=g),
        ))
    return out


def write(folder, chunks):
    w = ShardWriter(folder, HEADER, IDENTITY)
    for k, chunk in enumerate(chunks):
        w.write(k, chunk)
    w.finish()
    return w


def test_round_trip(tmp_path):
    a, b = make_samples(4), make_samples(3, seed=1)
    write(tmp_path, [a, b])
    ds = Dataset(tmp_path)
    assert len(ds) == 7
    assert ds.manifest["totals"]["samples"] == 7 and ds.manifest["complete"]
    for i, s in enumerate(a + b):
        got = ds[i]
        assert got["input_ids"].dtype == torch.long and torch.equal(got["input_ids"], s.input_ids)
        assert got["loss_mask"].dtype == torch.bool and torch.equal(got["loss_mask"], s.loss_mask)
        assert got["aux"].dtype == torch.bfloat16
        assert torch.equal(got["aux"], s.aux.bfloat16())
        assert torch.equal(got["hidden"], s.hidden.bfloat16())
        assert ds.sample_id(i) == s.sample_id
    assert ds.lengths() == [len(s.input_ids) for s in a + b]
    assert verify(tmp_path)["tokens"] == sum(len(s.input_ids) for s in a + b)
    with pytest.raises(IndexError):
        ds[7]


def test_reopen_with_other_settings_is_refused(tmp_path):
    write(tmp_path, [make_samples(2)])
    with pytest.raises(DraftsmithError, match="different aux_layer_ids"):
        ShardWriter(tmp_path, {**HEADER, "aux_layer_ids": [1, 2]}, IDENTITY)
    assert ShardWriter(tmp_path, HEADER, IDENTITY).done() == {0}


def test_tampered_shard_is_named(tmp_path):
    write(tmp_path, [make_samples(2), make_samples(2, seed=3)])
    path = tmp_path / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DraftsmithError, match="shard-00001.*sha256"):
        verify(tmp_path)


def test_missing_shard_and_wrong_counts_are_named(tmp_path):
    write(tmp_path, [make_samples(2), make_samples(2, seed=3)])
    m = json.loads((tmp_path / MANIFEST).read_text())
    m["shards"][0]["tokens"] += 1
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DraftsmithError, match="shard-00000.*input_ids"):
        verify(tmp_path)
    (tmp_path / "shard-00001.safetensors").unlink()
    m["shards"][0]["tokens"] -= 1
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DraftsmithError, match="shard-00001.*missing"):
        verify(tmp_path)


def test_not_a_dataset(tmp_path):
    with pytest.raises(DraftsmithError, match="no manifest.json"):
        Dataset(tmp_path)


def test_a_typod_or_file_dataset_path_is_named_as_such(tmp_path):
    """A path that does not exist read "no manifest.json (not a draftsmith dataset folder)",
    as if the folder were there; a file read the same."""
    with pytest.raises(DraftsmithError, match=r"datset: no such file or folder$"):
        Dataset(tmp_path / "datset")
    (tmp_path / "a.jsonl").write_text("{}\n")
    with pytest.raises(DraftsmithError, match=r"a.jsonl: is a file, not a draftsmith dataset"):
        Dataset(tmp_path / "a.jsonl")


def test_many_shards_keep_few_files_open(tmp_path, monkeypatch):
    import draftsmith.data.shards as shards

    monkeypatch.setattr(shards, "OPEN_SHARDS", 2)
    samples = make_samples(5)
    write(tmp_path, [[s] for s in samples])
    ds = Dataset(tmp_path)
    for i in (0, 1, 2, 3, 4, 0, 4):
        assert torch.equal(ds[i]["input_ids"], samples[i].input_ids)
        assert len(ds._open) <= 2
    import pickle

    again = pickle.loads(pickle.dumps(ds))
    assert torch.equal(again[3]["hidden"], samples[3].hidden.bfloat16())


def test_damaged_shard_is_named_by_inspect_and_the_reader(tmp_path):
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    head = {**HEADER, "target": {"fingerprint": "abc", "source": "t", "num_layers": 4},
            "aux_convention": "output of j", "dtype": "bfloat16"}
    w = ShardWriter(tmp_path, head, IDENTITY)
    w.write(0, make_samples(2))
    w.finish()
    assert CliRunner().invoke(app, ["inspect", str(tmp_path)]).exit_code == 0
    shard = tmp_path / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:500])
    for flags, why in (([], "500 bytes, the manifest says"), (["--no-verify"], "unreadable shard")):
        res = CliRunner().invoke(app, ["inspect", str(tmp_path), *flags])
        assert isinstance(res.exception, DraftsmithError), res.output
        assert str(shard) in str(res.exception) and why in str(res.exception)
    with pytest.raises(DraftsmithError, match="shard-00000.safetensors: unreadable shard"):
        Dataset(tmp_path)[0]


def test_manifest_of_the_wrong_shape_is_named(tmp_path):
    cases = {"[]": "manifest.json: expected a JSON object, got list",
             json.dumps({"format": "draftsmith-dataset"}): "'shards' is not a list",
             json.dumps({"format": "draftsmith-dataset", "format_version": "x"}):
                 "format_version is 'x'",
             json.dumps({"format": "draftsmith-dataset", "format_version": 1,
                         "shards": [{"index": 0, "file": "shard-00000.safetensors"}]}):
                 r"shard entry 0 lacks samples \(int\), tokens \(int\)"}
    for text, why in cases.items():
        (tmp_path / MANIFEST).write_text(text)
        with pytest.raises(DraftsmithError, match=why):
            Dataset(tmp_path)


def test_a_file_where_the_folder_goes_is_refused(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("notes\n")
    with pytest.raises(DraftsmithError, match="keep.txt: is a file, not a folder"):
        ShardWriter(keep, HEADER, IDENTITY)
    assert keep.read_text() == "notes\n"


def test_an_atomic_write_that_fails_keeps_the_old_file_and_leaves_no_tmp(tmp_path, monkeypatch):
    import os

    from draftsmith.data import atomic

    path = tmp_path / "m.json"
    path.write_text("old")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(DraftsmithError, match="m.json: cannot write it .No space left"):
        atomic.atomic_write(path, b"new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["m.json"]


def _rewrite(folder, k: int, **change) -> None:
    """Shard k's tensors changed (name -> function of the tensor), the manifest's size and
    sha256 updated: a shard another tool wrote."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save

    path = folder / f"shard-{k:05d}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()  # noqa: SIM118
    tensors.update({n: fn(tensors[n]) for n, fn in change.items()})
    raw = save(tensors, metadata=meta)
    path.write_bytes(raw)
    m = json.loads((folder / MANIFEST).read_text())
    m["shards"][k].update(sha256=hashlib.sha256(raw).hexdigest(), bytes=len(raw))
    m["totals"]["bytes"] = sum(s["bytes"] for s in m["shards"])
    (folder / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize(("name", "fn", "said"), [
    ("aux", lambda t: t.half(), "{'aux': 'float16'}, the manifest implies {'aux': 'bfloat16'}"),
    ("hidden", lambda t: t.float(), "{'hidden': 'float32'}"),
    ("input_ids", lambda t: t.long(), "{'input_ids': 'int64'}, the manifest implies "
                                      "{'input_ids': 'int32'}"),
])
def test_verify_checks_dtypes(tmp_path, name, fn, said):
    """A float16 aux of the right shape passed `verify` (it checked shapes only)."""
    from draftsmith.data.shards import ShardDtypeError

    write(tmp_path, [make_samples(2), make_samples(2, seed=3)])
    _rewrite(tmp_path, 1, **{name: fn})
    with pytest.raises(ShardDtypeError, match="shard-00001.safetensors: tensor dtypes "
                       + re.escape(said)):
        verify(tmp_path)


def test_verify_follows_the_manifests_dtype(tmp_path):
    write(tmp_path, [make_samples(2)])
    _rewrite(tmp_path, 0, aux=lambda t: t.half(), hidden=lambda t: t.half())
    m = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / MANIFEST).write_text(json.dumps({**m, "dtype": "float16"}))
    assert verify(tmp_path)["shards"] == 1


def test_verify_hashes_only_the_shards_named(tmp_path, monkeypatch):
    """Sizes, shapes and dtypes of every shard; sha256 of those named (all when none are)."""
    import draftsmith.data.shards as shards

    write(tmp_path, [make_samples(2, seed=k) for k in range(3)])
    path = tmp_path / "shard-00002.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # same size: only its hash tells
    path.write_bytes(bytes(raw))
    hashed: list[str] = []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    assert verify(tmp_path, hashed=[0])["shards"] == 3
    assert hashed == ["shard-00000.safetensors"]
    with pytest.raises(DraftsmithError, match="shard-00002.*sha256"):
        verify(tmp_path)
    path.write_bytes(bytes(raw[:-1]))
    with pytest.raises(DraftsmithError, match="shard-00002.*bytes, the manifest says"):
        verify(tmp_path, hashed=[])


def test_a_manifest_counting_more_samples_than_a_shard_holds_is_named(tmp_path):
    """Reading a sample past the shard's offsets was an IndexError (a traceback from the
    doctor's prompt scan, the trainer's reader)."""
    write(tmp_path, [make_samples(2), make_samples(2, seed=3)])
    m = json.loads((tmp_path / MANIFEST).read_text())
    m["shards"][0]["samples"] += 1
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    ds = Dataset(tmp_path)
    for read in (lambda: ds[2], lambda: ds[1], lambda: ds.tokens(0), ds.lengths):
        with pytest.raises(DraftsmithError, match="shard-00000.safetensors: offsets for 2 "
                           "samples, the manifest says 3"):
            read()
