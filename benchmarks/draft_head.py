"""A greedy tree depth's head and top-k at the default drafter's shapes: the compiled way (the
vocabulary head in cuBLAS, then the chunked top-k of log-softmax) against the Triton pass of
models/triton_head.py.

Usage: python benchmarks/draft_head.py [--out FILE.json] [--shapes 4x4,8x8,32x4,128x4]
Shapes ROWSxK: rows = batch x the tree's top-k, k its top-k (4x4: batch 1 at 7/4/24; 8x8:
batch 1 at 5/8/16; 32x4, 128x4: batches 8 and 32 at top-k 4). Draft vocabulary 24,576 x
hidden 576, bf16. One CUDA graph holds 30 calls; us a call from replays timed with CUDA
events. Each way is compiled as the engine compiles a draft phase (pinned). `ids equal`: the
share of rows whose k ids match the compiled way's (the Triton pass keeps fp32 logits where
cuBLAS rounds them to bf16, so near-ties may order differently).
"""

from __future__ import annotations

import argparse
import json

import torch
from verify_attention import graph_us, save  # benchmarks/ is on the path when run

from draftsmith.engine.runtime import engine_compile
from draftsmith.engine.tree import top_k_log_softmax
from draftsmith.models import triton_head
from draftsmith.models.parallel import linear

VOCAB, HIDDEN = 24_576, 576


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="4x4,8x8,32x4,128x4", help="ROWSxK")
    ap.add_argument("--block-v", default="64,128,256")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 256
    g = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).bfloat16()
    out = []
    for rows, k in (map(int, s.split("x")) for s in a.shapes.split(",")):
        x = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
        row = {"rows": rows, "k": k}
        torch._dynamo.reset()
        compiled = engine_compile(lambda x, w, k=k: top_k_log_softmax(linear(x, w).float(), k),
                                  fullgraph=True, dynamic=False)
        ref_v, ref_i = compiled(x, w)
        row["compiled"] = round(graph_us(compiled, (x, w)), 2)
        for bv in map(int, a.block_v.split(",")):
            torch._dynamo.reset()  # the op reads the block at trace time: no guard
            triton_head.BLOCK_V = bv
            fused = engine_compile(lambda x, w, k=k: triton_head.head_top_k(x, w, k),
                                   fullgraph=True, dynamic=False)
            v, i = fused(x, w)
            row[f"triton {bv}"] = round(graph_us(fused, (x, w)), 2)
            row[f"max |dv| {bv}"] = round((v - ref_v).abs().max().item(), 4)
            row[f"ids equal {bv}"] = round((i == ref_i).all(1).float().mean().item(), 3)
        out.append(row)
        print(json.dumps(row), flush=True)
    save(a.out, out)


if __name__ == "__main__":
    main()
