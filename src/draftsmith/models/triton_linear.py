"""Skinny linears (a verify's or a drafter depth's few rows) split over their inputs in Triton.

At 3-32 rows a linear of the default target reads at most 3.5 MB of weights, so it is bound by
latency, not bandwidth: cuBLAS takes ~3.7 us for each of the four a layer (H200 run 9 profile),
about half of a verify's kernel time. The split attention of run 20 showed what these sizes
reward: more programs, each with one short dependent chain. Here a program takes a block of
outputs and one chunk of the inputs, and writes its fp32 partial sums; the caller sums the
chunks, which inductor unrolls into the loads of the kernel that consumes the result (at most
`MAX_SPLITS`, its unroll limit), so the linear stays one launch.

Off by default (`DRAFTSMITH_SPLIT_LINEAR_ROWS=0`): faster alone by 0.8-1.5 us a linear at 4 and 25
rows, it made the engine's verify 3 % slower (H200 run 21, tree 7/4/24: 1.011 against 0.983 ms,
fresh caches, one call); kept for the A/B on other GPUs and targets. CPU installs need not
have Triton (`AVAILABLE`); under `TRITON_INTERPRET=1` the kernel runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.triton_support import importable
from draftsmith.switches import env_count, env_pow2

# Linears over more than SMALL_LINEAR_ROWS and at most this many rows take the split kernel when
# compiled on CUDA; 0: never (cuBLAS).
SPLIT_LINEAR_ROWS = env_count("DRAFTSMITH_SPLIT_LINEAR_ROWS", "0")
BLOCK_N = env_pow2("DRAFTSMITH_LINEAR_BLOCK_N", "64", 16)  # outputs a program takes
BLOCK_M = 32  # rows a program takes (a grid axis covers more)
BLOCK_K = 64  # inputs a program multiplies a step
MAX_SPLITS = 8  # inductor unrolls reductions of at most 8 elements into their consumer
# Linears with more outputs on this rank (vocabulary heads, unsharded) are bandwidth-bound:
# cuBLAS keeps them.
MAX_OUTPUTS = 8192


def fits(rows: int, w: torch.Tensor) -> bool:
    """Whether a linear of `rows` rows and weight w takes the split kernel (switch on)."""
    # the switch first: off, a symbolic row count gets no guard from here
    if not (SPLIT_LINEAR_ROWS and AVAILABLE) or w.shape[0] > MAX_OUTPUTS:
        return False
    return rows <= SPLIT_LINEAR_ROWS


def splitting(k: int) -> tuple[int, int]:
    """(inputs a program takes, a multiple of BLOCK_K; programs the inputs are split over)."""
    splits = min(MAX_SPLITS, -(-k // BLOCK_K))
    chunk = -(-k // (splits * BLOCK_K)) * BLOCK_K
    return chunk, -(-k // chunk)


def split_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 ) -> torch.Tensor:
    """x W^T (+ b) in x's dtype, fp32 accumulate: the partial sums of each input chunk, summed.
    x: [..., K]; w: [N, K]."""
    if not AVAILABLE:
        raise DraftsmithError("the Triton split linear needs the triton package")
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.draftsmith.split_linear(x2, w).sum(0)
    if b is not None:
        y = y + b.float()
    return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)


def _register() -> None:
    """Defines the op at import: dynamo cannot trace triton.jit."""
    from torch.library import triton_op, wrap_triton

    kernel = _kernel()

    @triton_op("draftsmith::split_linear", mutates_args={})
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        chunk, splits = splitting(k)
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        # rows stay symbolic: a block size taken from m would compile once per row count
        wrap_triton(kernel)[(-(-n // BLOCK_N), splits, -(-m // BLOCK_M))](
            x, w, out, m, n, k, chunk, *x.stride(), *w.stride(),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            IEEE=x.dtype == torch.float32, num_warps=4,
        )
        return out


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def partial(X, W, P, m, n, k, chunk, sxm, sxk, swn, swk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                IEEE: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        lo = tl.program_id(1) * chunk
        hi = tl.minimum(lo + chunk, k)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(lo, hi, BLOCK_K):
            i = start + tl.arange(0, BLOCK_K)
            a = tl.load(X + rows[:, None] * sxm + i[None, :] * sxk,
                        mask=(rows < m)[:, None] & (i < hi)[None, :], other=0.0)
            b = tl.load(W + cols[:, None] * swn + i[None, :] * swk,
                        mask=(cols < n)[:, None] & (i < hi)[None, :], other=0.0)
            if IEEE:  # noqa: SIM108 (a branch on a constexpr: compiled out)
                acc += tl.dot(a, tl.trans(b), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(b))
        at = P + tl.program_id(1) * m * n + rows[:, None] * n + cols[None, :]
        tl.store(at, acc, mask=(rows < m)[:, None] & (cols < n)[None, :])

    return partial


AVAILABLE = importable()
if AVAILABLE:
    _register()
