"""Baseline decode tok/s of whichever draftsmith is on PYTHONPATH, greedy and sampled, fixed
length (no EOS), compiled and graphed: run it under two sources in turn to A/B the engine's
sampling path without a server around it.

Usage: PYTHONPATH=SRC python benchmarks/sampled_decode_ab.py --label old --out DIR
       [--batches 1,32] [--temps 0,0.8] [--new 256] [--repeats 3]
On CUDA: bf16, compiled; `--device cpu`: fp32, eager (a smoke run). Default target.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from baseline_decode import PROMPTS

import draftsmith
from draftsmith.engine.generate import run_generation
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.targets import load_target


def tok_s(rt: Runtime, prompts: list[list[int]], new: int, temp: float, repeats: int) -> list:
    params = SamplingParams(temperature=temp)
    run_generation(rt, prompts, new, params)  # capture and autotune outside the clock
    out = []
    for _ in range(repeats):
        r = run_generation(rt, prompts, new, params)
        out.append(len(prompts) * (new - 1) / r.decode_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    target = load_target("default")
    chats = [target.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    cuda = args.device == "cuda"
    model = target.build(torch.bfloat16 if cuda else torch.float32, args.device)
    batches = [int(x) for x in args.batches.split(",")]
    res = {"label": args.label, "source": draftsmith.__file__,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "new_tokens": args.new, "date": time.strftime("%FT%TZ"),
           "runs": []}
    for b in batches:
        prompts = [chats[i % len(chats)] for i in range(b)]
        rt = Runtime(model, b, 512, compile=cuda)
        for t in (float(x) for x in args.temps.split(",")):
            r = {"batch": b, "temperature": t, "tok_s": tok_s(rt, prompts, args.new, t,
                                                              args.repeats)}
            res["runs"].append(r)
            print(json.dumps(r), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"sampled_decode_{args.label}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
