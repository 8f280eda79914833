"""The drafter's decoder layer at the default drafter's shapes: the compiled module path (the
engine's default: inductor's kernels around cuBLAS linears and the Triton attention) against
models/triton_draft_layer.py, one persistent launch (`fused`) and one launch a stage
(`staged`).

Usage: python benchmarks/draft_layer.py [--out FILE.json] [--shapes 1x4,1x1,1x8,8x4]
       [--slots 512]
Shapes BxQ: batch x tokens a row (1x4: a batch-1 depth of a top-4 tree; 1x1: a chain step;
1x8: an extend of 8 accepted tokens; 8x4: batch 8). Hidden 576, intermediate 1,536, 9 heads,
3 KV heads of 64, bf16, a cache of `--slots` slots with the first 300 and the rows' own
visible. One CUDA graph holds 30 calls; us a call from replays timed with CUDA events. Each way
is compiled as the engine compiles a draft phase. `max |dh|`: the largest difference of the
layer's output from the module path's.
"""

from __future__ import annotations

import argparse
import json

import torch
from verify_attention import graph_us, save  # benchmarks/ is on the path when run

from draftsmith.engine.runtime import engine_compile
from draftsmith.layers import default_aux_layers
from draftsmith.models import triton_draft_layer as tdl
from draftsmith.models.config import ModelConfig
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.models.llama import KVCache


def drafter() -> Eagle3Drafter:
    cfg = ModelConfig(arch="llama", vocab_size=49_152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    d = Eagle3Drafter(Eagle3Config.for_target(cfg, 24_576, default_aux_layers(30)))
    torch.manual_seed(0)
    d.init_weights()
    inv = d.inv_freq
    d = d.to("cuda", torch.bfloat16).eval()
    d.inv_freq = inv.cuda()
    return d


def inputs(d: Eagle3Drafter, b: int, q: int, slots: int) -> tuple:
    g = torch.Generator("cuda").manual_seed(b * 10 + q)
    dev = {"device": "cuda"}
    tokens = torch.randint(0, d.cfg.vocab_size, (b, q), generator=g, **dev)
    hidden = torch.randn(b, q, 576, generator=g, **dev).bfloat16()
    slot = 300 + torch.arange(q, **dev).expand(b, q)
    mask = torch.arange(slots, **dev)[None, None, None, :] < 300
    mask = mask.expand(b, 1, q, slots).clone()
    mask[torch.arange(b, **dev)[:, None], 0, torch.arange(q, **dev)[None, :], slot] = True
    shape = (b, 3, slots, 64)
    k = torch.randn(shape, generator=g, **dev).bfloat16()
    v = torch.randn(shape, generator=g, **dev).bfloat16()
    return tokens, hidden, slot.contiguous(), slot.contiguous(), mask, k, v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="1x4,1x1,1x8,8x4", help="BxQ")
    ap.add_argument("--slots", type=int, default=512)
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 256
    d = drafter()
    out = []
    for b, q in (map(int, s.split("x")) for s in a.shapes.split(",")):
        args = inputs(d, b, q, a.slots)
        row: dict = {"shape": f"{b}x{q}", "slots": a.slots}
        ref = None
        for mode in ("off", "fused", "staged"):
            torch._dynamo.reset()  # the switch is read at trace time: no guard
            tdl.MODE = mode
            step = engine_compile(
                lambda tok, h, pos, slot, mask, k, v: d(tok, h, pos, [KVCache(k, v)], slot, mask,
                                                        logits=False)[1],
                fullgraph=True, dynamic=False)
            with torch.no_grad():
                h = step(*args).float()
                ref = h if ref is None else ref
                row[mode] = round(graph_us(step, args), 2)
            row[f"max |dh| {mode}"] = round((h - ref).abs().max().item(), 4)
        out.append(row)
        print(json.dumps(row), flush=True)
    save(a.out, out)


if __name__ == "__main__":
    main()
