"""Export/import against the engines' loaders: cases the main export tests do not reach."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from test_drafter import random_drafter
from test_train_helpers import AUX

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, read_any
from draftsmith.models.eagle3 import Eagle3Config, save_drafter


def narrow_drafter(target, folder):
    """A drafter narrower than its target (hidden 32 < target hidden 64), with its own
    embedding: the shape SpecForge writes when `target_hidden_size` is set."""
    cfg = Eagle3Config.for_target(
        target.cfg, 40, AUX, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
        head_dim=16, target_fingerprint=target.fingerprint, target_source=str(target.folder),
        target_architectures=["LlamaForCausalLM"])
    d = random_drafter(cfg)
    return d, save_drafter(d, folder, training={"steps": 0})


def test_sglang_export_keeps_the_embedding_sglang_cannot_share(target, tmp_path):
    """SGLang's `set_embed` shares the target's embedding only when target_hidden_size equals
    hidden_size (python/sglang/srt/models/llama.py); otherwise the draft keeps the embedding it
    loaded. The export dropped it always, so SGLang ran on an uninitialised embedding and the
    export did not even read back."""
    d, src = narrow_drafter(target, tmp_path / "d")
    out = export_drafter(src, "sglang", tmp_path / "sg", target=str(target.folder))
    c = json.loads((out / "config.json").read_text())
    assert (c["hidden_size"], c["target_hidden_size"]) == (32, 64)
    w = load_file(out / "model.safetensors")
    assert torch.equal(w["embed_tokens.weight"], d.embed_tokens.weight)
    back = read_any(out, target=str(target.folder))
    assert torch.equal(back.embed_tokens.weight, d.embed_tokens.weight)
    assert torch.equal(back.fc.weight, d.fc.weight)


def test_speculators_import_reads_a_multimodal_verifiers_layer_count(target, tmp_path):
    """A verifier whose config.json nests the language model under text_config (Llama 4,
    Qwen2.5-VL speculators) gave a KeyError traceback instead of its layer count."""
    from test_export import make

    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    c = json.loads((out / "config.json").read_text())
    del c["draftsmith"]
    verifier = tmp_path / "vlm"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 6}}))
    c["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    (out / "config.json").write_text(json.dumps(c))
    assert read_any(out).cfg.aux_layer_ids == AUX
    (verifier / "config.json").write_text(json.dumps({"model_type": "x"}))
    with pytest.raises(DraftsmithError, match="num_hidden_layers"):
        read_any(out)


def engine_folder(d, target, folder, **config_over):
    """`d` written in SGLang's layout with config keys overridden (what other tools write)."""
    import dataclasses

    from draftsmith.export.layout import TargetInfo, write_folder
    from draftsmith.export.sglang import sglang_config
    from draftsmith.models.eagle3 import hf_state_dict

    plain = dataclasses.replace(d.cfg, norm_before_residual=False, fc_norm=False,
                                aux_layer_ids=AUX)
    c = {**sglang_config(plain, TargetInfo.of_drafter(d.cfg), "float32"), **config_over}
    w = hf_state_dict(d)
    w.pop("embed_tokens.weight")
    return write_folder(folder, c, w)


def test_sglang_layout_import_keeps_norm_before_residual(target, tmp_path):
    """vLLM's llama_eagle3.py reads `norm_before_residual` from an SGLang-layout config
    (architectures LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM); the import ignored it and
    made a drafter that computes otherwise, without a word."""
    from test_export import make

    from draftsmith.models.eagle3 import load_drafter

    d = load_drafter(make(target, tmp_path / "d", norm_before_residual=True))
    out = engine_folder(d, target, tmp_path / "sg", norm_before_residual=True)
    back = read_any(out, target=str(target.folder))
    assert back.cfg.norm_before_residual
    x, h = torch.randint(0, 128, (1, 5)), torch.randn(1, 5, 64)
    with torch.no_grad():
        want, _ = d(x, h, torch.arange(5)[None])
        got, _ = back(x, h, torch.arange(5)[None])
    assert torch.allclose(got, want, atol=1e-6)


def test_sglang_layout_import_reads_specforge_fc_norm(target, tmp_path):
    """SpecForge's Eagle-3.1 (configs/qwen3-30B-A3B-eagle3.1.json) writes `fc_norm: true` and
    `fc_norm.{i}.weight`, a per-state RMSNorm before fc as draftsmith's fc_norm; the import
    refused the weights. Its `norm_output: true` feeds the normed state back, as vLLM and
    SGLang serve it (SpecForge since PR #879; before, it meant the usual final norm alone)."""
    from test_export import make

    from draftsmith.models.eagle3 import load_drafter

    d = load_drafter(make(target, tmp_path / "d", fc_norm=True))
    out = engine_folder(d, target, tmp_path / "sg", fc_norm=True, norm_output=True)
    back = read_any(out, target=str(target.folder))
    assert back.cfg.fc_norm and back.cfg.norm_output
    aux = torch.randn(1, 5, 3, 64)
    assert torch.allclose(back.fuse(aux), d.fuse(aux), atol=1e-6)
    # SGLang and vLLM feed lm_head the final norm whatever norm_output says (SpecForge since
    # PR #879 too): false is plain EAGLE-3, read so with a note naming the older meaning.
    no_norm = engine_folder(d, target, tmp_path / "nn", fc_norm=True, norm_output=False)
    with pytest.warns(UserWarning, match="norm_output false read as plain EAGLE-3"):
        assert not read_any(no_norm, target=str(target.folder)).cfg.norm_output


def test_sglang_layout_import_reads_top_level_ids_vllm_serves(target, tmp_path):
    """vLLM's gpu_model_runner `_get_eagle3_aux_layers_from_config` reads the top-level
    `eagle_aux_hidden_state_layer_ids` (input of layer j) of an SGLang-layout folder; a folder
    that has only those was imported with SGLang's default layers instead."""
    from test_export import make

    from draftsmith.models.eagle3 import load_drafter

    d = load_drafter(make(target, tmp_path / "d", aux=[0, 3, 4]))  # ids only vLLM can feed
    out = engine_folder(d, target, tmp_path / "sg", eagle_config={"use_aux_hidden_state": True},
                        eagle_aux_hidden_state_layer_ids=[1, 4, 5])
    assert read_any(out, target=str(target.folder)).cfg.aux_layer_ids == [0, 3, 4]


def test_sglang_layout_import_reads_nested_ids_as_outputs(target, tmp_path):
    """Nested ids not starting at 1 are outputs of those layers to SGLang's Llama/Qwen classes
    (every version) and to SpecForge: [3, 4, 5] was read as inputs, canonical [2, 3, 4]."""
    from test_export import make

    from draftsmith.models.eagle3 import load_drafter

    d = load_drafter(make(target, tmp_path / "d"))
    out = engine_folder(d, target, tmp_path / "sg",
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 4, 5]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read_any(out, target=str(target.folder)).cfg.aux_layer_ids == [3, 4, 5]
    assert not [w for w in caught if "do not start at 1" in str(w.message)]


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_import_reads_descending_ids_in_the_order_the_engines_feed(target, tmp_path, layout):
    """SGLang and vLLM append captured states walking the layers, so a folder listing its ids
    descending runs on them ascending. Import kept the listed order: the drafter decoded on
    states in another order than the engines give, and its export was refused, pointing at a
    doctor that found nothing. Now read ascending with a warning; a repeated layer is refused."""
    from test_export import make

    out = export_drafter(make(target, tmp_path / "d"), layout, tmp_path / layout)
    c = json.loads((out / "config.json").read_text())
    holder = c["eagle_config"] if layout == "sglang" else c
    listed = holder["eagle_aux_hidden_state_layer_ids"]
    holder["eagle_aux_hidden_state_layer_ids"] = listed[::-1]
    (out / "config.json").write_text(json.dumps(c))
    with pytest.warns(UserWarning, match="not ascending; SGLang and vLLM feed the states in "
                      "layer order"):
        back = read_any(out, target=str(target.folder))
    assert back.cfg.aux_layer_ids == sorted(AUX)
    holder["eagle_aux_hidden_state_layer_ids"] = [listed[0], *listed[:-1]]
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(DraftsmithError, match="repeat a layer"):
        read_any(out, target=str(target.folder))
