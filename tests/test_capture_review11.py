"""Capture, eleventh review: an explicit --device cuda:N under torchrun put every rank's target
on one GPU; a dataset's manifest.json given for its folder said only that it is a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.data.capture import CaptureConfig, capture, rank_device
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import Dataset, read_manifest, verify
from draftsmith.errors import DraftsmithError

CFG = CaptureConfig(aux_layer_ids=[-1, 0, 5], batch_size=2, samples_per_shard=2, max_len=64)


def convs(n: int = 3) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"q{i}?"},
                          {"role": "assistant", "content": f"a{i}."}]) for i in range(n)]


def as_rank(monkeypatch, rank: int, world: int, local: int | None = None) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(rank if local is None else local))


def test_an_explicit_gpu_under_torchrun_is_refused_before_anything_is_written(
        target, model, tmp_path, monkeypatch):
    """Rank 1 of `torchrun --nproc-per-node 2 ... --device cuda:0` built its target on cuda:0
    beside rank 0's (GPU 1 idle, GPU 0 out of memory), after writing its folder."""
    as_rank(monkeypatch, 1, 2)
    out = tmp_path / "d"
    cfg = CaptureConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "device": "cuda:0"})
    with pytest.raises(DraftsmithError) as e:
        capture(target, convs(), out, cfg, progress=False, model=model, log=lambda s: None)
    assert str(e.value) == ("--device cuda:0: rank 1 runs on cuda:1 (its local rank), not beside "
                            "the other ranks on cuda:0; give --device cuda")
    assert not out.exists()


def test_each_rank_keeps_its_own_gpu(monkeypatch):
    as_rank(monkeypatch, 1, 2)
    assert rank_device("cuda") == "cuda:1"
    assert rank_device("cuda:1") == "cuda:1"
    assert rank_device("cpu") == "cpu"
    as_rank(monkeypatch, 3, 4, local=1)  # a second node's: its local rank's GPU
    assert rank_device("cuda:1") == "cuda:1"
    with pytest.raises(DraftsmithError, match="rank 3 runs on cuda:1"):
        rank_device("cuda:3")


def test_one_process_runs_on_the_gpu_it_names(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert rank_device("cuda:1") == "cuda:1"
    as_rank(monkeypatch, 0, 1)  # torchrun of one process: no other rank shares its GPU
    assert rank_device("cuda:1") == "cuda:1"


def test_a_manifest_given_for_its_dataset_names_the_folder(target, model, tmp_path):
    out = tmp_path / "d"
    capture(target, convs(), out, CFG, progress=False, model=model, log=lambda s: None)
    for read in (read_manifest, Dataset, verify):
        with pytest.raises(DraftsmithError) as e:
            read(out / "manifest.json")
        assert str(e.value) == (f"{out / 'manifest.json'}: the dataset's manifest, not its "
                                f"folder; pass {out}")


def test_another_file_given_for_a_dataset_is_still_a_file(tmp_path: Path):
    f = tmp_path / "notes.json"
    f.write_text("{}\n")
    with pytest.raises(DraftsmithError, match="is a file, not a draftsmith dataset folder"):
        Dataset(f)
