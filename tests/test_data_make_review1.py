"""Review of `data make DIR`'s output folder: a folder holding a drafter, a training run or a
model (an export, a target) is refused before the target loads; an earlier run's resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_cli_review import run_main

from draftsmith.data.pipeline import make_dataset
from draftsmith.errors import DraftsmithError

GONE = "no-such-target-folder"  # loading it fails: the folder check passed


def folder_with(tmp_path: Path, **files: str) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    for name, text in files.items():
        (out / name.replace("__", ".")).write_text(text)
    return out


def refused(out: Path) -> str:
    with pytest.raises(DraftsmithError) as e:
        make_dataset(out, 4, GONE, log=lambda m: None)
    return str(e.value)


def test_a_trained_drafter_is_refused(tmp_path):
    out = folder_with(tmp_path, draftsmith__json="{}", model__safetensors="")
    said = refused(out)
    assert said.startswith(f"data make: {out} holds a drafter or training run "
                           "(draftsmith.json), not a `data make` folder")
    assert "\n" not in said


def test_a_training_run_in_progress_is_refused(tmp_path):
    out = folder_with(tmp_path, train_log__jsonl="")
    assert "training run (train_log.jsonl)" in refused(out)


def test_an_export_is_refused_by_its_layout(tmp_path):
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"]}
    out = folder_with(tmp_path, config__json=json.dumps(cfg), model__safetensors="")
    assert "holds an exported drafter (speculators layout, config.json)" in refused(out)
    sgl = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32}
    (out / "config.json").write_text(json.dumps(sgl))
    assert "(sglang layout, config.json)" in refused(out)


def test_a_target_model_folder_is_refused(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    shutil.copytree(tiny_llama_dir, out)
    assert f"{out} holds a model (config.json)" in refused(out)


def test_an_earlier_data_make_run_still_resumes(tmp_path):
    out = folder_with(tmp_path, make__json='{"commands": []}', prompts__jsonl="",
                      answers__jsonl="")
    (out / "dataset").mkdir()
    (out / "dataset" / "manifest.json").write_text("{}")
    with pytest.raises(DraftsmithError) as e:
        make_dataset(out, 4, GONE, log=lambda m: None)
    assert GONE in str(e.value) and "data make:" not in str(e.value)


def test_the_command_says_it_in_one_line(monkeypatch, capsys, tmp_path):
    out = folder_with(tmp_path, draftsmith__json="{}")
    code, _, err = run_main(monkeypatch, capsys, "data", "make", str(out), "--target", GONE,
                            "--device", "cpu")
    assert code == 2 and len(err.splitlines()) == 1 and "holds a drafter" in err
