"""The Triton code of `triton_draft_layer`: the drafter's layer as six stages, run as one
persistent kernel whose programs meet at grid barriers, or one launch a stage.

Imported only where Triton is (`triton_draft_layer.AVAILABLE`). Reads of what other programs
wrote in the same launch bypass the SM's L1 (`.cg`): L1 is not coherent between SMs.
"""

from __future__ import annotations

import triton
import triton.language as tl

SPIN_LIMIT = tl.constexpr(1 << 22)  # a barrier gives up (and flags it) rather than hang the GPU


@triton.jit
def _inv_rms(A, rows, live, eps, H: tl.constexpr, BK: tl.constexpr):
    """1 / rms of each row of A [rows, H] (fp32 sums)."""
    ss = tl.zeros([rows.shape[0]], tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(A + rows[:, None] * H + kk[None, :], mask=live[:, None] & (kk[None, :] < H),
                    other=0.0).to(tl.float32)
        ss += tl.sum(a * a, 1)
    return 1.0 / tl.sqrt(ss / H + eps)


@triton.jit
def _dot2(A, a_rows, live, W, ldw, koff, c0, c1, eps, K: tl.constexpr, NORM: tl.constexpr,
          CG: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """(x W[c0, koff:koff+K]^T, x W[c1, ...]^T) in fp32 for x = A's rows a_rows (K wide; CG: A
    was written in this launch, read past L1), or under NORM rmsnorm(A) for W with the norm's
    weights folded in: the rows' 1/rms, summed in the same pass, scales the products. The
    loaded rows feed the products as they are, which keeps their loads pipelined (a norm
    applied to them first made those stages two to three times slower on the H200)."""
    acc0 = tl.zeros([a_rows.shape[0], c0.shape[0]], tl.float32)
    acc1 = tl.zeros([a_rows.shape[0], c1.shape[0]], tl.float32)
    ss = tl.zeros([a_rows.shape[0]], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kin = kk < K
        at = A + a_rows[:, None] * K + kk[None, :]
        if CG:
            a = tl.load(at, mask=live[:, None] & kin[None, :], other=0.0, cache_modifier=".cg")
        else:
            a = tl.load(at, mask=live[:, None] & kin[None, :], other=0.0)
        if NORM:
            af = a.to(tl.float32)
            ss += tl.sum(af * af, 1)
        w0 = tl.load(W + c0[:, None] * ldw + koff + kk[None, :], mask=kin[None, :], other=0.0)
        w1 = tl.load(W + c1[:, None] * ldw + koff + kk[None, :], mask=kin[None, :], other=0.0)
        if IEEE:
            acc0 += tl.dot(a, tl.trans(w0), input_precision="ieee")
            acc1 += tl.dot(a, tl.trans(w1), input_precision="ieee")
        else:
            acc0 += tl.dot(a, tl.trans(w0))
            acc1 += tl.dot(a, tl.trans(w1))
    if NORM:
        r = 1.0 / tl.sqrt(ss / K + eps)
        acc0 = acc0 * r[:, None]
        acc1 = acc1 * r[:, None]
    return acc0, acc1


@triton.jit
def _qkv(t, TOK, EMB, X, POS, FREQ, SLOT, WQKV, QB, KC, VC, skb, skh, sks, skd,
         M, Q, eps, H: tl.constexpr, D: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr,
         BM: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    """Task t: NB rotary pairs of one q/k/v head: (norm(emb) | norm(h)) W^T (WQKV: the norms'
    weights folded in), RoPE, and q to its buffer, k and v into the cache at the rows' slots."""
    pairs = D // 2 // NB
    hh = t // pairs
    j = (t % pairs) * NB + tl.arange(0, NB)
    rows = tl.arange(0, BM)
    live = rows < M
    tok = tl.load(TOK + rows, mask=live, other=0)
    c0 = hh * D + j
    c1 = c0 + D // 2
    e0, e1 = _dot2(EMB, tok, live, WQKV, 2 * H, 0, c0, c1, eps, H, True, False, BK, IEEE)
    x0, x1 = _dot2(X, rows, live, WQKV, 2 * H, H, c0, c1, eps, H, True, False, BK, IEEE)
    dt = X.dtype.element_ty
    x0 = (x0 + e0).to(dt).to(tl.float32)
    x1 = (x1 + e1).to(dt).to(tl.float32)
    pos = tl.load(POS + rows, mask=live, other=0).to(tl.float32)
    f = pos[:, None] * tl.load(FREQ + j)[None, :]
    # reduced to [-pi, pi] first (2 pi in two parts, k * 6.28125 exact): the GPU's cos and sin
    # are approximations that lose their accuracy far from 0, and positions run to thousands
    k = tl.floor(f * 0.15915494309189535 + 0.5)
    f = (f - k * 6.28125) - k * 0.0019353071795864769
    cos = tl.cos(f).to(dt).to(tl.float32)
    sin = tl.sin(f).to(dt).to(tl.float32)
    hv = (hh + 0 * rows)[:, None]  # the head as a tensor: masks need one
    rope = hv < NH + KVH
    y0 = tl.where(rope, x0 * cos - x1 * sin, x0).to(dt)
    y1 = tl.where(rope, x1 * cos + x0 * sin, x1).to(dt)
    is_q = live[:, None] & (hv < NH)
    qa = QB + rows[:, None] * (NH * D) + c0[None, :]
    tl.store(qa, y0, mask=is_q)
    tl.store(qa + D // 2, y1, mask=is_q)
    is_k = live[:, None] & (hv >= NH) & (hv < NH + KVH)
    kvh = tl.where(hh < NH + KVH, hh - NH, hh - NH - KVH)
    slot = tl.load(SLOT + rows, mask=live, other=0)
    at = (rows // Q).to(tl.int64) * skb + kvh * skh + slot * sks
    ka = at[:, None] + j[None, :] * skd
    tl.store(KC + ka, y0, mask=is_k)
    tl.store(KC + ka + (D // 2) * skd, y1, mask=is_k)
    is_v = live[:, None] & (hv >= NH + KVH)
    tl.store(VC + ka, y0, mask=is_v)
    tl.store(VC + ka + (D // 2) * skd, y1, mask=is_v)


@triton.jit
def _attend(t, QB, KC, VC, MASK, MP, LP, AP, skb, skh, sks, skd, smb, smq, sms,
            Q, slots, chunk, splits, scale, D: tl.constexpr, NH: tl.constexpr,
            KVH: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """Task t: one KV head of one batch row over one chunk of the cache, an online softmax;
    its state (max, sum, weighted values) to the partial buffers."""
    g = NH // KVH
    bh = t // splits
    sp = t % splits
    b = (bh // KVH).to(tl.int64)
    h = bh % KVH
    r = tl.arange(0, BR)
    live = r < g * Q
    qi = r % Q
    head = h * g + r // Q
    d = tl.arange(0, D)
    q = tl.load(QB + ((b * Q + qi) * NH + head)[:, None] * D + d[None, :], mask=live[:, None],
                other=0.0, cache_modifier=".cg")
    m_i = tl.full((BR,), float("-inf"), tl.float32)
    l_i = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, D), tl.float32)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, slots)
    for start in range(lo, hi, BN):
        s_idx = start + tl.arange(0, BN)
        in_cache = s_idx < hi
        kv_at = b * skb + h * skh + s_idx[:, None] * sks + d[None, :] * skd
        k = tl.load(KC + kv_at, mask=in_cache[:, None], other=0.0, cache_modifier=".cg")
        if IEEE:  # noqa: SIM108 (a branch on a constexpr: compiled out)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        allow = tl.load(MASK + b * smb + qi[:, None] * smq + s_idx[None, :] * sms,
                        mask=live[:, None] & in_cache[None, :], other=0)
        s = tl.where(allow != 0, (s * scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + kv_at, mask=in_cache[:, None], other=0.0, cache_modifier=".cg")
        if IEEE:  # noqa: SIM108
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    at = (bh * BR + r) * splits + sp
    tl.store(MP + at, m_i)
    tl.store(LP + at, l_i)
    tl.store(AP + at[:, None] * D + d[None, :], acc)


@triton.jit
def _join(t, ATT, MP, LP, AP, Q, splits, D: tl.constexpr, NH: tl.constexpr,
          KVH: tl.constexpr, BR: tl.constexpr, SPLITS: tl.constexpr):
    """Task t: one KV head of one batch row: its chunks' states joined into the attention
    output, laid out as the o projection reads it."""
    g = NH // KVH
    b = t // KVH
    h = t % KVH
    r = tl.arange(0, BR)
    live = r < g * Q
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    at = (t * BR + r[:, None]) * splits + sp[None, :]
    used = sp[None, :] < splits
    m = tl.load(MP + at, mask=used, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(m, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(m - top[:, None])
    l_sum = tl.sum(w * tl.load(LP + at, mask=used, other=0.0, cache_modifier=".cg"), 1)
    acc = tl.load(AP + at[:, :, None] * D + d[None, None, :], mask=used[:, :, None], other=0.0,
                  cache_modifier=".cg")
    out = tl.sum(acc * w[:, :, None], 1) / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    qi = r % Q
    head = h * g + r // Q
    o_at = ATT + ((b * Q + qi[:, None]) * NH + head[:, None]) * D + d[None, :]
    tl.store(o_at, out.to(ATT.dtype.element_ty), mask=live[:, None])


@triton.jit
def _o_proj(t, ATT, X, WHN, WO, H1, M, eps, H: tl.constexpr, NHD: tl.constexpr,
            BM: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, RESID_NORMED: tl.constexpr,
            IEEE: tl.constexpr):
    """Task t: 2 NB features of h1 = residual + attention W_o^T."""
    rows = tl.arange(0, BM)
    live = rows < M
    c0 = t * 2 * NB + tl.arange(0, NB)
    o0, o1 = _dot2(ATT, rows, live, WO, NHD, 0, c0, c0 + NB, eps, NHD, False, True, BK, IEEE)
    _residual(X, WHN, H1, rows, live, c0, o0, eps, H, BK, RESID_NORMED)
    _residual(X, WHN, H1, rows, live, c0 + NB, o1, eps, H, BK, RESID_NORMED)


@triton.jit
def _residual(X, WHN, H1, rows, live, cols, o, eps, H: tl.constexpr, BK: tl.constexpr,
              RESID_NORMED: tl.constexpr):
    dt = X.dtype.element_ty
    res = tl.load(X + rows[:, None] * H + cols[None, :], mask=live[:, None], other=0.0)
    res = res.to(tl.float32)
    if RESID_NORMED:  # the residual is norm(h)
        rx = _inv_rms(X, rows, live, eps, H, BK)
        wn = tl.load(WHN + cols).to(tl.float32)
        res = (res * rx[:, None] * wn[None, :]).to(dt).to(tl.float32)
    h1 = res + o.to(dt).to(tl.float32)
    tl.store(H1 + rows[:, None] * H + cols[None, :], h1.to(dt), mask=live[:, None])


@triton.jit
def _gate_up(t, H1, WGU, ACT, M, eps, H: tl.constexpr, INTER: tl.constexpr,
             BM: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    """Task t: NB units of silu(gate) * up over norm(h1) (WGU: the norm's weights folded in)."""
    rows = tl.arange(0, BM)
    live = rows < M
    cols = t * NB + tl.arange(0, NB)
    dt = H1.dtype.element_ty
    gate, up = _dot2(H1, rows, live, WGU, H, 0, cols, cols + INTER, eps, H, True, True, BK,
                     IEEE)
    gate = gate.to(dt).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    act = silu * up.to(dt).to(tl.float32)
    tl.store(ACT + rows[:, None] * INTER + cols[None, :], act.to(dt), mask=live[:, None])


@triton.jit
def _down(t, ACT, H1, WD, OUT, M, eps, H: tl.constexpr, INTER: tl.constexpr, BM: tl.constexpr,
          BK: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    """Task t: 2 NB features of the layer's output h1 + act W_down^T."""
    rows = tl.arange(0, BM)
    live = rows < M
    c0 = t * 2 * NB + tl.arange(0, NB)
    d0, d1 = _dot2(ACT, rows, live, WD, INTER, 0, c0, c0 + NB, eps, INTER, False, True, BK,
                   IEEE)
    _add_out(H1, OUT, rows, live, c0, d0, H)
    _add_out(H1, OUT, rows, live, c0 + NB, d1, H)


@triton.jit
def _add_out(H1, OUT, rows, live, cols, down, H: tl.constexpr):
    dt = H1.dtype.element_ty
    h1 = tl.load(H1 + rows[:, None] * H + cols[None, :], mask=live[:, None], other=0.0,
                 cache_modifier=".cg")
    out = h1.to(tl.float32) + down.to(dt).to(tl.float32)
    tl.store(OUT + rows[:, None] * H + cols[None, :], out.to(dt), mask=live[:, None])


@triton.jit
def _grid_sync(SYNC, target):
    """Every program's stores so far are seen by every program after this (all programs are
    resident: the grid is no larger than the SMs). A barrier that waits past SPIN_LIMIT polls
    sets SYNC[2] and lets its program go on (wrong output, not a hung GPU)."""
    tl.debug_barrier()
    tl.atomic_add(SYNC, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(SYNC, 0, sem="acquire", scope="gpu")
    spins = seen * 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(SYNC, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.atomic_xchg(SYNC + 2, 1)
    tl.debug_barrier()


@triton.jit
def draft_layer(TOK, EMB, X, POS, FREQ, SLOT, MASK, WHN, WQKV, WO, WGU, WD,
                KC, VC, QB, MP, LP, AP, ATT, H1, ACT, OUT, SYNC,
                skb, skh, sks, skd, smb, smq, sms,
                M, Q, batch, slots, chunk, splits, eps, scale,
                H: tl.constexpr, D: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr,
                INTER: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                BN: tl.constexpr, SPLITS: tl.constexpr, NB_QKV: tl.constexpr,
                NB_O: tl.constexpr, NB_GU: tl.constexpr, NB_D: tl.constexpr,
                RESID_NORMED: tl.constexpr, IEEE: tl.constexpr, FIRST: tl.constexpr,
                LAST: tl.constexpr, BARRIER: tl.constexpr):
    """Stages FIRST..LAST of the layer (1 qkv, 2 attend, 3 join, 4 o, 5 gate_up, 6 down), each
    a loop over its tasks by the grid's programs; BARRIER: the programs meet between stages
    (one launch for all six; SYNC zeroed before it)."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    if FIRST <= 1 and LAST >= 1:
        for t in range(pid, (NH + 2 * KVH) * (D // 2 // NB_QKV), progs):
            _qkv(t, TOK, EMB, X, POS, FREQ, SLOT, WQKV, QB, KC, VC, skb, skh, sks,
                 skd, M, Q, eps, H, D, NH, KVH, BM, BK, NB_QKV, IEEE)
        if BARRIER:  # a fused launch starts at stage 1: stage s ends at the s-th meeting
            _grid_sync(SYNC, 1 * progs)
    if FIRST <= 2 and LAST >= 2:
        for t in range(pid, batch * KVH * splits, progs):
            _attend(t, QB, KC, VC, MASK, MP, LP, AP, skb, skh, sks, skd, smb, smq, sms,
                    Q, slots, chunk, splits, scale, D, NH, KVH, BR, BN, IEEE)
        if BARRIER:
            _grid_sync(SYNC, 2 * progs)
    if FIRST <= 3 and LAST >= 3:
        for t in range(pid, batch * KVH, progs):
            _join(t, ATT, MP, LP, AP, Q, splits, D, NH, KVH, BR, SPLITS)
        if BARRIER:
            _grid_sync(SYNC, 3 * progs)
    if FIRST <= 4 and LAST >= 4:
        for t in range(pid, H // (2 * NB_O), progs):
            _o_proj(t, ATT, X, WHN, WO, H1, M, eps, H, NH * D, BM, BK, NB_O, RESID_NORMED,
                    IEEE)
        if BARRIER:
            _grid_sync(SYNC, 4 * progs)
    if FIRST <= 5 and LAST >= 5:
        for t in range(pid, INTER // NB_GU, progs):
            _gate_up(t, H1, WGU, ACT, M, eps, H, INTER, BM, BK, NB_GU, IEEE)
        if BARRIER:
            _grid_sync(SYNC, 5 * progs)
    if FIRST <= 6 and LAST >= 6:
        for t in range(pid, H // (2 * NB_D), progs):
            _down(t, ACT, H1, WD, OUT, M, eps, H, INTER, BM, BK, NB_D, IEEE)
