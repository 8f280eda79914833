"""Doctor and demo review 23: the vLLM row of a speculators folder names the key path vLLM
really reads the ids at (inside transformer_layer_config too, as import reads them), SGLang's
row says it does not load that layout; a demo into an --out holding a demo made on another
device is refused in demo terms before any stage."""

from __future__ import annotations

import io
import json
import re
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import test_doctor as td
import torch
from conftest import write_tiny_folder
from rich.console import Console

from draftsmith import demo as demo_mod
from draftsmith.doctor.render import engines_table
from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter

target_dir, target = td.target_dir, td.target
IDS = "eagle_aux_hidden_state_layer_ids"
TRAINED = [0, 2, 5]  # canonical; vLLM's [1, 3, 6], not its defaults' [1, 3, 4]


def _speculators(target, target_dir, tmp_path: Path, where: str) -> Path:
    """An export whose ids were moved from the top level to `where` (another trainer's layout)."""
    good = td.make_drafter(tmp_path / "good", target, TRAINED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sp = export_drafter(good, "speculators", tmp_path / "sp", target=str(target_dir))
    c = json.loads((sp / "config.json").read_text())
    if where != "top":
        ids = c.pop(IDS)
        layer = c["transformer_layer_config"]
        (layer.setdefault("eagle_config", {}) if where == "eagle_config" else layer)[IDS] = ids
    (sp / "config.json").write_text(json.dumps(c))
    return sp


def _row(rep, engine: str) -> dict:
    return next(r for r in rep.engines if r["engine"] == engine)


def _table(rep) -> str:
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(engines_table(rep.engines))
    return out.getvalue()


@pytest.mark.parametrize(("where", "key"), [
    ("layer", f"transformer_layer_config.{IDS} in config.json"),
    ("eagle_config", f"transformer_layer_config.eagle_config.{IDS} in config.json"),
])
def test_vllm_row_reads_ids_inside_transformer_layer_config(target, target_dir, tmp_path, where,
                                                            key):
    """vLLM's draft config is transformer_layer_config with the top-level list copied over it
    (`export.layout.speculators_lists`, as import reads it); the row said the top-level key was
    missing, vLLM used its defaults [1, 3, 4], and the doctor failed a drafter vLLM feeds right."""
    sp = _speculators(target, target_dir, tmp_path, where)
    rep = td.doctor(drafter=sp, target=str(target_dir), engine="vllm")
    feed = _row(rep, "vllm")["feed"]
    assert feed["written"] == [1, 3, 6] and feed["canonical"] == TRAINED
    assert feed["key"] == key
    assert "speculators reads only the top level" in feed["note"]
    assert not [f for f in rep.errors() if "will feed" in f.what]
    assert f"feeds: [1, 3, 6] at {key} -> canonical {TRAINED}" in _table(rep)


def test_vllm_row_of_an_export_names_the_top_level_key(target, target_dir, tmp_path):
    sp = _speculators(target, target_dir, tmp_path, "top")
    rep = td.doctor(drafter=sp, target=str(target_dir))
    row = _row(rep, "vllm")
    assert row["key"] == row["feed"]["key"] == f"{IDS} (top level) in config.json"
    assert "feeds: [1, 3, 6] -> canonical [0, 2, 5]" in _table(rep)
    assert rep.ok


def test_sglang_row_of_a_speculators_folder_says_sglang_does_not_load_it(target, target_dir,
                                                                        tmp_path):
    """It said SGLang "silently uses its defaults" [1, 3, 4] for a folder SGLang cannot load."""
    sp = _speculators(target, target_dir, tmp_path, "top")
    rep = td.doctor(drafter=sp, target=str(target_dir))
    feed = _row(rep, "sglang")["feed"]
    assert feed["canonical"] is None
    assert "SGLang does not load the speculators layout" in feed["note"]
    assert "silently uses its defaults" not in _table(rep)


# ---- demo: an --out holding a demo of another device ---------------------------------------

def _demo(monkeypatch, out: Path, target: str) -> list:
    """`draftsmith demo --device cpu` stopped after its data stage."""
    ran: list = []

    def stop(cfg, data):
        ran.append(data)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_mod, "train_drafter", stop)
    with pytest.raises(KeyboardInterrupt):
        demo_mod.demo(out=out, device="cpu", conversations=3, epochs=None, steps=None,
                      target=target)
    return ran


def test_a_cpu_demo_into_an_out_of_a_gpu_demo_is_refused_in_demo_terms(tmp_path, monkeypatch):
    """The GPU demo's data (its prompt length, batch and dtype) then the CPU demo: the data
    stage refused with "prompts.jsonl holds self-made prompts made otherwise (...): rerun with
    those settings, or write to another file", which no demo flag does."""
    tiny = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=4)
    out = tmp_path / "demo"
    gpu = replace(demo_mod.DemoConfig.for_device(out, "cuda"), device="cpu", target=str(tiny),
                  conversations=3, answer_tokens=8)
    demo_mod.make_data(gpu, torch.float32)  # the earlier run, its device recorded as CUDA's
    record = out / "data" / "make.json"
    record.write_text(json.dumps(json.loads(record.read_text()) | {"device": "cuda:0",
                                                                    "dtype": "bfloat16"}))
    said = (f"--out {out}: holds a demo run made on cuda:0 (bfloat16), and a demo on cpu makes "
            "its data otherwise; pass another --out, or delete it to start again")
    with pytest.raises(DraftsmithError, match=f"^{re.escape(said)}$"):
        demo_mod.demo(out=out, device="cpu", conversations=3, epochs=None, steps=None,
                      target=str(tiny))


def test_a_demo_on_the_same_device_resumes(tmp_path, monkeypatch):
    tiny = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=4)
    out = tmp_path / "demo"
    assert len(_demo(monkeypatch, out, str(tiny))) == 1
    record = json.loads((out / "data" / "make.json").read_text())
    assert record["device"] == "cpu"
    (out / "data" / "make.json").write_text(json.dumps(record | {"device": "cuda:1"}))
    with pytest.raises(DraftsmithError, match="made on cuda:1"):
        _demo(monkeypatch, out, str(tiny))
    (out / "data" / "make.json").write_text(json.dumps(record))
    assert len(_demo(monkeypatch, out, str(tiny))) == 1  # resumed, not refused


@pytest.mark.parametrize("bad", [5, "2,3", [1, "2"]])
def test_a_malformed_inner_list_is_one_line_not_a_traceback(target, target_dir, tmp_path, bad):
    """compare review 15 found it: `_inner_ids` ran list() over whatever sat inside
    transformer_layer_config (a number was a TypeError traceback)."""
    from draftsmith.doctor.artifacts import read_checked

    folder = _speculators(target, target_dir, tmp_path, "layer")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["transformer_layer_config"][IDS] = bad
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="transformer_layer_config.eagle_aux_hidden_state_"
                                              "layer_ids is .*not a list of integer layer ids"):
        read_checked(folder)
