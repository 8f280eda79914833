"""What one batch-1 decode step of the default target launches: kernels per step, GPU time.

Usage: python benchmarks/decode_kernels.py [--out FILE.json] [--no-compile]
Runs the decode step's ops eagerly (the same kernels its CUDA graph holds) under
torch.profiler, then times the graphed step and the graphed bare forward with CUDA events.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from draftsmith.engine.generate import decoder, prefill
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams, sample
from draftsmith.targets import load_target


def kernel_table(state, steps: int) -> tuple[list[dict], int, float]:
    for _ in range(3):
        state.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            state.step()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name].append(e.device_time_total)
    rows = [{"kernel": k[:90], "per_step": len(v) / steps, "us_each": sum(v) / len(v),
             "us_per_step": sum(v) / steps} for k, v in per.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    count = sum(len(v) for v in per.values()) // steps
    busy = sum(sum(v) for v in per.values()) / steps
    return rows, count, busy


def graphed_ms(fn, iters: int = 300) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    target = load_target("default")
    model = target.build(torch.bfloat16, "cuda")
    rt = Runtime(model, 1, 512, compile=not args.no_compile)
    prompt = target.chat_ids([{"role": "user", "content": "Explain how a hash map works."}])
    params = SamplingParams()
    state, step = decoder(rt, 1, [], params)
    logits, lens = prefill(rt, [prompt])
    state.reset(sample(logits, params), lens)
    rows, count, busy = kernel_table(state, 5)
    step_ms = graphed_ms(step)
    rt.capture([1], [1])
    tok, pos = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.full((1, 1), 40).cuda()
    fwd_ms = graphed_ms(lambda: rt.forward(tok, pos))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "compiled": not args.no_compile, "layers": len(model.layers),
           "kernels_per_step": count, "kernel_us_per_step": busy,
           "graphed_step_ms": step_ms, "graphed_forward_ms": fwd_ms, "kernels": rows[:40]}
    print(f"kernels per decode step: {count} ({count / len(model.layers):.1f} a layer), "
          f"GPU busy {busy:.0f} us; graphed step {step_ms:.3f} ms, forward {fwd_ms:.3f} ms")
    for r in rows[:40]:
        print(f"{r['per_step']:6.1f} x {r['us_each']:7.2f} us = {r['us_per_step']:8.1f}  "
              f"{r['kernel']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
