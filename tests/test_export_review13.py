"""Export review 13: the final norm, the vocab mapping and the ids each engine reads."""

from __future__ import annotations

import warnings

import pytest
from safetensors.torch import load_file
from test_drafter import random_drafter
from test_export import make
from test_train_helpers import AUX

from draftsmith.export import export_drafter
from draftsmith.export.layout import TargetInfo
from draftsmith.export.sglang import sglang_config
from draftsmith.layers import default_aux_layers
from draftsmith.models.eagle3 import Eagle3Config, save_drafter


def _export(src, fmt, out, target) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_drafter(src, fmt, out, target=str(target.folder))
    return [str(w.message) for w in caught]


def test_sglang_export_writes_what_both_engines_load_and_apply(target, tmp_path):
    """SGLang's LlamaForCausalLMEagle3 (llama_eagle3.py, 03d5a77) and vLLM's Eagle3 model both
    load `norm.weight` and apply it before lm_head, feeding the pre-norm state back (as the
    drafter without norm_output); d2t is offsets (SGLang: hot_token_id = d2t + arange; vLLM:
    targets = arange + draft_id_to_target_id, a long tensor); t2d is skipped by both."""
    src = make(target, tmp_path / "d")
    assert not _export(src, "sglang", tmp_path / "sg", target)
    w = load_file(tmp_path / "sg" / "model.safetensors")
    assert {"norm.weight", "midlayer.hidden_norm.weight", "fc.weight", "lm_head.weight"} <= set(w)
    assert w["d2t"].dtype.is_floating_point is False and str(w["d2t"].dtype) == "torch.int64"
    assert str(w["t2d"].dtype) == "torch.bool" and w["t2d"].shape == (target.cfg.vocab_size,)


@pytest.mark.parametrize("layers", [30, 32])
def test_sglang_export_ids_feed_the_same_layers_in_both_engines(layers):
    """SGLang's set_eagle3_layers_to_capture captures val + 1 (input of layer val + 1, the
    output of layer val) for eagle_config's ids; vLLM captures the input of layer j for the
    top-level ids. Both must name the drafter's canonical layers (outputs of 1, L//2-1, L-4)."""
    ids = default_aux_layers(layers)
    cfg = Eagle3Config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                       head_dim=16, target_hidden_size=64, vocab_size=1000, draft_vocab_size=100,
                       aux_layer_ids=ids, target_num_layers=layers)
    c = sglang_config(cfg, TargetInfo(layers, 4096, 1000, "/x"), "bfloat16")
    sglang_inputs = [i + 1 for i in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    vllm_inputs = c["eagle_aux_hidden_state_layer_ids"]
    assert sglang_inputs == vllm_inputs == [2, layers // 2, layers - 3]


def _wide_drafter(target, folder, hidden: int):
    cfg = Eagle3Config.for_target(
        target.cfg, 40, AUX, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4,
        num_kv_heads=2, head_dim=16, target_fingerprint=target.fingerprint,
        target_source=str(target.folder), target_architectures=["LlamaForCausalLM"])
    return save_drafter(random_drafter(cfg), folder, training={"steps": 0})


def test_sglang_export_warns_where_sglang_skips_fc(target, tmp_path):
    """SGLang's LlamaModel.forward applies fc only where the fed state's width differs from
    the embedding's (`hidden_states.shape[-1] != embeds.shape[-1]`): a drafter whose hidden
    size is 3 x target_hidden_size gets the three target states unfused on its first step,
    without a word. vLLM, which loads this layout too, always applies fc."""
    src = _wide_drafter(target, tmp_path / "d", 3 * target.cfg.hidden_size)
    said = [m for m in _export(src, "sglang", tmp_path / "sg", target) if "fc" in m]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "SGLang" in said[0] and "vLLM" in said[0]


def test_sglang_export_of_another_wide_drafter_says_nothing_of_fc(target, tmp_path):
    src = _wide_drafter(target, tmp_path / "d", 2 * target.cfg.hidden_size)
    assert not [m for m in _export(src, "sglang", tmp_path / "sg", target) if "fc" in m]


def test_sglang_import_notes_where_sglang_skips_fc(target, tmp_path):
    """The import applies fc as vLLM does; a folder SGLang would serve with fc skipped (hidden
    size 3 x target_hidden_size) is said in one note, the drafter read as it is stored."""
    from draftsmith.export import read_any
    from draftsmith.export.layout import ImportNote

    src = _wide_drafter(target, tmp_path / "d", 3 * target.cfg.hidden_size)
    _export(src, "sglang", tmp_path / "sg", target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = read_any(tmp_path / "sg", target=str(target.folder))
    said = [str(w.message) for w in caught
            if isinstance(w.message, ImportNote) and "fc" in str(w.message)]
    assert len(said) == 1 and "SGLang" in said[0] and "\n" not in said[0], said
    assert back.cfg.hidden_size == 3 * back.cfg.target_hidden_size
