"""The drafter's decoder layer at the default drafter's shapes: the compiled module path (the
engine's default: inductor's kernels around cuBLAS linears and the Triton attention) against
models/triton_draft_layer.py, one persistent launch (`fused`) and one launch a stage
(`staged`).

Usage: python benchmarks/draft_layer.py [--out FILE.json] [--shapes 1x4,1x1,1x8,8x4]
       [--slots 512] [--configs BLOCK_K/WARPS/NB,...]
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
from contextlib import contextmanager

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
    tdl.prepare(d)  # the folded weights, as the drafter runtime keeps them
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
    ap.add_argument("--configs", default="",
                    help="also fused under BLOCK_K/warps/NB sets, e.g. 128/4/16,256/8/32 (NB: "
                         "every stage's output block)")
    ap.add_argument("--stages", action="store_true",
                    help="also fused with stages 1..s only, s = 1-5 (the stages' costs)")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 256
    # inductor's FX graph cache keys a Triton kernel's constexprs by an index into a side table:
    # another block set would hit the first one's compiled graph
    torch._inductor.config.fx_graph_cache = False
    d = drafter()
    ways = [("off", None), ("fused", None), ("staged", None)]
    ways += [("fused", tuple(map(int, c.split("/")))) for c in filter(None, a.configs.split(","))]
    ways += [("fused", ("stages", s)) for s in range(1, tdl.STAGES) if a.stages]
    out = []
    for b, q in (map(int, s.split("x")) for s in a.shapes.split(",")):
        args = inputs(d, b, q, a.slots)
        row: dict = {"shape": f"{b}x{q}", "slots": a.slots}
        ref = None
        for mode, cfg in ways:
            name = mode if cfg is None else f"fused {'/'.join(map(str, cfg))}"
            with torch.no_grad(), blocks(cfg):
                h, us = time_way(d, mode, args)
            ref = h if ref is None else ref
            row[name] = us
            row[f"max |dh| {name}"] = round((h - ref).abs().max().item(), 4)
        out.append(row)
        print(json.dumps(row), flush=True)
    save(a.out, out)


@contextmanager
def blocks(cfg: tuple | None):
    """The kernel's BLOCK_K, warps and every stage's NB set to cfg for a while, or
    ("stages", s): a fused launch of stages 1..s."""
    names = ("BLOCK_K", "WARPS", "NB_QKV", "NB_O", "NB_GU", "NB_D")
    keep = tuple(getattr(tdl, n) for n in names)
    if cfg is not None and cfg[0] == "stages":
        tdl.UPTO = cfg[1]
    elif cfg is not None:
        for n, v in zip(names, (cfg[0], cfg[1], cfg[2], cfg[2], cfg[2], cfg[2]), strict=True):
            setattr(tdl, n, v)
    try:
        yield
    finally:
        for n, v in zip(names, keep, strict=True):
            setattr(tdl, n, v)
        tdl.UPTO = tdl.STAGES


def time_way(d: Eagle3Drafter, mode: str, args: tuple) -> tuple[torch.Tensor, float]:
    """The layer's output and us a call, compiled under DRAFTSMITH_DRAFT_LAYER=mode."""
    torch._dynamo.reset()  # the switch and blocks are read at trace time: no guard
    tdl.MODE = mode
    step = engine_compile(
        lambda tok, h, pos, slot, mask, k, v: d(tok, h, pos, [KVCache(k, v)], slot, mask,
                                                logits=False)[1],
        fullgraph=True, dynamic=False)
    h = step(*args).float()
    return h, round(graph_us(step, args), 2)


if __name__ == "__main__":
    main()
