"""Review of training's data sources: a capture not yet complete, a rank's part of a
multi-process capture and a dataset whose recorded target is not there are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_cli_review import run_main

from draftsmith.errors import DraftsmithError
from draftsmith.train.sources import open_offline, resolve_target

CAPTURE = "draftsmith data capture answers.jsonl --out ds"


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def edited(root: Path, name: str, **over) -> Path:
    """A copy of the 24-sample, 3-shard dataset with its manifest's fields `over`."""
    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(root / "data", folder)
    m = json.loads((folder / "manifest.json").read_text())
    m.update(over)
    (folder / "manifest.json").write_text(json.dumps(m))
    return folder


def unfinished(root: Path, name: str, keep: list[int]) -> Path:
    """The capture killed with the shards `keep` written of its 3 (24 samples)."""
    m = json.loads((root / "data" / "manifest.json").read_text())
    shards = [s for s in m["shards"] if s["index"] in keep]
    return edited(root, name, shards=shards, complete=False, commands=[CAPTURE],
                  expected={"shards": 3, "samples": 24, "tokens": 0})


def test_a_capture_not_complete_is_refused_by_name(root, target):
    """A capture killed or still running trained on its shards there without a word (only the
    doctor warned): the run learnt from part of the data and recorded it as the dataset."""
    folder = unfinished(root, "killed", [0, 1])
    with pytest.raises(DraftsmithError) as e:
        open_offline(folder, target, None)
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"{folder}: the capture is not complete "
                                                "(2 of 3 shards, 16 of 24 samples")
    assert f"`{CAPTURE}`" in said and "--max-samples 16" in said


def test_a_capture_killed_before_its_first_shard_says_so(root, target):
    """It said only "the dataset has no finished shards", not that the capture is unfinished."""
    folder = unfinished(root, "none_yet", [])
    with pytest.raises(DraftsmithError, match=r"not complete \(0 of 3 shards, 0 of 24 samples.*"
                       r"to finish it, then train$"):
        open_offline(folder, target, 8)


def test_max_samples_within_its_first_shards_trains_on_them(root, target):
    """--max-samples asks for the first N samples, which the shards written first hold as the
    finished capture will: allowed up to them, refused past them."""
    folder = unfinished(root, "running", [0, 1])
    data = open_offline(folder, target, 16)
    assert data.summary["samples"] == 16 and len(data.lengths) == 16
    with pytest.raises(DraftsmithError, match="2 of 3 shards"):
        open_offline(folder, target, 17)


def test_a_gap_in_the_shards_counts_only_the_shards_before_it(root, target):
    """Shards 0 and 2 of 3 (a --grow run that dropped shard 1): the samples of shard 2 are not
    the finished capture's samples 8-15, so only shard 0's 8 samples may be trained on."""
    folder = unfinished(root, "gap", [0, 2])
    with pytest.raises(DraftsmithError, match=r"--max-samples 8 "):
        open_offline(folder, target, 9)
    assert open_offline(folder, target, 8).summary["samples"] == 8


def test_a_complete_capture_and_a_foreign_manifest_without_the_flag_train(root, target):
    assert open_offline(root / "data", target, None).summary["samples"] == 24
    folder = edited(root, "foreign")
    m = json.loads((folder / "manifest.json").read_text())
    del m["complete"]
    (folder / "manifest.json").write_text(json.dumps(m))
    assert open_offline(folder, target, None).summary["samples"] == 24


def test_a_rank_folder_of_a_multi_process_capture_is_refused(root, target):
    """A finished rank's folder is `complete` but holds every other shard: training on it took
    half the data as all of it."""
    (root / "ranks").mkdir(exist_ok=True)
    folder = edited(root, "ranks/rank-1", rank=1, world_size=2)
    with pytest.raises(DraftsmithError, match=r"rank 1's part of a 2-process capture.*"
                       r"draftsmith data merge"):
        open_offline(folder, target, None)


def test_a_recorded_target_not_there_names_the_fix(root, tmp_path, monkeypatch):
    """A manifest records the target as typed (a relative path): training from another folder
    said only "tiny: no such file or folder"."""
    folder = edited(root, "moved", target={"source": "models/tiny", "fingerprint": "x"})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DraftsmithError, match=r"names the target models/tiny, not a file or "
                       r"folder here .*pass --target"):
        resolve_target(None, str(folder))


def test_train_command_refuses_it_in_one_line(monkeypatch, capsys, root, tiny_llama_dir,
                                              tmp_path):
    folder = unfinished(root, "cli", [0])
    code, _, err = run_main(monkeypatch, capsys, "train", "--data", str(folder), "--out",
                            str(tmp_path / "run"), "--target", str(tiny_llama_dir),
                            "--device", "cpu", "--no-progress")
    assert code == 2 and err.startswith(f"draftsmith: error: {folder}: the capture is not "
                                        "complete (1 of 3 shards, 8 of 24 samples")
    assert len(err.splitlines()) == 1
