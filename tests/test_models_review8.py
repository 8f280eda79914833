"""Review 8 of the target loader: a base model's checkpoint (LlamaModel.save_pretrained: tensor
names without "model.", no lm_head) loads where its config ties the head to the embedding, as
transformers loads it, and is refused in one line naming the missing head where it does not
(it was "no weights for decoder layer 0" either way)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.models.loading import build_model
from draftsmith.targets.hf import read_config, read_weights

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def _base_folder(tmp_path: Path, tied: bool) -> Path:
    torch.manual_seed(0)
    folder = tmp_path / "base"
    LlamaModel(LlamaConfig(**TINY, tie_word_embeddings=tied)).save_pretrained(folder)
    return folder


def test_a_tied_base_model_checkpoint_loads_as_transformers_loads_it(tmp_path):
    folder = _base_folder(tmp_path, tied=True)
    assert not any(k.startswith("model.") for k in read_weights(folder))  # what HF writes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tensor said unread
        model = build_model(ModelConfig.from_hf(read_config(folder)), read_weights(folder))
    hf = LlamaForCausalLM.from_pretrained(folder).eval()
    ids = torch.arange(3, 15).view(2, 6)
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids, torch.arange(6).expand(2, 6)).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_an_untied_base_model_checkpoint_is_refused_naming_the_missing_head(tmp_path):
    """transformers fills such a head with random numbers (a MISSING line in its load report);
    draftsmith would decode garbage from it, so it says what is missing and what to use."""
    folder = _base_folder(tmp_path, tied=False)
    with pytest.raises(DraftsmithError) as e:
        build_model(ModelConfig.from_hf(read_config(folder)), read_weights(folder))
    msg = str(e.value)
    assert "\n" not in msg
    assert "lm_head.weight" in msg and "tie_word_embeddings" in msg and "ForCausalLM" in msg


def test_a_prefixed_checkpoint_is_read_as_before():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    sd = dict(hf.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = build_model(ModelConfig.from_hf(hf.config.to_dict()), sd)
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])


def test_a_base_model_targets_weights_carry_the_causal_lms_names(tmp_path):
    """Target.weights feeds more than the build (the embedding under TP, training's head): a base
    checkpoint's names arrive there prefixed too, so `model.embed_tokens.weight` is found."""
    from draftsmith.targets import load_target
    from draftsmith.targets.tokenizer import write_byte_tokenizer

    folder = _base_folder(tmp_path, tied=True)
    write_byte_tokenizer(folder, vocab_size=TINY["vocab_size"])
    t = load_target(str(folder))
    assert "model.embed_tokens.weight" in t.weights
    assert not any(k.startswith("layers.") for k in t.weights)
    assert len(t.weights) == len(read_weights(folder))
