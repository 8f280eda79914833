"""The default target's linears at verify and drafter-depth rows: cuBLAS against the Triton split,
and against cuBLASLt (`torch.backends.cuda.preferred_blas_library`, which
TORCH_BLAS_PREFER_CUBLASLT=1 sets for a whole process).

Usage: python benchmarks/verify_linear.py [--out FILE.json] [--rows 4,25] [--block-n 32,64,128]
       [--blas cublas,cublaslt]
Each linear is compiled with the consumer it has in a layer (qkv: RoPE-like pointwise, o and
down: the residual add, gate_up: silu * up), so the split kernel's partial sums are summed where
the engine sums them, in the consumer's kernel. One CUDA graph holds 30 calls (a layer each);
us a call from replays timed with CUDA events, bf16.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from verify_attention import graph_us, save  # benchmarks/ is on the path when run

from draftsmith.engine.runtime import engine_compile, pinned_at
from draftsmith.models import triton_linear
from draftsmith.models.parallel import linear

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
# `.kept19`'s layer (its qkv reads the embedding and the fused state) and the target's head
MORE = {"drafter qkv": (1152, 960), "drafter gate_up": (576, 12288), "drafter down": (6144, 576),
        "head": (576, 49152)}


def with_consumer(name: str):
    def fn(x, w, r):
        y = linear(x, w)
        if name.endswith("gate_up"):
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        if name.endswith("qkv"):
            return y * r[..., :1]
        return y + r
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="4,25")
    ap.add_argument("--block-n", default="32,64,128", help="split kernel blocks ('' for none)")
    ap.add_argument("--blas", default="cublas", help="BLAS libraries to time, comma-separated")
    ap.add_argument("--more", action="store_true", help="the drafter's linears and the head too")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 256
    rows_out = []
    g = torch.Generator("cuda").manual_seed(0)
    for rows in map(int, a.rows.split(",")):
        for name, (k, n) in (SHAPES | (MORE if a.more else {})).items():
            x = torch.randn(1, rows, k, device="cuda", generator=g).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
            r = torch.randn(1, rows, n, device="cuda", generator=g).bfloat16()
            row = {"rows": rows, "linear": name, "k": k, "n": n}
            torch._dynamo.reset()  # the op reads the switch and block at trace time: no guard
            triton_linear.SPLIT_LINEAR_ROWS = 0
            # compiled as the engine compiles a forward of this many rows
            opts = {"pinned": pinned_at(rows), "fullgraph": True, "dynamic": False}
            ref = None
            for lib in a.blas.split(","):
                torch._dynamo.reset()
                torch.backends.cuda.preferred_blas_library(lib)
                fn = engine_compile(with_consumer(name), **opts)
                out = fn(x, w, r).float()
                ref = out if ref is None else ref
                row[f"err {lib}"] = round((out - ref).abs().max().item(), 4)
                row[lib] = round(graph_us(fn, (x, w, r)), 2)
            torch.backends.cuda.preferred_blas_library(a.blas.split(",")[0])
            for bn in (int(b) for b in a.block_n.split(",") if b):
                torch._dynamo.reset()
                triton_linear.SPLIT_LINEAR_ROWS, triton_linear.BLOCK_N = 64, bn
                split = engine_compile(with_consumer(name), **opts)
                row[f"err {bn}"] = round((split(x, w, r).float() - ref).abs().max().item(), 4)
                row[f"split {bn}"] = round(graph_us(split, (x, w, r)), 2)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    save(a.out, rows_out)


if __name__ == "__main__":
    main()
