"""The compiled, graphed engine (Triton cache attention, reduction linears) against HF
transformers on every claimed family variant: prefill, multi-token verify steps and one-token
decode steps through the KV cache, in fp32 on CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model

from draftsmith.engine.runtime import Runtime
from draftsmith.models.config import ModelConfig
from draftsmith.models.loading import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}


@pytest.mark.parametrize(("arch", "over"), [
    ("llama", {"rope_parameters": LLAMA3}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", {"head_dim": 32, "attention_bias": True}),
    ("qwen2", {"head_dim": 8, "num_key_value_heads": 1}),
    ("qwen3", {"attention_bias": True}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),
    ("mistral", {"sliding_window": 16}),
])
def test_graphed_steps_match_hf(arch, over):
    hf = tiny_hf_model(arch, num_hidden_layers=3, **over)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = build_model(cfg, hf.state_dict(), torch.float32, "cuda")
    rt = Runtime(model, 2, 16, graphs=True, compile=True)
    rt.capture([2], [1, 4])
    ids = torch.randint(5, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        ref = hf(ids).logits
    cuts = [0, 4, 8, 12, 13, 14, 15, 16]  # an eager prefill, two verify steps, four decode steps
    got = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        out = rt.forward(ids[:, a:b].cuda(), pos[:, a:b].cuda())
        got.append(out.logits.float().cpu().clone())
    assert (torch.cat(got, 1) - ref).abs().max() < 2e-3
