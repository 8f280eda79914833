"""Parity audit against HF transformers for Llama-family configs users bring (transformers-4
rope_scaling, llama3 RoPE on every family, eps wiring, fp16 checkpoints), and what draftsmith
cannot run refused at load, each missing tensor named as the checkpoint names it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_hf_model, write_tiny_folder

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.models.loading import build_model
from draftsmith.targets import load_target
from draftsmith.targets.tokenizer import write_byte_tokenizer

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


def _edit(folder, drop=(), **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    for k in drop:
        cfg.pop(k, None)
    (folder / "config.json").write_text(json.dumps(cfg))


def _assert_matches_hf(folder, length: int = 24) -> None:
    """Logits and every layer's output (canonical ids -1..L-1), then a prefill of 3 and one
    token a step through the KV cache, against HF's full forward, in fp32."""
    import transformers as tf

    from draftsmith.engine.runtime import Runtime

    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").float().eval()
    ours = load_target(folder).build(torch.float32)
    n = ours.cfg.num_layers
    ids = torch.randint(5, 100, (2, length), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(length).expand(2, length)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, pos, aux_ids=tuple(range(-1, n - 1)))
        assert (out.logits - ref.logits).abs().max() < 1e-4
        for j in range(n):  # HF's hidden_states[j] is the input of layer j: our id j - 1
            assert (out.aux[:, :, j] - ref.hidden_states[j]).abs().max() < 1e-4, j
        rt = Runtime(ours, max_batch=2, max_seq=length)
        steps = [rt.forward(ids[:, :3], pos[:, :3]).logits]
        steps += [rt.forward(ids[:, q:q + 1], pos[:, q:q + 1]).logits for q in range(3, length)]
    assert (torch.cat(steps, 1) - ref.logits).abs().max() < 1e-4


def test_a_llama31_config_in_transformers4_form_matches_hf_past_its_original_context(tmp_path):
    """Llama 3.1/3.2's config.json: rope_scaling (not rope_parameters), rope_theta at the top
    level, none in the dict; decode runs 3x past original_max_position_embeddings."""
    folder = write_tiny_folder(tmp_path / "l31", "llama", num_hidden_layers=2,
                               tie_word_embeddings=True)
    _edit(folder, drop=("rope_parameters",), rope_scaling=LLAMA3, rope_theta=500000.0,
          max_position_embeddings=64)
    cfg = load_target(folder).cfg
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    _assert_matches_hf(folder)


@pytest.mark.parametrize(("arch", "over"), [
    ("qwen2", {"num_key_value_heads": 1}),
    ("qwen3", {"attention_bias": True}),
    ("mistral", {"head_dim": 8, "sliding_window": None}),
])
def test_llama3_rope_on_other_families_matches_hf(tmp_path, arch, over):
    rope = {**LLAMA3, "rope_theta": 500000.0}
    folder = write_tiny_folder(tmp_path / arch, arch, num_hidden_layers=2, rope_parameters=rope,
                               **over)
    _assert_matches_hf(folder)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rms_norm_eps_reaches_every_norm(tmp_path, arch):
    """At 1e-6 a norm built with another eps still matched HF; at 0.5 (Qwen3's q/k norms too)
    it cannot."""
    _assert_matches_hf(write_tiny_folder(tmp_path / arch, arch, num_hidden_layers=2,
                                         rms_norm_eps=0.5))


def test_an_fp16_checkpoint_built_in_fp32_equals_hf(tmp_path):
    folder = tmp_path / "fp16"
    tiny_hf_model("llama", num_hidden_layers=2).half().save_pretrained(folder)
    write_byte_tokenizer(folder, vocab_size=128)
    assert load_target(folder).weights["model.embed_tokens.weight"].dtype == torch.float16
    _assert_matches_hf(folder)


@pytest.mark.parametrize("rope", [
    {"type": "dynamic", "factor": 2.0},  # transformers-4's key for the kind
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
     "original_max_position_embeddings": 8},
])
def test_rope_scaling_draftsmith_cannot_compute_is_refused_at_load(tmp_path, rope):
    folder = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=2)
    _edit(folder, drop=("rope_parameters",), rope_scaling=rope, rope_theta=10000.0)
    kind = rope.get("rope_type", rope.get("type"))
    with pytest.raises(DraftsmithError, match=f"unsupported rope scaling '{kind}'"):
        load_target(folder)


@pytest.mark.parametrize("scaling", [{"rope_type": "default"}, {"type": "default"},
                                     {"rope_theta": 10000.0}])
def test_rope_scaling_naming_the_default_kind_is_the_plain_rope(scaling):
    """As HF reads a dict of no kind or "default"; it was refused as "unsupported rope
    scaling 'default': supported default, linear, llama3" (a drafter's config)."""
    plain = ModelConfig(arch="llama", vocab_size=8, hidden_size=16, intermediate_size=16,
                        num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8)
    scaled = ModelConfig(**{**plain.to_dict(), "rope_scaling": scaling})
    assert scaled.inv_freq() == plain.inv_freq()


@pytest.mark.parametrize(("over", "drop", "named"), [
    ({"attention_bias": True}, "bias", "model.layers.0.self_attn.q_proj.bias"),
    ({}, "model.layers.1.post_attention_layernorm.weight",
     "model.layers.1.post_attention_layernorm.weight"),
    ({}, "model.norm.weight", "model.norm.weight"),
])
def test_a_tensor_the_config_needs_is_named_as_the_checkpoint_names_it(over, drop, named):
    """It was named in draftsmith's fused names ('layers.0.attn.qkv.bias')."""
    hf = tiny_hf_model("llama", num_hidden_layers=2, **over)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    weights = {k: v for k, v in hf.state_dict().items()
               if not (k == drop or drop == "bias" and k.endswith("_proj.bias"))}
    with pytest.raises(DraftsmithError, match=rf"checkpoint lacks {named}\b.*config\.json"):
        build_model(cfg, weights)
