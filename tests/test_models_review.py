"""Loading targets and drafters as real checkpoints ship them: family-specific biases, .bin
weights, named chat templates, malformed configs, engine layouts, concurrent GGUF conversion."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_tiny_folder

from draftsmith.errors import DraftsmithError
from draftsmith.targets import load_target


def _edit(folder, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def _max_diff_to_hf(folder) -> float:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    ours = load_target(folder).build(torch.float32)
    ids = torch.randint(5, 100, (1, 17))
    with torch.no_grad():
        return (ours(ids, torch.arange(17)[None]).logits - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize(("arch", "fields"), [
    ("qwen2", {"attention_bias": False}),  # HF's Qwen2 biases q/k/v whatever the config says
    ("mistral", {"attention_bias": True, "mlp_bias": True}),  # HF's Mistral never biases
])
def test_biases_follow_each_family_as_hf_builds_it(tmp_path, arch, fields):
    folder = write_tiny_folder(tmp_path / arch, arch)
    _edit(folder, **fields)
    assert _max_diff_to_hf(folder) < 1e-4


def test_an_activation_other_than_silu_is_refused(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    _edit(folder, hidden_act="gelu")
    with pytest.raises(DraftsmithError, match="hidden_act 'gelu' is not supported"):
        load_target(folder)


@pytest.mark.parametrize(("rope", "field"), [
    ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}, "low_freq_factor"),
    ({"rope_type": "linear", "rope_theta": 10000.0}, "factor"),
])
def test_rope_scaling_lacking_a_field_is_named_at_load(tmp_path, rope, field):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    _edit(folder, rope_parameters=rope)
    with pytest.raises(DraftsmithError, match=f"lacks the field '{field}'"):
        load_target(folder)


def test_a_config_transformers_refuses_while_reading_the_tokenizer_is_one_error(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama")
    _edit(folder, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0})
    with pytest.raises(DraftsmithError, match="cannot load the tokenizer.*Missing required keys"):
        load_target(folder)


def test_a_folder_of_pytorch_bin_weights_loads_as_its_safetensors_twin(tmp_path):
    from safetensors.torch import load_file

    st = write_tiny_folder(tmp_path / "st", "llama", tie_word_embeddings=True)
    folder = write_tiny_folder(tmp_path / "bin", "llama", tie_word_embeddings=True)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = list(weights)
    torch.save({k: weights[k] for k in names[:5]}, folder / "pytorch_model-00001-of-00002.bin")
    torch.save({k: weights[k] for k in names[5:]}, folder / "pytorch_model-00002-of-00002.bin")
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: f"pytorch_model-0000{1 + (i >= 5)}-of-00002.bin" for i, k in enumerate(names)}}))
    (folder / "training_args.bin").write_bytes(b"a Trainer's pickle, not weights")
    assert load_target(folder).fingerprint == load_target(st).fingerprint
    assert _max_diff_to_hf(folder) < 1e-4
    (folder / "pytorch_model-00002-of-00002.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(DraftsmithError, match=r"00002.bin: cannot read its weights \(PyTorch"):
        load_target(folder)


def _named_templates(folder, names: dict[str, str]) -> None:
    for f in folder.glob("chat_template*"):
        f.unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": k, "template": v} for k, v in names.items()]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_named_chat_templates_render_and_hash_the_default(tmp_path):
    """tokenizer_config.json's list of named templates (Hermes, Command R): transformers renders
    with "default"; the template hash crashed on the dict (`targets show`, data manifests)."""
    from draftsmith.targets.tokenizer import CHATML, template_hash

    plain = load_target(write_tiny_folder(tmp_path / "a", "llama"))
    folder = write_tiny_folder(tmp_path / "b", "llama")
    _named_templates(folder, {"default": CHATML, "tool_use": "{{ 'tools' }}"})
    t = load_target(folder)
    msgs = [{"role": "user", "content": "hi"}]
    assert template_hash(t.tokenizer) == template_hash(plain.tokenizer)
    assert t.describe()["chat_template_hash"] == plain.describe()["chat_template_hash"]
    assert t.chat_ids(msgs) == plain.chat_ids(msgs)
    _named_templates(folder, {"tool_use": CHATML})
    with pytest.raises(DraftsmithError, match="named chat templates .'tool_use'. and none"):
        load_target(folder).chat_ids(msgs)


def test_concurrent_conversions_of_one_gguf_both_succeed(tmp_path, monkeypatch):
    """Two ranks converting one GGUF on a fresh cache: the one that finished first moved the
    shared temporary folder away under the other, whose next write failed."""
    import safetensors.torch as st
    from conftest import tiny_hf_model
    from test_targets import _gguf_from_hf, _logits_match_hf

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_model("llama", num_hidden_layers=2)
    _gguf_from_hf(path := tmp_path / "m.gguf", hf, "llama")
    real, other = st.save_file, []

    def save_file(*a, **kw):
        if not other:  # the other rank converts and moves its folder in meanwhile
            other.append(None)
            other[0] = load_target(path)
        return real(*a, **kw)

    monkeypatch.setattr(st, "save_file", save_file)
    t = load_target(path)
    assert t.folder == other[0].folder and t.fingerprint == other[0].fingerprint
    monkeypatch.setattr(st, "save_file", real)
    again = load_target(path)
    assert again.folder == t.folder and again.fingerprint == t.fingerprint
    _logits_match_hf(again, hf)
    assert sorted(p.name for p in t.folder.parent.iterdir()) == [t.folder.name]


def test_a_drafter_config_lacking_a_key_or_a_foreign_layout_is_named(tmp_path):
    from test_drafter import random_drafter, tiny_cfg

    from draftsmith.models.eagle3 import fuse_hf_state, load_drafter, save_drafter

    save_drafter(random_drafter(tiny_cfg()), folder := tmp_path / "d")
    meta = json.loads((folder / "draftsmith.json").read_text())
    del meta["config"]["head_dim"]
    (folder / "draftsmith.json").write_text(json.dumps(meta))
    with pytest.raises(DraftsmithError, match=r"lacks the keys \['head_dim'\]"):
        load_drafter(folder)
    meta["config"] = None
    (folder / "draftsmith.json").write_text(json.dumps(meta))
    with pytest.raises(DraftsmithError, match="no drafter config object"):
        load_drafter(folder)
    (sg := tmp_path / "sglang").mkdir()
    (sg / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(DraftsmithError, match="draftsmith import .*sglang --out DIR"):
        load_drafter(sg)
    assert set(fuse_hf_state({"layers.norm.weight": torch.ones(2)})) == {"layers.norm.weight"}
