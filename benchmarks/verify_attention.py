"""Attention alone at the default target's shapes: the compiled ways against the Triton kernel.

Usage: python benchmarks/verify_attention.py [--out FILE.json] [--slots 400]
Per shape (batch, tokens a row: 1 = a decode step, 4 = a drafter depth, 25 = a tree 7/4/24
verify), one CUDA graph holds 30 calls (a layer each, as in a forward); the graph is replayed
and timed with CUDA events. Each way starts from q as the qkv projection leaves it
([B, Q, H, D], a view) and ends with the o projection's input ([B, Q, H * D]), so the compiled
ways pay for their layout copies as they do in the engine. Kernel configs of the Triton way:
every DRAFTSMITH_ATTN_BLOCK_N x _WARPS x _STAGES x _SPLIT_KEYS listed (name: their values).
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


def save(path: str | None, rows: list[dict]) -> None:
    """The rows with the device and torch they ran on, as JSON at path (None: not kept)."""
    if path:
        out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


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
    ap.add_argument("--split", default="0", help="DRAFTSMITH_ATTN_SPLIT_KEYS values")
    ap.add_argument("--shapes", default="1x1,1x4,1x25,8x1,8x25,32x8", help="BATCHxTOKENS")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    ways = {"matmul": compiled_way(matmul_attention), "small": compiled_way(small_attention)}
    rows = []
    for b, n in (map(int, x.split("x")) for x in a.shapes.split(",")):
        args = inputs(b, n, a.slots)
        ref = ways["matmul"](*args).float()
        row = {"batch": b, "tokens": n, "slots": a.slots}
        for name, way in ways.items():
            if name == "small" and n > 1:
                continue
            row[name] = round(graph_us(way, args), 2)
        lists = (a.blocks, a.warps, a.stages, a.split)
        for cfg in product(*(map(int, x.split(",")) for x in lists)):
            ta = triton_attention
            ta.BLOCK_N, ta.WARPS, ta.STAGES, ta.SPLIT_KEYS = cfg
            err = (ta.cache_attention(*args).float() - ref).abs().max().item()
            name = "/".join(map(str, cfg))
            row[f"triton {name}"] = round(graph_us(ta.cache_attention, args), 2)
            row[f"err {name}"] = round(err, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    save(a.out, rows)


if __name__ == "__main__":
    main()
