"""The default target's linears at verify and drafter-depth rows: cuBLAS against the Triton split.

Usage: python benchmarks/verify_linear.py [--out FILE.json] [--rows 4,25]
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


def with_consumer(name: str):
    def fn(x, w, r):
        y = linear(x, w)
        if name == "gate_up":
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        if name == "qkv":
            return y * r[..., :1]
        return y + r
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="4,25")
    ap.add_argument("--block-n", default="32,64,128")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 256
    rows_out = []
    g = torch.Generator("cuda").manual_seed(0)
    for rows in map(int, a.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            x = torch.randn(1, rows, k, device="cuda", generator=g).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
            r = torch.randn(1, rows, n, device="cuda", generator=g).bfloat16()
            row = {"rows": rows, "linear": name, "k": k, "n": n}
            torch._dynamo.reset()  # the op reads the switch and block at trace time: no guard
            triton_linear.SPLIT_LINEAR_ROWS = 0
            # compiled as the engine compiles a forward of this many rows
            opts = {"pinned": pinned_at(rows), "fullgraph": True, "dynamic": False}
            cublas = engine_compile(with_consumer(name), **opts)
            ref = cublas(x, w, r).float()
            row["cublas"] = round(graph_us(cublas, (x, w, r)), 2)
            for bn in map(int, a.block_n.split(",")):
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
