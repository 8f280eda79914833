"""Masked attention over the static KV cache in one Triton kernel, for graphed steps.

The compiled "matmul" way (two cuBLAS GEMMs around a fused softmax, plus the copies that lay the
query heads out as rows and the output back for the o projection) is five kernels a layer, about
8 us at a 25-token verify on the H200 (run 9 profile). Here one program per (row, KV head,
block of query rows) reads the query heads that share its KV head straight from the projection's
layout, streams K and V through an online softmax in float32 and writes the output in the layout
the o projection reads: one kernel. Blocks are fixed (no timed pick, so no autotune draw).

CPU installs need not have Triton (`AVAILABLE`). Under `TRITON_INTERPRET=1`, set before triton is
first imported, the kernel runs on CPU tensors (tests; fp32 only: the interpreter's bf16 dot is
wrong).
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.switches import env_count

# Key block a program streams per step, and query rows per program (16 is tl.dot's least).
BLOCK_N = env_count("DRAFTSMITH_ATTN_BLOCK_N", "256")
BLOCK_M = 16
WARPS = env_count("DRAFTSMITH_ATTN_WARPS", "8")
STAGES = env_count("DRAFTSMITH_ATTN_STAGES", "2")


def fits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Shapes the kernel takes: head_dim a power of two >= 16, a mask shared by the heads."""
    d = q.shape[-1]
    return (d >= 16 and d & (d - 1) == 0 and mask is not None and mask.shape[1] == 1
            and q.dtype == k.dtype)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) | mask) v for every query head, GQA by index.

    q: [B, Q, H, D] (any strides); k, v: [B, Hkv, S, D]; mask: [B, 1, G*Q, S] bool, row
    j*Q + i for query i of the j-th head sharing a KV head (as the prologue repeats it).
    Returns [B, Q, H * D]. A row whose mask allows nothing gives zeros."""
    if not AVAILABLE:
        raise DraftsmithError("the Triton attention kernel needs the triton package")
    return torch.ops.draftsmith.cache_attention(q, k, v, mask)


def _register() -> None:
    """Defines the op, at import: dynamo cannot trace triton.jit, so no compiled region may be
    the first to reach it."""
    from torch.library import triton_op, wrap_triton

    kernel = _kernel()

    @triton_op("draftsmith::cache_attention", mutates_args={})
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           ) -> torch.Tensor:
        b, n_q, heads, d = q.shape
        kv_heads, slots = k.shape[1], k.shape[2]
        g = heads // kv_heads
        out = torch.empty((b, n_q, heads * d), dtype=q.dtype, device=q.device)
        grid = (b * kv_heads, -(-g * n_q // BLOCK_M))
        wrap_triton(kernel)[grid](
            q, k, v, mask, out,
            *q.stride(), *k.stride(), *v.stride(),
            mask.stride(0), mask.stride(2), mask.stride(3),
            n_q, g, kv_heads, slots, d ** -0.5,
            D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32,
            num_warps=WARPS, num_stages=STAGES,
        )
        return out


def _kernel():
    """The jitted kernel (`triton.jit` reads TRITON_INTERPRET when it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(Q, K, V, M, O,
               sqb, sqq, sqh, sqd, skb, skh, sks, skd, svb, svh, svs, svd, smb, smq, sms,
               n_q, g, kv_heads, slots, scale,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               IEEE: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // kv_heads
        h = bh % kv_heads
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = r < g * n_q
        qi = r % n_q
        head = h * g + r // n_q
        d = tl.arange(0, D)
        q = tl.load(Q + b * sqb + qi[:, None] * sqq + head[:, None] * sqh + d[None, :] * sqd,
                    mask=live[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for start in range(0, slots, BLOCK_N):
            s_idx = start + tl.arange(0, BLOCK_N)
            in_cache = s_idx < slots
            k = tl.load(K + b * skb + h * skh + s_idx[:, None] * sks + d[None, :] * skd,
                        mask=in_cache[:, None], other=0.0)
            if IEEE:  # noqa: SIM108 (a branch on a constexpr: compiled out)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            allow = tl.load(M + b * smb + r[:, None] * smq + s_idx[None, :] * sms,
                            mask=live[:, None] & in_cache[None, :], other=0)
            # under inductor a float argument arrives as fp64: the scores stay fp32
            s = tl.where(allow != 0, (s * scale).to(tl.float32), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + h * svh + s_idx[:, None] * svs + d[None, :] * svd,
                        mask=in_cache[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        heads = kv_heads * g
        o_ptr = O + ((b * n_q + qi[:, None]) * heads + head[:, None]) * D + d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=live[:, None])

    return attend


try:
    import triton  # noqa: F401
except ImportError:
    AVAILABLE = False
else:
    AVAILABLE = True
    _register()
