"""Attention alone at the default target's shapes: the compiled ways against the Triton kernel.

Usage: python benchmarks/verify_attention.py [--out FILE.json] [--slots 400]
Per shape (batch, tokens a row: 1 = a decode step, 4 = a drafter depth, 25 = a tree 7/4/24
verify), one CUDA graph holds 30 calls (a layer each, as in a forward); the graph is replayed
and timed with CUDA events. Each way starts from q as the qkv projection leaves it
([B, Q, H, D], a view) and ends with the o projection's input ([B, Q, H * D]), so the compiled
ways pay for their layout copies as they do in the engine. Kernel configs of the Triton way:
every DRAFTSMITH_ATTN_BLOCK_N x DRAFTSMITH_ATTN_WARPS x DRAFTSMITH_ATTN_STAGES listed.
"""

from __future__ import annotations

import argparse
import json
from itertools import product

import torch

from draftsmith.engine.runtime import engine_compile
from draftsmith.models import triton_attention
from draftsmith.models.llama import causal_mask, matmul_attention, small_attention

HEADS, KV_HEADS, D, LAYERS = 9, 3, 64, 30


def compiled_way(attend):
    def way(q, k, v, mask):
        b, n = q.shape[:2]
        qg = q.transpose(1, 2).reshape(b, KV_HEADS, HEADS // KV_HEADS * n, D)
        out = attend(qg, k, v, mask).reshape(b, HEADS, n, D)
        return out.transpose(1, 2).reshape(b, n, HEADS * D)
    return engine_compile(way, fullgraph=True)


def graph_us(fn, args, iters: int = 200) -> float:
    """us a call of fn(*args), 30 calls a graph replay."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn(*args)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters / LAYERS


def inputs(b: int, n: int, slots: int):
    g = torch.Generator("cuda").manual_seed(n)
    qkv = torch.randn(b, n, (HEADS + 2 * KV_HEADS) * D, device="cuda", generator=g)
    q = qkv.bfloat16()[..., : HEADS * D].view(b, n, HEADS, D)
    k = torch.randn(b, KV_HEADS, slots, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, KV_HEADS, slots, D, device="cuda", generator=g).bfloat16()
    pos = torch.arange(n, device="cuda").repeat(b, 1) + slots - n - 50
    mask = causal_mask(pos, slots).repeat(1, 1, HEADS // KV_HEADS, 1)
    return q, k, v, mask


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--slots", type=int, default=400)
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="2")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    ways = {"matmul": compiled_way(matmul_attention), "small": compiled_way(small_attention)}
    rows = []
    for b, n in [(1, 1), (1, 4), (1, 25), (8, 1), (8, 25), (32, 8)]:
        args = inputs(b, n, a.slots)
        ref = ways["matmul"](*args).float()
        row = {"batch": b, "tokens": n, "slots": a.slots}
        for name, way in ways.items():
            if name == "small" and n > 1:
                continue
            row[name] = round(graph_us(way, args), 2)
        for cfg in product(*(map(int, x.split(",")) for x in (a.blocks, a.warps, a.stages))):
            ta = triton_attention
            ta.BLOCK_N, ta.WARPS, ta.STAGES = cfg
            err = (ta.cache_attention(*args).float() - ref).abs().max().item()
            name = "/".join(map(str, cfg))
            row[f"triton {name}"] = round(graph_us(ta.cache_attention, args), 2)
            row[f"err {name}"] = round(err, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
