"""A layer's norm and linear at verify and drafter-depth rows: compiled apart (inductor's norm
kernel, cuBLAS, inductor's silu*mul) against `triton_norm_linear.norm_linear` in one kernel.

Usage: python benchmarks/norm_linear.py [--out FILE.json] [--rows 4,25] [--block-n 16,32,64]
The default target's two norm-fed linears, each with the residual add before its norm as the
layer has it: qkv (576 -> 960) and gate_up with silu*mul (576 -> 2 x 1,536), and the trained
drafter's gate_up (576 -> 2 x 6,144). Both ways compiled as the engine compiles a step of these
rows; one CUDA graph holds 30 calls (a layer each); us a call from replays timed with CUDA
events, bf16, with each fused setting's largest difference from the compiled way.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from verify_attention import graph_us, save  # benchmarks/ is on the path when run

from draftsmith.engine.runtime import engine_compile, pinned_at
from draftsmith.models import triton_norm_linear
from draftsmith.models.parallel import linear

SHAPES = {"qkv": (576, 960, 0), "gate_up": (576, 0, 1536), "drafter gate_up": (576, 0, 6144)}
EPS = 1e-5


def apart(x, d, gamma, w, up: int):
    s = x + d
    y = linear(F.rms_norm(s.float(), (s.shape[-1],), gamma.float(), EPS).to(s.dtype), w)
    if up:
        gate, u = y.split(up, dim=-1)
        y = F.silu(gate) * u
    return y, s


def fused(x, d, gamma, w, up: int):
    return triton_norm_linear.norm_linear(x, d, gamma, EPS, w, up)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="4,25")
    ap.add_argument("--block-n", default="16,32,64")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 256
    rows_out = []
    g = torch.Generator("cuda").manual_seed(0)
    for rows in map(int, a.rows.split(",")):
        for name, (k, n, up) in SHAPES.items():
            x = torch.randn(1, rows, k, device="cuda", generator=g).bfloat16()
            d = torch.randn(1, rows, k, device="cuda", generator=g).bfloat16()
            gamma = (0.5 + torch.rand(k, device="cuda", generator=g)).bfloat16()
            w = (torch.randn(2 * up or n, k, device="cuda", generator=g) / k**0.5).bfloat16()
            args = (x, d, gamma, w, up)
            row = {"rows": rows, "linear": name, "k": k, "n": up or n}
            opts = {"pinned": pinned_at(rows), "fullgraph": True, "dynamic": False}
            torch._dynamo.reset()
            ref = engine_compile(apart, **opts)
            want = ref(*args)[0].float()
            row["apart"] = round(graph_us(ref, args), 2)
            for bn in map(int, a.block_n.split(",")):
                torch._dynamo.reset()
                triton_norm_linear.BLOCK_N = bn
                one = engine_compile(fused, **opts)
                row[f"err {bn}"] = round((one(*args)[0].float() - want).abs().max().item(), 4)
                row[f"fused {bn}"] = round(graph_us(one, args), 2)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    save(a.out, rows_out)


if __name__ == "__main__":
    main()
