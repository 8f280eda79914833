"""Review 6 of the target and drafter models: bf16 parity with HF transformers, bit for bit on
CPU, where a rounding that differs from HF's moves hidden states by an ulp and flips greedy
near-ties."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_folder

from draftsmith.models.llama import RMSNorm
from draftsmith.targets import load_target


def test_rmsnorm_rounds_as_hf_in_bf16():
    """HF casts the normed rows to the input dtype before the weight multiplies them: two
    roundings in bf16, where one rounding differs by an ulp in many entries."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ours, hf = RMSNorm(256, 1e-6), LlamaRMSNorm(256, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(256))
        ours.weight.copy_(hf.weight)
    ours, hf = ours.bfloat16(), hf.bfloat16()
    x = torch.randn(64, 256).bfloat16()
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x))


@pytest.mark.parametrize(("arch", "over"), [
    ("llama", {}),
    ("qwen3", {}),  # q/k norms
    ("llama", {"attention_bias": True}),  # o's bias added in its product, as HF's nn.Linear
])
def test_bf16_hidden_states_and_logits_equal_hf_bit_for_bit(tmp_path, arch, over):
    """Every layer's residual stream, the final hidden state and the logits of a bf16 target
    equal HF's (its SDPA attention, as ours runs uncached) exactly."""
    import transformers as tf

    folder = write_tiny_folder(tmp_path / arch, arch, **over)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                 dtype=torch.bfloat16).eval()
    ours = load_target(folder).build(torch.bfloat16)
    torch.manual_seed(1)
    ids = torch.randint(5, 100, (2, 23))
    layers = hf.config.num_hidden_layers
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, torch.arange(23).expand(2, 23), aux_ids=tuple(range(-1, layers - 1)))
    for i in range(layers):
        assert torch.equal(out.aux[:, :, i], ref.hidden_states[i]), f"layer {i - 1} output"
    assert torch.equal(out.hidden, ref.hidden_states[-1])
    assert torch.equal(out.logits, ref.logits)
