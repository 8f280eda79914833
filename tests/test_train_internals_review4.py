"""Training internals, review 4: training's own shard reader checks each shard's metadata
against its manifest entry where it reads the header, so a shard renamed or moved in from
another dataset (as many bytes) is refused by name, not read silently; a shard written before
shards described themselves reads as before."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from test_train_helpers import AUX, write_dataset

from draftsmith.data.shards import Dataset, read_manifest, sha256_file
from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target
from draftsmith.train.reader import ShardReader
from draftsmith.train.sources import open_offline

# shard_meta's keys: what a shard written before it lacks
DESCRIBED = ("format", "index", "samples", "tokens", "tokens_sha256", "dtype", "hidden_size",
             "aux_layer_ids", "aux_convention", "target_fingerprint")


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_llama_dir):
    """Two datasets of two shards each, of the same sample lengths (13 a shard: the helpers'
    lengths repeat every 13), so their shards are of as many bytes; other tokens (seed)."""
    root = tmp_path_factory.mktemp("internals4")
    target = load_target(tiny_llama_dir)
    for name, seed in (("a", 0), ("b", 1)):
        write_dataset(root / name, target, n=26, per_shard=13, seed=seed)
    return root, target


@pytest.fixture
def data(made, tmp_path):
    root, target = made
    for name in ("a", "b"):
        shutil.copytree(root / name, tmp_path / name)
    return tmp_path / "a", tmp_path / "b", target


def shard(folder: Path, k: int) -> Path:
    return folder / f"shard-{k:05d}.safetensors"


def refused(path: Path, fault: str) -> str:
    return (rf"^{path}: not the shard the manifest lists \({fault}\): renamed, or moved here "
            "from another dataset; put the right file back or capture the dataset again$")


def swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".tmp")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


def everything(reader: ShardReader) -> list:
    return ([reader[i] for i in range(len(reader))], list(reader.loss_masks()),
            list(reader.token_pairs()))


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y, strict=True))


def strip_meta(path: Path, folder: Path) -> bytes:
    """Shard `path` as written before shards described themselves, of as many bytes (its
    header padded), its manifest entry's sha256 updated; returns the header written."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    head["__metadata__"] = {k: v for k, v in head["__metadata__"].items() if k not in DESCRIBED}
    text = json.dumps(head).encode().ljust(n)
    path.write_bytes(raw[:8] + text + raw[8 + n :])
    m = read_manifest(folder)
    m["shards"][int(path.stem[-5:])]["sha256"] = sha256_file(path)
    (folder / "manifest.json").write_text(json.dumps(m))
    return text


def test_two_shards_swapped_are_refused_by_trainings_reader(data):
    """Shards 0 and 1 swapped (as many samples): each sample of shard 0 was read from shard 1.
    The dataset untouched trains as the mmap reader reads it."""
    a, _, target = data
    ds = Dataset(a)
    reader = open_offline(a, target, None).reader
    assert same(everything(reader)[0], [ds[i] for i in range(len(ds))])
    swap(shard(a, 0), shard(a, 1))
    why = refused(shard(a, 0), "its metadata says index 1, the manifest 0")
    with pytest.raises(DraftsmithError, match=why):
        ShardReader(Dataset(a))[0]
    with pytest.raises(DraftsmithError, match=why):
        list(ShardReader(Dataset(a)).token_pairs())
    with pytest.raises(DraftsmithError, match=why):
        ShardReader(Dataset(a)).check_shapes(len(AUX), target.cfg.hidden_size)
    with pytest.raises(DraftsmithError, match=refused(shard(a, 1), "its metadata says index 0, "
                                                      "the manifest 1")):
        ShardReader(Dataset(a))[13]


def test_a_shard_moved_in_from_another_dataset_is_refused_one_without_metadata_reads(data):
    """The run's Dataset read its shards' offsets (and metadata) first; a shard of another
    dataset (as many bytes) moved in before training's reader opened it was read as this
    one's. A shard written before shards described themselves trains as before."""
    a, b, target = data
    want = everything(ShardReader(Dataset(a)))
    text = strip_meta(shard(a, 1), a)
    reader = open_offline(a, target, None).reader
    assert same(everything(reader), want)
    assert set(reader.check_hashes(26, {})) == {shard(a, k).name for k in (0, 1)}
    # one of another dataset without metadata: nothing but its sha256 tells it apart
    raw = shard(b, 1).read_bytes()
    (a / "other").write_bytes(raw[:8] + text + raw[8 + len(text) :])
    os.replace(a / "other", shard(a, 1))
    reader = open_offline(a, target, None).reader
    with pytest.raises(DraftsmithError, match=rf"^{shard(a, 1)}: sha256 \w+\.\.\. does not "):
        reader.check_hashes(26, {})
    assert shard(a, 0).stat().st_size == shard(b, 0).stat().st_size
    ds = Dataset(a)
    ds.lengths()
    os.replace(shutil.copy(shard(b, 0), a / "other"), shard(a, 0))
    with pytest.raises(DraftsmithError, match=refused(
            shard(a, 0), r"its metadata says tokens_sha256 \w+, the manifest \w+")):
        open_offline(a, target, None, dataset=ds)
