"""The drafter's vocabulary head and a greedy tree depth's top-k in one Triton pass.

At a batch-1 draft depth the head is a 4-row product with the 24,576 x 576 draft vocabulary
(28 MB of bf16 weights, 7.7 us in cuBLAS on the H200), followed by the chunked top-k and its
logsumexp, more kernels of a few us each (run 9's profile: ~11 us a depth). Here one program
takes a block of the vocabulary for every row: it forms those logits with fp32 sums rounded to
the weights' dtype (as cuBLAS rounds its output), keeps their max and sum of exponentials, and
the block's k best (ties to the lower id); a few tensor ops join the blocks. The logits never
reach memory.

Used by greedy trees under `DRAFTSMITH_DRAFT_HEAD=triton` (the default on CUDA since H200 run 24:
draft 0.415 against 0.469 ms at tree 7/4/24, batch 1); `benchmarks/draft_head.py` times it alone
against the compiled way.

The head may also come in int8 (`quantize_head`: one fp32 scale a vocabulary row, symmetric,
max|w_row| / 127), half the bytes of a pass that reads 28 MB for 4 rows: the kernel converts its
int8 tiles to x's dtype (exact for |q| <= 127), sums as before, scales each vocabulary entry's
fp32 sum by its row's scale and rounds that to x's dtype. Greedy trees use it under
`DRAFTSMITH_DRAFT_HEAD=triton-int8`: the draft only proposes and the verify keeps the output
exact, so other drafts change the speed, never the tokens.
CPU installs need not have Triton (`AVAILABLE`); under `TRITON_INTERPRET=1` it runs on CPU
tensors (tests, fp32).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.triton_support import importable
from draftsmith.switches import env_choice

BLOCK_V = 128  # vocabulary entries a program takes
BLOCK_H = 64  # hidden features a program multiplies a step
BLOCK_R = 16  # rows a program takes (tl.dot's least; a grid axis covers more)
WARPS = 4
STAGES = 3  # software pipelining of the walk over the hidden features (Triton's default)
MAX_K = 16
# Who joins the blocks: a few tensor ops after the kernel ("torch": run 24's, one fused kernel of
# ~3.4 us a depth in the H200's run 25 probe), or the kernel's own last program of each block of
# rows, which a counter names ("kernel": one launch fewer a depth, but that one program walks its
# rows' picks one after another: H200 run 26, tree 7/4/24, draft 0.480 against 0.424 ms).
JOIN = env_choice("DRAFTSMITH_HEAD_JOIN", "torch", ("torch", "kernel"))
COUNTERS = 1024  # row programs a counter buffer serves (`counter()`)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton reads it


def runs_on(t: torch.Tensor) -> bool:
    """Whether the kernel can run on t's device: CUDA, or any under Triton's interpreter."""
    return AVAILABLE and (t.is_cuda or INTERPRETED)


def counter(device: torch.device | str) -> torch.Tensor:
    """A zeroed counter buffer for `head_top_k(..., counts=...)`: the kernel's programs count
    themselves in it and its last program of a row block resets its entry, so one buffer
    serves every call on one stream."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def quantize_head(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [V, H], scale fp32 [V]) with w ~ q * scale[:, None]: symmetric, one scale a row,
    max|w_row| / 127, so |w - q * scale| <= scale / 2; a row of zeros gets scale 1."""
    if w.dim() != 2 or not w.is_floating_point():
        raise DraftsmithError(f"quantize_head: a [V, H] floating-point head, got "
                              f"{tuple(w.shape)} {w.dtype}")
    wf = w.detach().float()
    amax = wf.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def head_top_k(x: torch.Tensor, w: torch.Tensor, k: int, counts: torch.Tensor | None = None,
               *, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax values [R, k] fp32, ids [R, k] int64) of the k best of x @ w.T per row,
    best first, ties to the lower id. x: [R, H]; w: [V, H], same dtype, or int8 with scale
    (fp32 [V], `quantize_head`: the logits are x @ (w * scale[:, None]).T rounded to x's dtype).
    counts (`counter()`): the kernel joins its blocks itself (DRAFTSMITH_HEAD_JOIN=kernel),
    else tensor ops do."""
    if not AVAILABLE:
        raise DraftsmithError("the Triton head kernel needs the triton package")
    check_scale(w, scale)
    if (x.dim() != 2 or not 0 < k <= min(MAX_K, w.shape[0]) or x.shape[-1] != w.shape[1]
            or x.dtype != w.dtype and scale is None):
        raise DraftsmithError(f"head_top_k: top-{k} of {tuple(x.shape)} x {tuple(w.shape)} "
                              f"({x.dtype}, {w.dtype}); k must be 1-{MAX_K}")
    if counts is not None:
        if -(-x.shape[0] // BLOCK_R) > counts.numel() or counts.dtype != torch.int32:
            raise DraftsmithError(f"head_top_k: {x.shape[0]} rows need an int32 counter of "
                                  f">= {-(-x.shape[0] // BLOCK_R)} entries, got "
                                  f"{counts.numel()} ({counts.dtype})")
        if scale is not None:
            return torch.ops.draftsmith.head_top_k_joined_int8(x, w, scale, k, counts)
        return torch.ops.draftsmith.head_top_k_joined(x, w, k, counts)
    if scale is not None:
        vals, ids, bmax, bsum = torch.ops.draftsmith.head_blocks_int8(x, w, scale, k)
    else:
        vals, ids, bmax, bsum = torch.ops.draftsmith.head_blocks(x, w, k)
    return join_blocks(vals, ids, bmax, bsum, k)


def check_scale(w: torch.Tensor, scale: torch.Tensor | None) -> None:
    """An int8 head comes with its rows' fp32 scales (`quantize_head`), and only an int8 one."""
    int8 = w.dtype == torch.int8
    if int8 and scale is None:
        raise DraftsmithError("head_top_k: an int8 head needs scale= (its rows' fp32 scales, "
                              "from quantize_head)")
    if scale is not None and not int8:
        raise DraftsmithError(f"head_top_k: scale= is for an int8 head, not {w.dtype}; pass "
                              f"the head alone")
    if scale is not None and (scale.dtype != torch.float32 or scale.shape != w.shape[:1]):
        raise DraftsmithError(f"head_top_k: scale must be float32 [{w.shape[0]}] (one a "
                              f"vocabulary row), got {scale.dtype} {tuple(scale.shape)}")


def join_blocks(vals: torch.Tensor, ids: torch.Tensor, bmax: torch.Tensor, bsum: torch.Tensor,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' candidates [R, blocks, k] and (max, sum of exp) [R, blocks] -> the rows'
    k best as log-probabilities. Candidates lie block by block, each block's best first, so
    the first of equal values is the lowest id."""
    from draftsmith.engine.tree import top_k_by_max

    gv, gi = top_k_by_max(vals.flatten(1), k)
    top = bmax.max(1, keepdim=True).values
    lse = top + (bsum * (bmax - top).exp()).sum(1, keepdim=True).log()
    return gv - lse, ids.flatten(1).gather(1, gi)


def _register() -> None:
    import triton
    from torch.library import triton_op, wrap_triton

    kernel, kernel_int8 = _kernel(), _kernel(scaled=True)

    def launch(x: torch.Tensor, w: torch.Tensor, k: int, counts: torch.Tensor | None,
               out: tuple[torch.Tensor, ...], scale: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, ...]:
        rows, hidden = x.shape
        blocks = -(-w.shape[0] // BLOCK_V)
        f32 = {"dtype": torch.float32, "device": x.device}
        vals = torch.empty((rows, blocks, k), **f32)
        ids = torch.empty((rows, blocks, k), dtype=torch.int64, device=x.device)
        bmax, bsum = torch.empty((rows, blocks), **f32), torch.empty((rows, blocks), **f32)
        join = counts is not None
        if not join:  # never written then, yet distinct: aliases may be cloned apart
            out = (torch.empty(0, **f32), torch.empty(0, dtype=torch.int64, device=x.device))
            counts = torch.empty(0, dtype=torch.int32, device=x.device)
        fn, ws = (kernel, (w,)) if scale is None else (kernel_int8, (w, scale))
        wrap_triton(fn)[(blocks, -(-rows // BLOCK_R))](
            x, *ws, vals, ids, bmax, bsum, *out, counts, rows, hidden, w.shape[0], blocks,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            K=k, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, BLOCK_R=BLOCK_R,
            IEEE=x.dtype == torch.float32, JOIN=join,
            CANDS=max(2, triton.next_power_of_2(blocks * k)),
            BLOCKS=max(2, triton.next_power_of_2(blocks)),
            num_warps=WARPS, num_stages=STAGES,
        )
        return (vals, ids, bmax, bsum)

    @triton_op("draftsmith::head_blocks", mutates_args={})
    def op(x: torch.Tensor, w: torch.Tensor, k: int,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch(x, w, k, None, ())

    @triton_op("draftsmith::head_top_k_joined", mutates_args={"counts"})
    def joined(x: torch.Tensor, w: torch.Tensor, k: int, counts: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        v = torch.empty((x.shape[0], k), dtype=torch.float32, device=x.device)
        i = torch.empty((x.shape[0], k), dtype=torch.int64, device=x.device)
        launch(x, w, k, counts, (v, i))
        return v, i

    @triton_op("draftsmith::head_blocks_int8", mutates_args={})
    def op_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, k: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch(x, w, k, None, (), scale)

    @triton_op("draftsmith::head_top_k_joined_int8", mutates_args={"counts"})
    def joined_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, k: int,
                    counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = torch.empty((x.shape[0], k), dtype=torch.float32, device=x.device)
        i = torch.empty((x.shape[0], k), dtype=torch.int64, device=x.device)
        launch(x, w, k, counts, (v, i), scale)
        return v, i


def _kernel(scaled: bool = False):
    """The kernel for a head in x's dtype, or (scaled) for an int8 head and its rows' scales:
    two entries, one body (`head_pass`, inlined), whose SCALED branches compile out of the
    first."""
    import triton
    import triton.language as tl

    global head_pass  # the entries call it by a global name: Triton's interpreter drops closures
    head_pass = _pass()

    @triton.jit
    def head_blocks(X, W, VALS, IDS, BMAX, BSUM, OUT_V, OUT_I, COUNTS, rows, hidden, vocab,
                    blocks, sxr, sxh, swv, swh,
                    K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_R: tl.constexpr, IEEE: tl.constexpr, JOIN: tl.constexpr,
                    CANDS: tl.constexpr, BLOCKS: tl.constexpr):
        head_pass(X, W, W, VALS, IDS, BMAX, BSUM, OUT_V, OUT_I, COUNTS, rows, hidden, vocab,
                  blocks, sxr, sxh, swv, swh, K, BLOCK_V, BLOCK_H, BLOCK_R, IEEE, JOIN, CANDS,
                  BLOCKS, tl.constexpr(False))  # tl named in the body: its annotations need it

    @triton.jit
    def head_blocks_int8(X, W, SCALE, VALS, IDS, BMAX, BSUM, OUT_V, OUT_I, COUNTS, rows,
                         hidden, vocab, blocks, sxr, sxh, swv, swh,
                         K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_R: tl.constexpr, IEEE: tl.constexpr, JOIN: tl.constexpr,
                         CANDS: tl.constexpr, BLOCKS: tl.constexpr):
        head_pass(X, W, SCALE, VALS, IDS, BMAX, BSUM, OUT_V, OUT_I, COUNTS, rows, hidden,
                  vocab, blocks, sxr, sxh, swv, swh, K, BLOCK_V, BLOCK_H, BLOCK_R, IEEE, JOIN,
                  CANDS, BLOCKS, tl.constexpr(True))

    return head_blocks_int8 if scaled else head_blocks


@cache
def _pass():
    """The kernel's body, for `_kernel`'s entries."""
    import triton
    import triton.language as tl

    @triton.jit
    def head_pass(X, W, SCALE, VALS, IDS, BMAX, BSUM, OUT_V, OUT_I, COUNTS, rows, hidden, vocab,
                  blocks, sxr, sxh, swv, swh,
                  K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_R: tl.constexpr, IEEE: tl.constexpr, JOIN: tl.constexpr,
                  CANDS: tl.constexpr, BLOCKS: tl.constexpr, SCALED: tl.constexpr):
        blk = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        v = (blk * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)  # vocabularies past 2**31 / H
        live_r, live_v = r < rows, v < vocab
        acc = tl.zeros((BLOCK_R, BLOCK_V), tl.float32)
        for start in range(0, hidden, BLOCK_H):
            h = start + tl.arange(0, BLOCK_H)
            xs = tl.load(X + r[:, None] * sxr + h[None, :] * sxh,
                         mask=live_r[:, None] & (h[None, :] < hidden), other=0.0)
            ws = tl.load(W + v[:, None] * swv + h[None, :] * swh,
                         mask=live_v[:, None] & (h[None, :] < hidden), other=0.0)
            if SCALED:  # int8 weights: exact in x's dtype, so the dot is x's own
                ws = ws.to(X.dtype.element_ty)
            if IEEE:  # noqa: SIM108 (a branch on a constexpr: compiled out)
                acc += tl.dot(xs, tl.trans(ws), input_precision="ieee")
            else:
                acc += tl.dot(xs, tl.trans(ws))
        # rounded to the weights' dtype, as the cuBLAS head's output is: in bf16 equal logits
        # are common and go to the lower id; fp32 ones do not tie (H200 run 22, fp32: other
        # trees, 4.15 tokens accepted a cycle against 4.22)
        if SCALED:  # the row's scale, then x's dtype, as the bf16 head's logits round
            rounded = (acc * tl.load(SCALE + v, mask=live_v, other=1.0)[None, :]).to(
                X.dtype.element_ty)
        else:
            rounded = acc.to(W.dtype.element_ty)
        logits = tl.where(live_v[None, :], rounded.to(tl.float32), float("-inf"))
        m = tl.max(logits, 1)
        at = r.to(tl.int64) * blocks + blk
        tl.store(BMAX + at, m, mask=live_r)
        tl.store(BSUM + at, tl.sum(tl.exp(logits - m[:, None]), 1), mask=live_r)
        for j in tl.static_range(K):
            best = tl.max(logits, 1)
            pick = tl.argmax(logits, 1, tie_break_left=True)
            tl.store(VALS + at * K + j, best, mask=live_r)
            tl.store(IDS + at * K + j, blk.to(tl.int64) * BLOCK_V + pick, mask=live_r)
            logits = tl.where(tl.arange(0, BLOCK_V)[None, :] == pick[:, None], float("-inf"),
                              logits)
        if JOIN:
            tl.debug_barrier()  # every thread's stores above come before the count
            done = tl.atomic_add(COUNTS + tl.program_id(1), 1, sem="acq_rel")
            if done == blocks - 1:  # the row block's last program: the others have stored
                # `join_blocks` for its rows, read past the SM's L1 (an earlier call's lines)
                c = tl.arange(0, CANDS)
                bb = tl.arange(0, BLOCKS)
                for rr in tl.static_range(BLOCK_R):
                    row = tl.program_id(1) * BLOCK_R + rr
                    if row < rows:  # names of their own: Triton types a name once
                        ra = row.to(tl.int64) * blocks
                        cand = tl.load(VALS + ra * K + c, mask=c < blocks * K,
                                       other=float("-inf"), cache_modifier=".cg")
                        bm = tl.load(BMAX + ra + bb, mask=bb < blocks, other=float("-inf"),
                                     cache_modifier=".cg")
                        z = tl.load(BSUM + ra + bb, mask=bb < blocks, other=0.0,
                                    cache_modifier=".cg")
                        top = tl.max(bm, 0)
                        lse = top + tl.log(tl.sum(z * tl.exp(bm - top), 0))
                        for jj in tl.static_range(K):
                            jb = tl.max(cand, 0)
                            jp = tl.argmax(cand, 0, tie_break_left=True)
                            tl.store(OUT_V + row * K + jj, jb - lse)
                            tl.store(OUT_I + row * K + jj,
                                     tl.load(IDS + ra * K + jp, cache_modifier=".cg"))
                            cand = tl.where(c == jp, float("-inf"), cand)
                tl.atomic_xchg(COUNTS + tl.program_id(1), 0)  # the next call counts from 0

    return head_pass


AVAILABLE = importable()
if AVAILABLE:
    _register()
