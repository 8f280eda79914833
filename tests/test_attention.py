"""The decode-shape attention path and the one-write KV cache give what SDPA and two writes give."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import write_tiny_folder

from draftsmith.models.llama import KVCache, causal_mask, small_attention


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


def test_one_write_pool_cache_equals_separate_k_and_v_writes(tmp_path):
    from draftsmith.targets import load_target

    model = load_target(write_tiny_folder(tmp_path, "llama")).build(torch.float32, "cpu")
    att = model.layers[0].attn
    ids, pos = torch.randint(5, 100, (2, 9)), torch.arange(9).expand(2, 9)

    def run(pooled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        pool = torch.zeros(len(model.layers), 2, 2, att.kv_heads, 16, att.d)
        caches = [KVCache(p[0], p[1], p if pooled else None) for p in pool]
        with torch.no_grad():
            logits = model(ids, pos, caches).logits
        return logits, pool

    (la, pa), (lb, pb) = run(True), run(False)
    assert torch.equal(la, lb) and torch.equal(pa, pb)
    assert pa[:, :, :, :, :9].abs().sum() > 0 and pa[:, :, :, :, 9:].abs().sum() == 0
