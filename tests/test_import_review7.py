"""Import, seventh review: folders in the exact shapes of published EAGLE-3 drafters.

- SafeAILab's EAGLE-3 reference (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, the EAGLE repo's
  eagle/traineagle3/config.json): architectures ["LlamaForCausalLM"], draft_vocab_size, no
  eagle_config, pytorch_model.bin with fc / midlayer.* / norm / lm_head / d2t (long) / t2d
  (bool); the reference captures the inputs of layers 2, L//2, L-3 (modeling_llama_kv.py).
- SpecForge's configs (configs/llama3-8B-eagle3.json): LlamaForCausalLMEagle3, no eagle_config.
- A folder shipping only d2t gets t2d derived from it.
- SGLang's LlamaForCausalLMEagle3.load_weights loads `midlayer.*` only: `layers.0.*` names
  (vLLM's, which vLLM maps from midlayer) are skipped there without a word.
- A tied head (`tie_word_embeddings`) is the embedding: one row per target token.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder
from safetensors.torch import load_file, save_file
from test_export import make

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter, read_any
from draftsmith.export.layout import ImportNote
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target

REFERENCE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "rms_norm_eps", "vocab_size", "draft_vocab_size",
                  "max_position_embeddings", "rope_theta")


@pytest.fixture(scope="module")
def target8(tmp_path_factory):
    """An 8-layer tiny llama: the engines' defaults [2, 4, 5] repeat no layer."""
    return load_target(write_tiny_folder(tmp_path_factory.mktemp("t8"), "llama",
                                         num_hidden_layers=8))


def published(target, tmp_path: Path, arch: str, drop: tuple[str, ...] = (),
              rename: bool = False, binfile: bool = False, **over) -> Path:
    """A drafter for `target` trained on the engines' default layers (canonical [1, 3, 4]),
    rewritten in a published drafter's shape: a bare HF config under `arch` (no eagle_config, no
    draftsmith record), `drop` tensors left out, `layers.0.*` for `midlayer.*` where `rename`,
    pytorch_model.bin where `binfile`."""
    d = make(target, tmp_path / "d", aux=[1, 3, 4])
    folder = export_drafter(d, "sglang", tmp_path / "pub", target=str(target.folder))
    c = json.loads((folder / "config.json").read_text())
    c = {"architectures": [arch], "model_type": "llama", "num_hidden_layers": 1,
         "tie_word_embeddings": False, "torch_dtype": "float16", "hidden_act": "silu",
         **{k: c[k] for k in REFERENCE_KEYS}, **over}
    (folder / "config.json").write_text(json.dumps(c))
    w = load_file(str(folder / "model.safetensors"))
    w = {("layers.0." + k.removeprefix("midlayer.") if rename and k.startswith("midlayer.")
          else k): v for k, v in w.items() if k not in drop}
    (folder / "model.safetensors").unlink()
    if binfile:
        torch.save(w, folder / "pytorch_model.bin")
    else:
        save_file(w, str(folder / "model.safetensors"))
    return folder


def _read(folder: Path, target) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drafter = read_any(folder, target=str(target.folder))
    return drafter, [str(w.message) for w in caught if isinstance(w.message, ImportNote)]


def test_eagle_reference_bin_without_eagle_config_reads_the_engines_defaults(target8, tmp_path):
    """No eagle_config: SGLang and vLLM feed the inputs of [2, L//2, L-3], as the reference
    hard-codes; d2t (long) and t2d (bool) read as stored; the .bin is read."""
    folder = published(target8, tmp_path, "LlamaForCausalLM", binfile=True)
    assert not (folder / "model.safetensors").exists()
    drafter, _ = _read(folder, target8)
    want = load_drafter(tmp_path / "d")
    assert drafter.cfg.aux_layer_ids == [1, 3, 4]  # inputs of 2, 4, 5 of 8 layers
    assert torch.equal(drafter.d2t, want.d2t) and torch.equal(drafter.t2d, want.t2d)
    assert torch.equal(drafter.fc.weight, want.fc.weight)


def test_specforge_config_without_eagle_config_imports_with_its_target(target8, tmp_path):
    folder = published(target8, tmp_path, "LlamaForCausalLMEagle3")
    out = import_drafter(folder, tmp_path / "out", target=str(target8.folder))
    back = load_drafter(out)
    assert back.cfg.aux_layer_ids == [1, 3, 4]
    assert back.cfg.max_position_embeddings == target8.cfg.max_position_embeddings


def test_a_folder_shipping_only_d2t_gets_t2d_derived(target8, tmp_path):
    folder = published(target8, tmp_path, "LlamaForCausalLMEagle3", drop=("t2d",))
    drafter, _ = _read(folder, target8)
    want = load_drafter(tmp_path / "d")
    assert torch.equal(drafter.t2d, want.t2d) and torch.equal(drafter.d2t, want.d2t)


def test_sglang_layout_with_vllm_layer_names_says_sglang_skips_them(target8, tmp_path):
    """SGLang's load_weights maps `layers.0.q_proj` to `model.layers.0.qkv_proj`, which
    LlamaForCausalLMEagle3 has no parameter for, and skips it: SGLang serves an unloaded
    decoder layer while vLLM (which maps midlayer. to layers.0.) and the import read the
    stored one. The import read it without a word."""
    folder = published(target8, tmp_path, "LlamaForCausalLMEagle3", rename=True)
    drafter, notes = _read(folder, target8)
    want = load_drafter(tmp_path / "d")
    assert torch.equal(drafter.midlayer.self_attn.o.weight,
                       want.midlayer.self_attn.o.weight)
    said = [n for n in notes if "layers.0." in n]
    assert len(said) == 1 and "SGLang" in said[0] and "midlayer." in said[0]
    assert "\n" not in said[0]


def test_sglang_layout_with_midlayer_names_notes_nothing_about_names(target8, tmp_path):
    folder = published(target8, tmp_path, "LlamaForCausalLMEagle3")
    _, notes = _read(folder, target8)
    assert not [n for n in notes if "layers.0." in n]


def test_tied_head_with_a_smaller_draft_vocab_is_refused_in_one_line(target8, tmp_path):
    """A tied head is the embedding (SGLang: `lm_head = embed_tokens`), one row per target
    token; with a draft vocabulary of other size the import said only that lm_head.weight has
    shape (128, 64) where the config implies (40, 64)."""
    folder = published(target8, tmp_path, "LlamaForCausalLMEagle3", tie_word_embeddings=True)
    with pytest.raises(DraftsmithError) as e:
        read_any(folder, target=str(target8.folder))
    msg = str(e.value)
    assert "tie_word_embeddings" in msg and "draft_vocab_size 40" in msg and "128" in msg
    assert "tie_word_embeddings false" in msg and "\n" not in msg
