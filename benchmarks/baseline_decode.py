"""Baseline decode: HF transformers generate (eager; static cache) vs draftsmith, same run.

Usage: python benchmarks/baseline_decode.py [--new 256] [--out DIR]
Needs a CUDA device for the figures the README quotes; bf16, default target.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from draftsmith.engine.generate import run_generation
from draftsmith.engine.runtime import Runtime
from draftsmith.targets import load_target

PROMPTS = [
    "Explain how a hash map works.", "Write a short poem about autumn.",
    "What is the capital of Australia and why?", "Give three tips for learning to code.",
    "Summarize the plot of Romeo and Juliet.", "How does photosynthesis work?",
    "Write a Python function that reverses a string.", "What causes rain?",
    "Describe the rules of chess briefly.", "Why is the sky blue?",
]


def hf_tokens_per_s(folder, prompts, new, static: bool) -> float:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if static:
        kw["cache_implementation"] = "static"
    model.generate(torch.tensor([prompts[0]]).cuda(), **kw)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    for p in prompts:
        model.generate(torch.tensor([p]).cuda(), **kw)
    torch.cuda.synchronize()
    return len(prompts) * new / (time.perf_counter() - t)


def graphed_forward_ms(rt: Runtime, b: int = 1, iters: int = 200) -> float:
    rt.capture([b], [1])
    tok = torch.zeros(b, 1, dtype=torch.long, device="cuda")
    pos = torch.full((b, 1), 5, device="cuda")
    for _ in range(10):
        rt.forward(tok, pos)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        rt.forward(tok, pos)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def ours(target, prompts, new, batch, compile: bool) -> dict:
    model = target.build(torch.bfloat16, "cuda")
    rt = Runtime(model, batch, 512, compile=compile)
    rows = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    groups = [rows[i : i + batch] for i in range(0, len(rows) - batch + 1, batch)]
    run_generation(rt, groups[0], new)  # warm-up + capture
    toks, secs = 0, 0.0
    for g in groups:
        r = run_generation(rt, g, new)
        toks += len(g) * new
        secs += r.decode_s + r.prefill_s
    out = {"batch": batch, "compile": compile, "tokens_per_s": toks / secs}
    if batch == 1:
        out["graphed_1tok_forward_ms"] = graphed_forward_ms(rt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    target = load_target("default")
    prompts = [target.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "dtype": "bfloat16", "prompts": len(prompts), "new_tokens": args.new, "runs": []}
    if not args.skip_hf:
        res["hf_eager_tok_s"] = hf_tokens_per_s(target.folder, prompts, args.new, False)
        res["hf_static_tok_s"] = hf_tokens_per_s(target.folder, prompts, args.new, True)
        print(json.dumps({k: v for k, v in res.items() if k.startswith("hf")}), flush=True)
    for compile in (False, True):
        for b in [int(x) for x in args.batches.split(",")]:
            try:
                r = ours(target, prompts, args.new, b, compile)
            except Exception as e:  # noqa: BLE001 - report and go on with the other settings
                r = {"batch": b, "compile": compile, "error": repr(e)[:300]}
            res["runs"].append(r)
            print(json.dumps(r), flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
