"""A decoder layer's RMSNorm fused into the linear after it, for graphed steps of a few rows.

At a 25-token verify the default target's layer runs its qkv and gate_up linears in cuBLAS
(3.7 us each on the H200) with the norm before each (with the residual add before it) and the
silu*mul after the gate_up as kernels of their own, 1.1-1.2 us each (run 23's probe), where
the one-token step has inductor fuse them all into its linears' reductions. Here one program
takes a block of outputs and every row: it sums the residual pair (the first program writes
the sum), takes each row's mean square in a first pass over the inputs, and multiplies the
normed rows (rounded to x's dtype, times the norm weight, rounded to the weights' dtype: the
unfused norm's two roundings, HF's) in a second; for a gate_up it also takes the matching up
block and writes silu(gate) * up. Three launches fewer a layer.

Off by default (`DRAFTSMITH_NORM_LINEAR_ROWS=0`): H200 run 24 timed it 2.3-5.2 us slower a call
than the compiled norm, cuBLAS linear and silu*mul apart (qkv at 25 rows 7.1 against 4.5 us,
whatever the block of outputs), more than the launches it saves. CPU installs need not
have Triton (`AVAILABLE`); under `TRITON_INTERPRET=1` the kernel runs on CPU tensors (tests;
fp32 only: the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.triton_support import importable
from draftsmith.switches import env_count, env_pow2

# Graphed steps of more than SMALL_LINEAR_ROWS (their linears are reductions already) and at
# most this many token rows take the fused kernels when compiled on CUDA; 0: never.
NORM_LINEAR_ROWS = env_count("DRAFTSMITH_NORM_LINEAR_ROWS", "0")
BLOCK_N = env_pow2("DRAFTSMITH_NORM_LINEAR_BLOCK_N", "32", 16)  # outputs a program takes
WARPS = env_pow2("DRAFTSMITH_NORM_LINEAR_WARPS", "4")
STAGES = env_count("DRAFTSMITH_NORM_LINEAR_STAGES", "3")
# Rows a program takes (a grid axis covers more): fixed, not picked from the row count, which a
# compiled step keeps symbolic (a pick would guard on it and recompile for every count).
BLOCK_M = env_pow2("DRAFTSMITH_NORM_LINEAR_BLOCK_M", "32", 16)
BLOCK_K = 64  # inputs a program multiplies a step


def fits(rows: int) -> bool:
    """Whether a layer's norm and linear over `rows` token rows fuse (switch on)."""
    # the switch first: off, a symbolic row count gets no guard from here
    if not (NORM_LINEAR_ROWS and AVAILABLE):
        return False
    from draftsmith.models.parallel import SMALL_LINEAR_ROWS

    return SMALL_LINEAR_ROWS < rows <= NORM_LINEAR_ROWS


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, gamma: torch.Tensor, eps: float,
                w: torch.Tensor, up: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(s), w), s) with s = x + delta in x's dtype (delta None: s = x), the norm
    in fp32 rounded to w's dtype, the linear accumulated in fp32. up > 0: w stacks the gate's
    `up` rows over the up projection's `up` rows and the first output is silu(gate) * up.
    x, delta: [..., K]; gamma: [K]; w: [N, K] (or [2 * up, K]). Leading dims are kept."""
    if not AVAILABLE:
        raise DraftsmithError("the fused norm and linear need the triton package")
    if up and w.shape[0] != 2 * up:
        raise DraftsmithError(f"a gate_up of {up} outputs needs {2 * up} weight rows, not "
                              f"{w.shape[0]}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    d2 = x2 if delta is None else delta.reshape(-1, k)
    y, s = torch.ops.draftsmith.norm_linear(x2, d2, gamma, w, float(eps), delta is not None, up)
    return y.view(*lead, y.shape[-1]), s.view(*lead, k)


def _register() -> None:
    """Defines the op, at import: dynamo cannot trace triton.jit, so no compiled region may be
    the first to reach it."""
    from torch.library import triton_op, wrap_triton

    kernel = _kernel()

    @triton_op("draftsmith::norm_linear", mutates_args={})
    def op(x: torch.Tensor, delta: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor,
           eps: float, has_delta: bool, up: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, k = x.shape
        n = up or w.shape[0]
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        s = torch.empty((rows, k), dtype=x.dtype, device=x.device)
        wrap_triton(kernel)[(-(-n // BLOCK_N), -(-rows // BLOCK_M))](
            x, delta, gamma, w, y, s, rows, k, n, up, eps,
            x.stride(0), x.stride(1), delta.stride(0), delta.stride(1), w.stride(0),
            w.stride(1), HAS_DELTA=has_delta, GLU=up > 0, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32, num_warps=WARPS,
            num_stages=STAGES,
        )
        return y, s


def _kernel():
    """The jitted kernel (`triton.jit` reads TRITON_INTERPRET when it runs). Its helper is a
    module global, where Triton resolves the names a kernel calls."""
    import triton
    import triton.language as tl

    global _residual

    @triton.jit
    def _residual(X, DL, m, k, ok, sxm, sxk, sdm, sdk, HAS_DELTA: tl.constexpr):
        """The rows' residual stream at inputs k: x, or x + delta summed in x's dtype as the
        unfused add is."""
        s = tl.load(X + m[:, None] * sxm + k[None, :] * sxk, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(DL + m[:, None] * sdm + k[None, :] * sdk, mask=ok, other=0.0)
            s = (s.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
        return s

    @triton.jit
    def norm_linear(X, DL, G, W, Y, S, rows, K, N, UP, eps,
                    sxm, sxk, sdm, sdk, swn, swk,
                    HAS_DELTA: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pn = tl.program_id(0)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = m < rows
        sq = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = live[:, None] & (k[None, :] < K)
            s = _residual(X, DL, m, k, ok, sxm, sxk, sdm, sdk, HAS_DELTA)
            if pn == 0:
                tl.store(S + m[:, None] * K + k[None, :], s, mask=ok)
            f = s.to(tl.float32)
            sq += tl.sum(f * f, 1)
        # under inductor a float argument arrives as fp64: the norm stays fp32
        rstd = (1.0 / tl.sqrt(sq / K + eps)).to(tl.float32)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = live[:, None] & (k[None, :] < K)
            s = _residual(X, DL, m, k, ok, sxm, sxk, sdm, sdk, HAS_DELTA)
            g = tl.load(G + k, mask=k < K, other=0.0).to(tl.float32)
            # as llama.RMSNorm (HF's): the normed rows rounded to x's dtype, then the weight
            normed = (s.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
            a = (normed * g[None, :]).to(W.dtype.element_ty)
            wok = (k[:, None] < K) & (n[None, :] < N)
            wt = tl.load(W + n[None, :] * swn + k[:, None] * swk, mask=wok, other=0.0)
            if IEEE:  # noqa: SIM108 (a branch on a constexpr: compiled out)
                acc += tl.dot(a, wt, input_precision="ieee")
            else:
                acc += tl.dot(a, wt)
            if GLU:
                wu = tl.load(W + (n[None, :] + UP) * swn + k[:, None] * swk, mask=wok, other=0.0)
                if IEEE:
                    acc_up += tl.dot(a, wu, input_precision="ieee")
                else:
                    acc_up += tl.dot(a, wu)
        if GLU:  # silu(gate) * up from the two products as the unfused linear rounds them
            gate = acc.to(Y.dtype.element_ty).to(tl.float32)
            out = gate / (1.0 + tl.exp(-gate)) * acc_up.to(Y.dtype.element_ty).to(tl.float32)
        else:
            out = acc
        tl.store(Y + m[:, None] * N + n[None, :], out.to(Y.dtype.element_ty),
                 mask=live[:, None] & (n[None, :] < N))

    return norm_linear


AVAILABLE = importable()
if AVAILABLE:
    _register()
