"""Masked attention over the static KV cache in one Triton kernel, for graphed steps.

The compiled "matmul" way (two cuBLAS GEMMs around a fused softmax, plus the copies that lay the
query heads out as rows and the output back for the o projection) is five kernels a layer, about
8 us at a 25-token verify on the H200 (run 9 profile). Here a program per (row, KV head, block
of query rows, chunk of the cache) reads the query heads that share its KV head straight from
the projection's layout and streams its keys through an online softmax in float32; a second
kernel joins the chunks' partial states and writes the output in the layout the o projection
reads. Blocks are fixed (no timed pick, so no autotune draw).

CPU installs need not have Triton (`AVAILABLE`). Under `TRITON_INTERPRET=1`, set before triton is
first imported, the kernel runs on CPU tensors (tests; fp32 only: the interpreter's bf16 dot is
wrong).
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.triton_support import importable
from draftsmith.switches import env_count, env_pow2

# Blocks are fixed, from benchmarks/verify_attention.py on the H200 (run 20, us a layer within
# a 30-layer graph, bf16, 400 slots): split into 64-key chunks, 64-key blocks and 4 warps,
# 4.7 us at a 25-token batch-1 verify and 4.6 at a 4-token drafter depth, against 9.6-11.5 and
# 10.9 the compiled matmul way and ~7 unsplit. Unsplit is better from batch 8 (7.8 against 9.0
# at 8 x 25 tokens; the matmul way 18.7): see UNSPLIT_PROGRAMS.
BLOCK_N = env_pow2("DRAFTSMITH_ATTN_BLOCK_N", "64", 16)  # keys a program streams a step
BLOCK_M = 16  # query rows a program takes (tl.dot's least)
WARPS = env_pow2("DRAFTSMITH_ATTN_WARPS", "4")
STAGES = env_count("DRAFTSMITH_ATTN_STAGES", "2")
# Keys a program takes (flash-decoding: the cache split over programs, their partial softmax
# states joined by a second kernel); 0: one program takes every key of its rows.
SPLIT_KEYS = env_count("DRAFTSMITH_ATTN_SPLIT_KEYS", "64")
# The join holds every chunk's state of its rows at once (a power of two; register use grows
# with it): longer caches take longer chunks.
MAX_SPLITS = 8
# Calls whose unsplit grid already has this many programs (batch x KV heads x query-row
# blocks) skip the split and take 256-key blocks with 8 warps, the kernel's best unsplit setting
# alone (H200 run 21, us a layer: 8 x 25 tokens 7.82 against 8.94 split; 32 x 8 10.15 against
# 11.70; at batch 1, 3-15 programs, the split wins by 1.9-2.6 us). 0: always as set above. Not
# timed in the engine (the unsplit form's 40 % gain alone was nil there at batch 1, run 20).
UNSPLIT_PROGRAMS = env_count("DRAFTSMITH_ATTN_UNSPLIT_PROGRAMS", "0")
UNSPLIT_BLOCK_N, UNSPLIT_WARPS = 256, 8


def fits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Shapes the kernel takes: head_dim a power of two >= 16, q and the cache in one dtype, a
    bool mask [B, 1, G*Q, S] shared by the heads (as the prologue builds it)."""
    b, n_q, heads, d = q.shape
    return (d >= 16 and d & (d - 1) == 0 and q.dtype == k.dtype and mask is not None
            and mask.dtype == torch.bool
            and tuple(mask.shape) == (b, 1, heads // k.shape[1] * n_q, k.shape[2]))


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) | mask) v for every query head, GQA by index.

    q: [B, Q, H, D] (any strides); k, v: [B, Hkv, S, D]; mask: [B, 1, G*Q, S] bool, row
    j*Q + i for query i of the j-th head sharing a KV head (as the prologue repeats it).
    Returns [B, Q, H * D]. A row whose mask allows nothing gives zeros."""
    if not AVAILABLE:
        raise DraftsmithError("the Triton attention kernel needs the triton package")
    return torch.ops.draftsmith.cache_attention(q, k, v, mask)


def chunking(slots: int) -> tuple[int, int]:
    """(keys a program takes, programs a row block's cache is split over) for `slots` keys."""
    chunk = min(max(SPLIT_KEYS or slots, -(-slots // MAX_SPLITS)), slots)
    return chunk, -(-slots // chunk)


def plan(programs: int, slots: int, d: int = 64) -> tuple[int, int, int, int]:
    """(chunk, splits, BLOCK_N, warps) for a call whose unsplit grid has `programs` programs,
    head_dim d (unsplit blocks shrink as heads widen: their K and V tiles share memory)."""
    if UNSPLIT_PROGRAMS and programs >= UNSPLIT_PROGRAMS:
        return slots, 1, max(16, UNSPLIT_BLOCK_N * 64 // max(d, 64)), UNSPLIT_WARPS
    return *chunking(slots), BLOCK_N, WARPS


def _register() -> None:
    """Defines the op, at import: dynamo cannot trace triton.jit, so no compiled region may be
    the first to reach it."""
    from torch.library import triton_op, wrap_triton

    kernel, join = _kernels()

    @triton_op("draftsmith::cache_attention", mutates_args={})
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           ) -> torch.Tensor:
        b, n_q, heads, d = q.shape
        kv_heads, slots = k.shape[1], k.shape[2]
        g = heads // kv_heads
        out = torch.empty((b, n_q, heads * d), dtype=q.dtype, device=q.device)
        blocks = -(-g * n_q // BLOCK_M)
        chunk, splits, block_n, warps = plan(b * kv_heads * blocks, slots, d)
        if splits > 1:  # partial softmax states, one per key chunk, joined by `join`
            rows = b * kv_heads * blocks * BLOCK_M
            m_part = torch.empty((rows, splits), dtype=torch.float32, device=q.device)
            l_part = torch.empty_like(m_part)
            acc_part = torch.empty((rows, splits, d), dtype=torch.float32, device=q.device)
        else:
            m_part = l_part = acc_part = out  # unused
        wrap_triton(kernel)[(b * kv_heads, blocks, splits)](
            q, k, v, mask, out, m_part, l_part, acc_part,
            *q.stride(), *k.stride(), *v.stride(),
            mask.stride(0), mask.stride(2), mask.stride(3),
            n_q, g, kv_heads, slots, chunk, splits, d ** -0.5,
            D=d, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32, SPLIT=splits > 1,
            num_warps=warps, num_stages=STAGES,
        )
        if splits > 1:
            wrap_triton(join)[(b * kv_heads, blocks)](
                out, m_part, l_part, acc_part, n_q, g, kv_heads, splits,
                D=d, BLOCK_M=BLOCK_M, SPLITS=MAX_SPLITS, num_warps=4,
            )
        return out


def _kernels():
    """The jitted kernels (`triton.jit` reads TRITON_INTERPRET when it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(Q, K, V, M, O, MP, LP, AP,
               sqb, sqq, sqh, sqd, skb, skh, sks, skd, svb, svh, svs, svd, smb, smq, sms,
               n_q, g, kv_heads, slots, chunk, splits, scale,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               IEEE: tl.constexpr, SPLIT: tl.constexpr):
        bh = tl.program_id(0)
        b = (bh // kv_heads).to(tl.int64)  # caches past 2**31 elements
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
        lo = tl.program_id(2) * chunk
        hi = tl.minimum(lo + chunk, slots)
        for start in range(lo, hi, BLOCK_N):
            s_idx = start + tl.arange(0, BLOCK_N)
            in_cache = s_idx < hi
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
        if SPLIT:
            at = (bh * tl.num_programs(1) * BLOCK_M + r) * splits + tl.program_id(2)
            tl.store(MP + at, m_i)
            tl.store(LP + at, l_i)
            tl.store(AP + at[:, None] * D + d[None, :], acc)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            heads = kv_heads * g
            o_ptr = O + ((b * n_q + qi[:, None]) * heads + head[:, None]) * D + d[None, :]
            tl.store(o_ptr, out.to(O.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def join(O, MP, LP, AP, n_q, g, kv_heads, splits,
             D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr):
        bh = tl.program_id(0)
        b = bh // kv_heads
        h = bh % kv_heads
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = r < g * n_q
        sp = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        at = (bh * tl.num_programs(1) * BLOCK_M + r[:, None]) * splits + sp[None, :]
        used = sp[None, :] < splits
        m = tl.load(MP + at, mask=used, other=float("-inf"))
        top = tl.max(m, 1)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(m - top[:, None])
        l_sum = tl.sum(w * tl.load(LP + at, mask=used, other=0.0), 1)
        acc = tl.load(AP + at[:, :, None] * D + d[None, None, :], mask=used[:, :, None],
                      other=0.0)
        out = tl.sum(acc * w[:, :, None], 1) / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        qi = r % n_q
        head = h * g + r // n_q
        o_ptr = O + ((b * n_q + qi[:, None]) * kv_heads * g + head[:, None]) * D + d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=live[:, None])

    return attend, join


AVAILABLE = importable()
if AVAILABLE:
    _register()
