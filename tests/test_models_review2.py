"""Parity with HF transformers for every claimed family variant (every hidden state past the
sliding window, token-by-token decode through the KV cache), and config.json fields read as
transformers 5 reads them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_tiny_folder

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.targets import load_target

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def _edit(folder, drop=(), **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    for k in drop:
        cfg.pop(k)
    (folder / "config.json").write_text(json.dumps(cfg))


def _hf(folder):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return hf.float().eval()


def _assert_matches_hf(folder, length: int = 30) -> None:
    """Logits and every layer's output over `length` tokens, and a prefill of 3 then one token a
    step through the engine's cache (up to the window) against HF's full forward."""
    from draftsmith.engine.runtime import Runtime

    hf, ours = _hf(folder), load_target(folder).build(torch.float32)
    n = ours.cfg.num_layers
    ids = torch.randint(5, 100, (2, length), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(length).expand(2, length)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, pos, aux_ids=tuple(range(-1, n)))
        assert (out.logits - ref.logits).abs().max() < 1e-4
        for j in range(n):  # HF's entry j is layer j's input; its last is after the final norm
            assert (out.aux[:, :, j] - ref.hidden_states[j]).abs().max() < 1e-5, j
        assert (hf.model.norm(out.aux[:, :, n]) - ref.hidden_states[n]).abs().max() < 1e-5
        seq = min(length, ours.cfg.sliding_window or length)
        rt = Runtime(ours, max_batch=2, max_seq=seq)
        steps = [rt.forward(ids[:, :3], pos[:, :3]).logits]
        steps += [rt.forward(ids[:, q:q + 1], pos[:, q:q + 1]).logits for q in range(3, seq)]
        assert (torch.cat(steps, 1) - hf(ids[:, :seq]).logits).abs().max() < 1e-4


@pytest.mark.parametrize(("arch", "over"), [
    ("llama", {"rope_parameters": LLAMA3}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),  # SmolLM-like
    ("llama", {"head_dim": 32, "attention_bias": True}),
    ("qwen2", {"head_dim": 8, "num_key_value_heads": 1}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("mistral", {"sliding_window": 8, "head_dim": 8}),
])
def test_every_variant_matches_hf_past_the_window_and_through_the_cache(tmp_path, arch, over):
    _assert_matches_hf(write_tiny_folder(tmp_path / arch, arch, num_hidden_layers=3, **over))


def test_llama3_rope_without_original_max_positions_takes_max_positions_as_hf(tmp_path):
    """transformers fills llama3's original_max_position_embeddings from max_position_embeddings;
    it was refused as a missing field."""
    folder = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=2)
    rope = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    _edit(folder, max_position_embeddings=32, rope_parameters=rope)
    assert load_target(folder).cfg.rope_scaling["original_max_position_embeddings"] == 32
    _assert_matches_hf(folder)


def test_a_top_level_original_max_positions_wins_as_in_hf(tmp_path):
    folder = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=2)
    _edit(folder, rope_parameters=LLAMA3, original_max_position_embeddings=4)
    _assert_matches_hf(folder)


def test_rope_scaling_wins_over_rope_parameters_as_in_hf(tmp_path):
    """transformers 5 reads a transformers-4 rope_scaling before rope_parameters."""
    folder = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=2)
    _edit(folder, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
          rope_scaling={"type": "linear", "factor": 4.0})
    assert load_target(folder).cfg.rope_scaling == {"type": "linear", "factor": 4.0}
    _assert_matches_hf(folder)


def test_a_missing_num_key_value_heads_is_the_familys_default(tmp_path):
    """Mistral's config defaults it to 8 (Qwen's to 32): a Mistral of 16 heads and 8 KV heads
    whose config.json leaves it out loads in HF; it was read as 16 and refused on shapes."""
    folder = write_tiny_folder(tmp_path / "t", "mistral", num_hidden_layers=2,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=4)
    _edit(folder, drop=("num_key_value_heads",))
    assert load_target(folder).cfg.num_kv_heads == 8
    _assert_matches_hf(folder, length=12)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_missing_fields_take_hf_defaults(arch):
    from conftest import tiny_hf_config

    base = tiny_hf_config(arch, hidden_size=128, num_attention_heads=64)
    hf = base.to_dict()
    for key in ("max_position_embeddings", "num_key_value_heads"):
        del hf[key]
    want, got = type(base).from_dict(hf), ModelConfig.from_hf(hf)  # HF's reading, ours
    assert got.max_position_embeddings == want.max_position_embeddings
    assert got.num_kv_heads == want.num_key_value_heads


def test_rope_parameters_per_layer_type_are_refused(tmp_path):
    """A nested dict (one per layer type) was read as no scaling at the top-level theta."""
    folder = write_tiny_folder(tmp_path / "t", "qwen2", num_hidden_layers=2)
    _edit(folder, layer_types=["full_attention"] * 2,
          rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500.0}})
    with pytest.raises(DraftsmithError, match="RoPE parameters per layer type"):
        load_target(folder)


@pytest.mark.parametrize("fields", [
    {"partial_rotary_factor": 0.5},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
])
def test_a_partial_rotary_factor_is_refused(tmp_path, fields):
    """transformers' Llama ignores it (rotating the whole head), SGLang and vLLM rotate only that
    share of it: a target read either way would disagree with one of them. It was ignored."""
    folder = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=2)
    _edit(folder, **fields)
    with pytest.raises(DraftsmithError, match="partial_rotary_factor 0.5 .* not supported"):
        load_target(folder)
    _edit(folder, partial_rotary_factor=1.0, rope_parameters={"rope_type": "default"})
    assert load_target(folder).cfg.rope_scaling is None


@pytest.mark.parametrize(("rope", "says"), [
    ({"rope_type": "llama3", "factor": 8.0}, "'llama3' lacks the field 'low_freq_factor'"),
    ({"rope_type": "linear", "factor": "x"}, "'linear': a malformed field"),
])
def test_a_drafter_configs_broken_rope_scaling_is_one_error(rope, says):
    """draftsmith.json's rope_scaling is not read through from_hf: a bare KeyError/ValueError
    came out of the drafter's build."""
    from test_drafter import tiny_cfg

    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter

    d = tiny_cfg().to_dict()
    d["rope_scaling"] = rope
    with pytest.raises(DraftsmithError, match=says):
        Eagle3Drafter(Eagle3Config.from_dict(d))


@pytest.mark.parametrize("key", ["quantization_config", "compression_config"])
def test_a_quantized_checkpoint_is_refused(tmp_path, key):
    """An FP8 checkpoint's weights were cast to the run's dtype without their scales (a wrong
    model, silently); GPTQ/AWQ failed on a missing q_proj.weight."""
    folder = write_tiny_folder(tmp_path / "t", "llama", num_hidden_layers=2)
    _edit(folder, **{key: {"quant_method": "fp8", "activation_scheme": "dynamic"}})
    with pytest.raises(DraftsmithError, match="quantized checkpoint .quant_method 'fp8'. is not"):
        load_target(folder)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    dict(LLAMA3, original_max_position_embeddings=8192),
])
@pytest.mark.parametrize("theta", [1e4, 5e5])
def test_rope_frequencies_equal_hfs_to_the_bit(rope, theta):
    """Computed in double precision, a third of them were an fp32 ulp off transformers' (and
    SGLang's and vLLM's) float32 ones: angles a rounding apart at long positions."""
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = dict(rope, rope_theta=theta)
    hf = tf.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=rope)
    cfg = ModelConfig.from_hf({**hf.to_dict(), "model_type": "llama"})
    assert torch.equal(torch.tensor(cfg.inv_freq()), LlamaRotaryEmbedding(hf).inv_freq)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("head_dim", 15, "head_dim 15 is odd"),
    ("num_kv_heads", 0, "num_kv_heads 0 is not a size"),
])
def test_a_drafter_config_of_impossible_sizes_is_one_error(field, value, says):
    """An odd head size broke RoPE's shapes mid-forward; zero KV heads divided by zero."""
    from test_drafter import tiny_cfg

    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter

    d = tiny_cfg().to_dict()
    d[field] = value
    with pytest.raises(DraftsmithError, match=says):
        Eagle3Drafter(Eagle3Config.from_dict(d))


def test_a_cast_keeps_rope_frequencies_in_float32(tiny_llama_dir):
    """doctor and compare load an engine-layout drafter `.to(device, dtype)`: in bf16 its RoPE
    frequencies were rounded by up to 0.4 %, its rotations a radian off by position 500."""
    from test_drafter import tiny_cfg

    from draftsmith.models.eagle3 import Eagle3Drafter

    drafter = Eagle3Drafter(tiny_cfg())
    want = torch.tensor(drafter.lc.inv_freq())
    assert drafter.to(torch.bfloat16).inv_freq.dtype == torch.float32
    assert torch.equal(drafter.half().inv_freq, want)
    target = load_target(tiny_llama_dir).build(torch.float32).to(torch.bfloat16)
    assert torch.equal(target.inv_freq, torch.tensor(target.cfg.inv_freq()))
    assert target.embed.weight.dtype == torch.bfloat16
