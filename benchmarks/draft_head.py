"""A greedy tree depth's head and top-k at the default drafter's shapes: the compiled way (the
vocabulary head in cuBLAS, then the chunked top-k of log-softmax) against the Triton pass of
models/triton_head.py, over the bf16 head and over its int8 copy (`quantize_head`, one fp32 scale
a row: DRAFTSMITH_DRAFT_HEAD=triton-int8).

Usage: python benchmarks/draft_head.py [--out FILE.json] [--shapes 4x4,8x8,32x4,128x4]
       [--block-v 64,128,256] [--configs BLOCK_V/BLOCK_H/WARPS/STAGES,...]
Shapes ROWSxK: rows = batch x the tree's top-k, k its top-k (4x4: batch 1 at 7/4/24; 8x8:
batch 1 at 5/8/16; 32x4, 128x4: batches 8 and 32 at top-k 4). Draft vocabulary 24,576 x
hidden 576, bf16. One CUDA graph holds 30 calls; us a call from replays timed with CUDA
events. Each way is compiled as the engine compiles a draft phase (pinned). `ids equal`: the
share of rows whose k ids match the compiled way's (the Triton pass keeps fp32 logits where
cuBLAS rounds them to bf16, so near-ties may order differently); the int8 head's (`int8` keys)
are those of other logits, so fewer match: the draft only proposes, the verify keeps the output.
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
    ap.add_argument("--configs", default="",
                    help="also BLOCK_V/BLOCK_H/warps/stages sets at the default block, e.g. "
                         "128/128/4/3,64/64/4/4,128/64/8/3 (H200 run 25's probe: 10.5 us a "
                         "4-row depth under 128/64/4/3, 2.7 TB/s over the 28 MB head)")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 256
    g = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).bfloat16()
    q, scale = triton_head.quantize_head(w)
    out = []
    for rows, k in (map(int, s.split("x")) for s in a.shapes.split(",")):
        x = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
        row = {"rows": rows, "k": k}
        torch._dynamo.reset()
        compiled = engine_compile(lambda x, w, k=k: top_k_log_softmax(linear(x, w).float(), k),
                                  fullgraph=True, dynamic=False)
        ref_v, ref_i = compiled(x, w)
        row["compiled"] = round(graph_us(compiled, (x, w)), 2)
        sets = {str(bv): (bv, triton_head.BLOCK_H, triton_head.WARPS, triton_head.STAGES)
                for bv in map(int, a.block_v.split(","))}
        sets |= {c: tuple(map(int, c.split("/"))) for c in filter(None, a.configs.split(","))}
        for name, cfg in sets.items():
            row.update(time_config(x, w, k, cfg, name, ref_v, ref_i))
            row.update(time_config(x, q, k, cfg, f"int8 {name}", ref_v, ref_i, scale))
        out.append(row)
        print(json.dumps(row), flush=True)
    save(a.out, out)


def time_config(x: torch.Tensor, w: torch.Tensor, k: int, cfg: tuple[int, ...], name: str,
                ref_v: torch.Tensor, ref_i: torch.Tensor,
                scale: torch.Tensor | None = None) -> dict:
    """The Triton pass under (BLOCK_V, BLOCK_H, warps, stages): us a call, and its picks against
    the compiled way's. scale: w is the int8 head, these its rows' scales. The defaults are
    restored after."""
    keep = (triton_head.BLOCK_V, triton_head.BLOCK_H, triton_head.WARPS, triton_head.STAGES)
    torch._dynamo.reset()  # the op reads its blocks at trace time: no guard
    triton_head.BLOCK_V, triton_head.BLOCK_H, triton_head.WARPS, triton_head.STAGES = cfg
    args = (x, w) if scale is None else (x, w, scale)
    try:
        fused = engine_compile(lambda x, w, s=None, k=k: triton_head.head_top_k(x, w, k, scale=s),
                               fullgraph=True, dynamic=False)
        v, i = fused(*args)
        return {f"triton {name}": round(graph_us(fused, args), 2),
                f"max |dv| {name}": round((v - ref_v).abs().max().item(), 4),
                f"ids equal {name}": round((i == ref_i).all(1).float().mean().item(), 3)}
    finally:
        triton_head.BLOCK_V, triton_head.BLOCK_H, triton_head.WARPS, triton_head.STAGES = keep


if __name__ == "__main__":
    main()
