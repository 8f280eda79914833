"""The Triton cache attention (DRAFTSMITH_VERIFY_ATTENTION=triton) gives what the matmul way
gives: on CPU in Triton's interpreter (fp32; conftest turns it on), on a GPU compiled (fp32 and
bf16)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.models.llama import causal_mask, matmul_attention

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              ) -> torch.Tensor:
    """The matmul way, laid out as the kernel's output: [B, Q, H * D]."""
    b, n, heads, d = q.shape
    kv_heads = k.shape[1]
    qg = q.transpose(1, 2).reshape(b, kv_heads, heads // kv_heads * n, d)
    out = matmul_attention(qg, k, v, mask).reshape(b, heads, n, d)
    return out.transpose(1, 2).reshape(b, n, heads * d)


def draw(b: int, n: int, heads: int, kv_heads: int, s: int, d: int, seed: int,
         dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    # q as the projection leaves it: a view into a wider [B, Q, (H + 2 Hkv) D] row
    qkv = torch.randn(b, n, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    q = qkv[..., : heads * d].view(b, n, heads, d)
    k = torch.randn(b, kv_heads, s, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, kv_heads, s, d, generator=g).to(DEVICE, dtype)
    return q, k, v


@pytest.mark.parametrize("split_keys", [0, 32, 50])
@pytest.mark.parametrize("b,n,heads,kv_heads,s,d", [(2, 25, 6, 2, 150, 16), (1, 1, 9, 3, 70, 32),
                                                    (3, 4, 4, 4, 64, 16)])
def test_cache_attention_equals_the_matmul_way(monkeypatch, b, n, heads, kv_heads, s, d,
                                               split_keys):
    """Verify (25 tokens, a tree's holes), one-token and MHA shapes; caches longer than one key
    block and not a multiple of it; query heads read through the projection's strides; the
    cache in one program's loop, or split over programs (the last chunk short, and chunks
    whose keys the mask all hides) and joined."""
    from draftsmith.models import triton_attention
    from draftsmith.models.triton_attention import cache_attention

    monkeypatch.setattr(triton_attention, "BLOCK_N", 32)
    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", split_keys)

    q, k, v = draw(b, n, heads, kv_heads, s, d, seed=n)
    positions = torch.arange(n).repeat(b, 1) + torch.arange(b).unsqueeze(1) * 37 + 3
    mask = causal_mask(positions, s).to(DEVICE)
    mask[0, 0, -1, positions[0, 0]] = False  # a tree-like hole
    mask = mask.repeat(1, 1, heads // kv_heads, 1)
    out = cache_attention(q, k, v, mask)
    assert out.shape == (b, n, heads * d)
    assert torch.allclose(out, reference(q, k, v, mask), atol=1e-5)
    mask[-1, 0, 0, 0] = False  # the mask is applied: the first query loses its first slot
    assert not torch.allclose(cache_attention(q, k, v, mask)[-1, 0], out[-1, 0], atol=1e-4)


def test_a_long_cache_is_split_into_at_most_max_splits_chunks(monkeypatch):
    """4-key chunks over 150 slots would be 38; the cap makes them 8 of 19 keys (the join
    holds every chunk's state at once), and the values do not change."""
    from draftsmith.models import triton_attention

    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", 4)
    monkeypatch.setattr(triton_attention, "BLOCK_N", 16)
    assert triton_attention.chunking(150) == (19, 8)
    assert triton_attention.chunking(40) == (5, 8)
    assert triton_attention.chunking(20) == (4, 5)
    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", 0)
    assert triton_attention.chunking(150) == (150, 1)
    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", 4)
    q, k, v = draw(1, 25, 6, 2, 150, 16, seed=3)
    mask = causal_mask(torch.arange(25).unsqueeze(0) + 120, 150).repeat(1, 1, 3, 1).to(DEVICE)
    out = triton_attention.cache_attention(q, k, v, mask)
    assert torch.allclose(out, reference(q, k, v, mask), atol=1e-5)


def test_calls_with_many_programs_skip_the_split_when_told(monkeypatch):
    """DRAFTSMITH_ATTN_UNSPLIT_PROGRAMS=24: a 1 x 25 verify over 3 KV heads (3 x 5 = 15
    programs) stays split; 8 x 25 (120) and 32 x 8 (192) run unsplit in 256-key blocks with 8
    warps, and the values do not change."""
    from draftsmith.models import triton_attention as ta

    monkeypatch.setattr(ta, "SPLIT_KEYS", 16)
    monkeypatch.setattr(ta, "BLOCK_N", 16)
    assert ta.plan(120, 150) == (19, 8, 16, ta.WARPS)  # off (0): split whatever the grid
    monkeypatch.setattr(ta, "UNSPLIT_PROGRAMS", 24)
    assert ta.plan(15, 400) == (50, 8, 16, ta.WARPS)
    assert ta.plan(120, 400) == ta.plan(192, 400) == (400, 1, 256, 8)
    assert ta.plan(120, 400, 128) == (400, 1, 128, 8)  # wider heads, shorter blocks
    q, k, v = draw(6, 9, 6, 2, 150, 16, seed=11)  # 6 x 2 KV heads x 2 blocks of 27 rows: 24
    positions = torch.arange(9).repeat(6, 1) + torch.arange(6).unsqueeze(1) * 20 + 5
    mask = causal_mask(positions, 150).repeat(1, 1, 3, 1).to(DEVICE)
    seen = []
    real = ta.plan
    monkeypatch.setattr(ta, "plan", lambda *a: seen.append(real(*a)) or seen[-1])
    out = ta.cache_attention(q, k, v, mask)
    assert seen == [(150, 1, 256, 8)]
    assert torch.allclose(out, reference(q, k, v, mask), atol=1e-5)


@pytest.mark.parametrize("split_keys", [0, 16])
def test_a_row_that_may_attend_nothing_gives_zeros(monkeypatch, split_keys):
    """A padded batch row (mask all False) gives zeros where softmax would give NaN."""
    from draftsmith.models import triton_attention
    from draftsmith.models.triton_attention import cache_attention

    monkeypatch.setattr(triton_attention, "SPLIT_KEYS", split_keys)

    q, k, v = draw(2, 3, 4, 2, 40, 16, seed=5)
    mask = causal_mask(torch.arange(3).repeat(2, 1) + 10, 40).repeat(1, 1, 2, 1).to(DEVICE)
    mask[1] = False
    out = cache_attention(q, k, v, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.allclose(out[0], reference(q, k, v, mask)[0], atol=1e-5)


def test_fits_only_shapes_the_kernel_takes():
    from draftsmith.models.triton_attention import fits

    q, k, _ = draw(1, 2, 4, 2, 32, 16, seed=0)
    mask = torch.ones(1, 1, 4, 32, dtype=torch.bool)
    assert fits(q, k, mask)
    assert not fits(q, k, None)
    assert not fits(q, k, mask.expand(1, 2, 4, 32))  # per-head masks
    assert not fits(q, k, mask.float())  # an additive mask reads otherwise
    assert not fits(q, k, mask[..., :16])  # not the cache's length
    assert not fits(q, k, mask[:, :, :2])  # not one row per (head in the group, query)
    assert not fits(q, k.double(), mask)  # q and the cache in other dtypes
    q3, k3, _ = draw(1, 2, 4, 2, 32, 24, seed=0)
    assert not fits(q3, k3, mask)  # head_dim not a power of two


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 dot is wrong)")
def test_cache_attention_in_bf16_at_the_default_targets_verify_shape():
    """SmolLM2-135M's heads (9 over 3 KV heads, head_dim 64), a 25-token tree over 400 slots."""
    from draftsmith.models.triton_attention import cache_attention

    q, k, v = draw(1, 25, 9, 3, 400, 64, seed=7, dtype=torch.bfloat16)
    mask = causal_mask(torch.arange(25).unsqueeze(0) + 300, 400).to(DEVICE)
    mask[0, 0, 20:, 310:320] = False
    mask = mask.repeat(1, 1, 3, 1)
    out = cache_attention(q, k, v, mask)
    ref = reference(q.float(), k.float(), v.float(), mask)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, atol=2e-2)
