"""Review 7 of the target loader: a checkpoint holding a tensor its config builds no place for
is said in one warning line (it was dropped without a word), and a fused bias lacking one piece
names that piece alone (it named all three, two of them in the file)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_hf_model

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.models.loading import build_model


def _pair(arch: str, **over) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    hf = tiny_hf_model(arch, num_hidden_layers=2, **over)
    return ModelConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict())


def _built(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[str]]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = build_model(cfg, sd)
    ids = torch.arange(5, 17).view(2, 6)
    with torch.no_grad():
        logits = model(ids, torch.arange(6).expand(2, 6)).logits
    return logits, [str(w.message) for w in said]


@pytest.mark.parametrize(("arch", "extra"), [
    ("llama", {"model.layers.0.self_attn.q_proj.bias": torch.ones(64)}),  # attention_bias off
    ("qwen2", {"model.layers.1.self_attn.o_proj.bias": torch.ones(64)}),  # Qwen2's o: no bias
    ("llama", {"model.layers.0.self_attn.q_norm.weight": torch.ones(16),  # Qwen3's norms
               "model.layers.0.self_attn.k_norm.weight": torch.ones(16)}),
    ("mistral", {"model.mtp.proj.weight": torch.ones(4, 4)}),
])
def test_a_tensor_the_config_does_not_build_is_said_in_one_warning(arch, extra):
    cfg, sd = _pair(arch)
    plain, quiet = _built(cfg, sd)
    logits, said = _built(cfg, {**sd, **extra})
    assert not quiet
    assert torch.equal(logits, plain)  # dropped, as transformers and the engines drop it
    assert len(said) == 1 and "\n" not in said[0], said
    assert all(name in said[0] for name in extra) and "config.json" in said[0]


def test_an_old_checkpoints_rotary_inv_freq_is_no_warning():
    """transformers 4.3x saved each layer's rotary_emb.inv_freq; every loader recomputes it."""
    cfg, sd = _pair("llama")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    assert not _built(cfg, sd)[1]


@pytest.mark.parametrize("drop", ["k_proj", "v_proj"])
def test_a_fused_bias_lacking_one_piece_names_that_piece_alone(drop):
    cfg, sd = _pair("qwen2")
    del sd[f"model.layers.1.self_attn.{drop}.bias"]
    with pytest.raises(DraftsmithError) as e:
        build_model(cfg, sd)
    said = str(e.value)
    assert f"lacks model.layers.1.self_attn.{drop}.bias, which its config.json" in said
    assert "q_proj.bias" not in said
