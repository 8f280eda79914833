"""Export: the dtype an exported config names, which SGLang runs the draft in."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_export import make

from draftsmith.export import export_drafter
from draftsmith.targets import load_target

KEY = {"sglang": "torch_dtype", "speculators": "dtype"}


def bf16_target(tiny_llama_dir, tmp_path):
    """The tiny llama, its config.json naming bfloat16 as a real Llama's does."""
    folder = tmp_path / "t"
    shutil.copytree(tiny_llama_dir, folder)
    c = json.loads((folder / "config.json").read_text())
    c.pop("torch_dtype", None)
    c["dtype"] = "bfloat16"  # transformers 5's key
    (folder / "config.json").write_text(json.dumps(c))
    return load_target(str(folder))


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_names_the_targets_dtype_not_the_float32_master_weights(
        tiny_llama_dir, tmp_path, fmt):
    """A trained drafter holds float32 weights; SGLang's `--dtype auto` reads a float32 config
    as float16 (`_get_and_verify_dtype`), beside a bfloat16 target that feeds it bfloat16
    hidden states. The config names the target's dtype; the weights stay as kept."""
    t = bf16_target(tiny_llama_dir, tmp_path)
    src = make(t, tmp_path / "d")
    out = export_drafter(src, fmt, tmp_path / "with", target=str(t.folder))
    assert json.loads((out / "config.json").read_text())[KEY[fmt]] == "bfloat16"
    assert load_file(out / "model.safetensors")["fc.weight"].dtype == torch.float32
    out = export_drafter(src, fmt, tmp_path / "recorded")  # the recorded target folder's
    assert json.loads((out / "config.json").read_text())[KEY[fmt]] == "bfloat16"


def test_export_without_the_targets_dtype_names_bfloat16_for_float32_weights(target, tmp_path):
    src = make(target, tmp_path / "d", target_source="")
    from draftsmith.export.layout import TargetInfo, run_dtype
    from draftsmith.models.eagle3 import hf_state_dict, load_drafter

    info = TargetInfo.of_drafter(load_drafter(src).cfg)
    assert info.dtype == ""
    w = hf_state_dict(load_drafter(src))
    assert run_dtype(w, info) == "bfloat16"
    assert run_dtype({k: v.half() for k, v in w.items()}, info) == "float16"


def test_import_records_the_targets_max_positions_for_a_later_export(target, tmp_path):
    """A SpecForge folder names max_position_embeddings 2048 beside a 128K target (SpecForge
    issues 249/271: acceptance collapses past it). Imported with --target, the drafter records
    the target's, so an export without --target writes the target's, as one with it does."""
    from draftsmith.export import import_drafter
    from draftsmith.models.eagle3 import load_drafter

    foreign = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg",
                             target=str(target.folder))
    c = json.loads((foreign / "config.json").read_text())
    del c["draftsmith"]  # as SpecForge writes it: no record of its target
    c["max_position_embeddings"] = 64
    (foreign / "config.json").write_text(json.dumps(c))
    imported = import_drafter(foreign, tmp_path / "imp", target=str(target.folder))
    assert load_drafter(imported).cfg.max_position_embeddings == 512
    for fmt in ("sglang", "speculators"):
        c = json.loads((export_drafter(imported, fmt, tmp_path / fmt) / "config.json").read_text())
        assert c.get("transformer_layer_config", c)["max_position_embeddings"] == 512
