"""Review of the training reader (`train.reader.ShardReader`) and the shards' read side."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.data.shards import Dataset, Sample, ShardWriter, verify
from draftsmith.errors import DraftsmithError
from draftsmith.train import reader as rd
from draftsmith.train.batches import Plan, batches
from draftsmith.train.sources import Head, check_whole

H = 8


def make(folder: Path, sizes: list[int], seed: int = 0, finish: bool = True,
         h: int = H, tokens: int = 0) -> Path:
    """A dataset of shards of `sizes` samples (ids "s0", "s1", ... in order)."""
    w = ShardWriter(folder, {"aux_layer_ids": [0, 1, 2], "hidden_size": h}, ())
    g, n = torch.Generator().manual_seed(seed), 0
    for k, size in enumerate(sizes):
        samples = []
        for _ in range(size):
            t = tokens or 5 + n % 7
            ids = torch.randint(0, 100, (t,), generator=g)
            aux, hidden = torch.randn(t, 3, h, generator=g), torch.randn(t, h, generator=g)
            samples.append(Sample(f"s{n}", ids, torch.ones(t, dtype=torch.bool), aux, hidden))
            n += 1
        w.write(k, samples)
    if finish:
        w.finish()
    return folder


def test_max_samples_over_uneven_shards_is_exactly_the_first_n_in_order(tmp_path):
    ds = Dataset(make(tmp_path / "d", [3, 1, 5, 2]))
    reader = rd.ShardReader(ds)
    head = Head(reader, 6)
    assert [reader.sample_id(i) for i in range(len(head))] == [f"s{i}" for i in range(6)]
    want = [ds[i] for i in range(6)]
    assert all(torch.equal(head[i][k], want[i][k]) for i in range(6) for k in want[i])
    assert [m.numel() for m in head.loss_masks()] == ds.lengths()[:6]
    assert [ids.numel() for ids, _ in head.token_pairs()] == ds.lengths()[:6]
    with pytest.raises(IndexError):
        head[6]
    assert rd.used_shards(ds.shards, 6) == 3 and rd.used_shards(ds.shards, 4) == 2


def test_a_shard_of_another_capture_in_its_place_is_refused_by_name(tmp_path):
    a, b = make(tmp_path / "a", [2, 2, 2]), make(tmp_path / "b", [2, 2, 2], seed=1)
    shard = a / "shard-00001.safetensors"
    shard.write_bytes((b / shard.name).read_bytes())
    m = json.loads((a / "manifest.json").read_text())
    m["shards"][1].update(bytes=shard.stat().st_size, sha256="0" * 64)  # a manifest edited too
    (a / "manifest.json").write_text(json.dumps(m))
    said = "shard-00001.safetensors: not the shard the manifest lists"
    with pytest.raises(DraftsmithError, match=said):
        rd.ShardReader(Dataset(a)).check_shapes(3, H)
    with pytest.raises(DraftsmithError, match=said):
        rd.ShardReader(Dataset(a))[2]


def test_unknown_manifest_keys_are_kept_and_ignored(tmp_path):
    d = make(tmp_path / "d", [2, 3])
    m = json.loads((d / "manifest.json").read_text())
    m["made_by"] = {"tool": "other"}
    m["shards"][0]["note"] = "x"
    (d / "manifest.json").write_text(json.dumps(m))
    ds = Dataset(d)
    assert ds.manifest["made_by"] == {"tool": "other"} and ds.shards[0]["note"] == "x"
    assert len(ds) == 5 and verify(d)["samples"] == 5
    assert rd.ShardReader(ds)[4]["hidden"].shape[-1] == H


def test_samples_are_read_in_manifest_order_alike_by_both_readers(tmp_path):
    d = make(tmp_path / "d", [1, 2, 3])
    m = json.loads((d / "manifest.json").read_text())
    m["shards"].reverse()
    (d / "manifest.json").write_text(json.dumps(m))
    ds = Dataset(d)
    reader = rd.ShardReader(ds)
    assert [ds.sample_id(i) for i in range(6)] == ["s3", "s4", "s5", "s1", "s2", "s0"]
    assert all(torch.equal(ds[i]["aux"], reader[i]["aux"]) for i in range(6))
    assert [x.numel() for x in reader.loss_masks()] == ds.lengths()


def test_a_capture_in_progress_is_refused_unless_its_first_shards_suffice(tmp_path):
    d = make(tmp_path / "d", [2, 3], finish=False)
    m = Dataset(d).manifest
    with pytest.raises(DraftsmithError, match="the capture is not complete .* --max-samples 5"):
        check_whole(d, m, None)
    with pytest.raises(DraftsmithError, match="the capture is not complete"):
        check_whole(d, m, 6)
    check_whole(d, m, 5)


@pytest.mark.parametrize("read", ["item", "masks", "pairs"])
def test_a_failing_shard_read_is_one_error_naming_the_shard(tmp_path, monkeypatch, read):
    """An I/O error (EIO, a network file system's ESTALE) on a sample read came out as a bare
    OSError without the shard's name: a loader worker's traceback, not one line."""
    reader = rd.ShardReader(Dataset(make(tmp_path / "d", [2, 2])))
    reader[0]  # the headers read: the failure is a sample's own read

    def fail(*_: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(rd.os, "preadv", fail)
    calls = {"item": lambda: reader[1], "masks": lambda: list(reader.loss_masks()),
             "pairs": lambda: list(reader.token_pairs())}
    with pytest.raises(DraftsmithError,
                       match=r"shard-00000.safetensors: cannot read the shard \(Input/output"):
        calls[read]()


def test_a_failing_read_in_a_loader_worker_is_one_error_not_a_hang(tmp_path, monkeypatch):
    ds = Dataset(make(tmp_path / "d", [4, 4]))
    reader = rd.ShardReader(ds)
    reader[0], reader[4]  # the headers read: the workers fail on a sample's own read
    reader.close()

    def fail(*_: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(rd.os, "preadv", fail)  # the forked workers inherit it
    plan = Plan(ds.lengths(), 1, max(ds.lengths()), 1, 0, 0)
    with pytest.raises(DraftsmithError, match="cannot read the shard"):
        list(batches(plan, reader, 0, 2, workers=2))


PEAK = """
import resource, sys
from draftsmith.data.shards import Dataset
from draftsmith.train.reader import ShardReader
r = ShardReader(Dataset(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r.check_shapes(3, 256)
for i in range(len(r)):
    r[i]
list(r.loss_masks())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_reading_a_dataset_streams_its_memory_does_not_grow_with_it(tmp_path):
    def peak_kib(shards: int) -> int:
        d = make(tmp_path / str(shards), [20] * shards, h=256, tokens=50)  # 2 MB a shard
        out = subprocess.run([sys.executable, "-c", PEAK, str(d)], capture_output=True,
                             text=True, check=True)
        return int(out.stdout.split()[-1])

    small, large = peak_kib(4), peak_kib(8)
    assert large - small < 4 * 1024, (small, large)  # 8 MB more data, under 4 MiB more memory
