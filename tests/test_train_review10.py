"""Review of training's start order: refusals that need no target (a dataset folder without a
manifest, a capture not complete for --max-samples, an --out holding a run without --resume)
come before the target loads, which takes seconds to minutes on a real model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.train import loop
from draftsmith.train.loop import TrainConfig, train


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


@pytest.fixture
def no_target(monkeypatch):
    """Loading the target fails the test: the refusal had to come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(loop, "resolve_target", refuse)


def unfinished(root: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "killed"
    shutil.copytree(root / "data", folder)
    m = json.loads((folder / "manifest.json").read_text())
    m.update(shards=m["shards"][:1], complete=False, expected={"shards": 3, "samples": 24})
    (folder / "manifest.json").write_text(json.dumps(m))
    return folder


def run(tmp_path: Path, data: Path, **over) -> Path:
    return train(TrainConfig(out=str(tmp_path / "run"), data=str(data), target="unused",
                             device="cpu", progress=False, **over))


def test_a_capture_not_complete_is_refused_before_the_target_loads(root, tmp_path, no_target):
    with pytest.raises(DraftsmithError, match=r"the capture is not complete \(1 of 3 shards"):
        run(tmp_path, unfinished(root, tmp_path))


def test_max_samples_within_the_first_shards_still_passes_the_early_check(root, tmp_path,
                                                                         no_target):
    """The early check is the same as open_offline's: 8 samples of a 1-shard capture pass it
    (the target load comes next, here the fake's AssertionError)."""
    with pytest.raises(AssertionError, match="target was loaded"):
        run(tmp_path, unfinished(root, tmp_path), max_samples=8)


def test_a_folder_without_a_manifest_is_refused_before_the_target_loads(tmp_path, no_target):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftsmithError, match="manifest.json"):
        run(tmp_path, tmp_path / "empty")


def test_an_out_holding_a_run_is_refused_before_the_target_loads(root, tmp_path, no_target):
    (tmp_path / "run" / "checkpoints" / "step-00000005").mkdir(parents=True)
    (tmp_path / "run" / "draftsmith.json").write_text("{}")
    with pytest.raises(DraftsmithError, match="already holds a training run"):
        run(tmp_path, root / "data")
