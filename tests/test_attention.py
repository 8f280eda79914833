"""The decode-shape attention path gives what SDPA gives."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.models.llama import causal_mask, small_attention


def test_small_attention_equals_sdpa_with_gqa_rows_and_a_mask():
    g = torch.Generator().manual_seed(0)
    b, kv_heads, groups, q, s, d = 3, 2, 3, 4, 40, 16
    qg = torch.randn(b, kv_heads, groups * q, d, generator=g)
    k, v = torch.randn(b, kv_heads, s, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g)
    positions = torch.tensor([[5, 6, 7, 8], [20, 21, 22, 23], [0, 1, 2, 3]])
    mask = causal_mask(positions, s).repeat(1, 1, groups, 1)
    ref = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    out = small_attention(qg, k, v, mask)
    assert torch.allclose(out, ref, atol=1e-5)
    mask[0, 0, 0, 5] = False  # the mask is applied: row 0 loses the one slot it attended last
    assert not torch.allclose(small_attention(qg, k, v, mask)[0, 0, 0], ref[0, 0, 0], atol=1e-3)
