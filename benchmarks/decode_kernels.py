"""What one batch-1 decode step of the default target launches: kernels per step, GPU time;
and the same for the speculative phases (draft, verify, extend, accept; chain 3, trees 3/4/8
and 7/4/24).

Usage: python benchmarks/decode_kernels.py [--out FILE.json] [--no-compile] [--no-phases]
       [--no-decode] [--drafter DIR] [--settings "tree 7/4/24,chain 3"]
Runs each step's ops eagerly (the same kernels its CUDA graph holds) under torch.profiler, then
times the graphed step with CUDA events. The phases use a random drafter of the target's shapes
unless --drafter names a drafter folder (its shapes: draft vocabulary, MLP width); their kernels
do not depend on its weights. Verify (2-16 tokens) took 1.46 ms a cycle in run 4 against
0.99-1.06 ms for a one-token decode: the phase tables say where the difference goes.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from draftsmith.bench.drafters import get_drafter
from draftsmith.engine.generate import decoder, prefill
from draftsmith.engine.runtime import Runtime, raise_recompile_limit
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.speculative import FUSED_PHASES, SpecDecoder
from draftsmith.engine.tree import TREE_TOPK
from draftsmith.models.llama import VERIFY_ATTENTION
from draftsmith.targets import load_target

SETTINGS = {"chain 3": (3, 1, None), "tree 3/4/8": (3, 4, 8), "tree 7/4/24": (7, 4, 24),
            "tree 8/4/32": (8, 4, 32)}


def kernel_table(step, steps: int) -> tuple[list[dict], int, float]:
    """Kernels of `step()` run eagerly: name, count a step, us each and a step."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
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


def print_kernels(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['per_step']:6.1f} x {r['us_each']:7.2f} us = {r['us_per_step']:8.1f}  "
              f"{r['kernel']}")


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


@torch.no_grad()  # as the engine runs: the fused phases compile no backward
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-phases", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="the phases only")
    ap.add_argument("--drafter", default="random", help="a drafter folder, or random")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma-separated phase settings among: " + ", ".join(SETTINGS))
    args = ap.parse_args()
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"unknown --settings {unknown}; known: {list(SETTINGS)}")
    target = load_target("default")
    model = target.build(torch.bfloat16, "cuda")
    rt = Runtime(model, 1, 512, compile=not args.no_compile)
    raise_recompile_limit()
    prompt = target.chat_ids([{"role": "user", "content": "Explain how a hash map works."}])
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "compiled": not args.no_compile, "layers": len(model.layers),
           "verify_attention": VERIFY_ATTENTION, "tree_topk": TREE_TOPK,
           "fused_phases": sorted(FUSED_PHASES)}
    print(f"tree top-k {TREE_TOPK}, fused phases: {', '.join(sorted(FUSED_PHASES)) or 'none'}")
    if not args.no_decode:
        res.update(decode_kernels(rt, prompt, len(model.layers)))
    if not args.no_phases:
        drafter, warnings = get_drafter(args.drafter, target, model)
        for w in warnings:
            print("warning:", w)
        res["drafter"] = {"source": args.drafter, "draft_vocab": drafter.cfg.draft_vocab_size,
                          "intermediate": drafter.cfg.intermediate_size}
        res["phases"] = {name: phase_kernels(rt, prompt, drafter, *SETTINGS[name])
                         for name in names}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def decode_kernels(rt: Runtime, prompt: list[int], layers: int) -> dict:
    """The kernels of one graphed decode step, and the step and the bare forward timed."""
    params = SamplingParams()
    state, step = decoder(rt, 1, [], params)
    logits, lens = prefill(rt, [prompt])
    state.reset(state.sampling.sample(logits), lens)
    rows, count, busy = kernel_table(state.step, 5)
    step_ms = graphed_ms(step)
    rt.capture([1], [1])
    tok, pos = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.full((1, 1), 40).cuda()
    fwd_ms = graphed_ms(lambda: rt.forward(tok, pos))
    print(f"kernels per decode step: {count} ({count / layers:.1f} a layer), "
          f"GPU busy {busy:.0f} us; graphed step {step_ms:.3f} ms, forward {fwd_ms:.3f} ms")
    print_kernels(rows[:40])
    return {"kernels_per_step": count, "kernel_us_per_step": busy, "graphed_step_ms": step_ms,
            "graphed_forward_ms": fwd_ms, "kernels": rows[:40]}


def phase_kernels(rt: Runtime, prompt: list[int], drafter, steps: int, topk: int,
                  n: int | None) -> dict:
    """Each phase of one speculative setting: kernel tables run eagerly (the graph's kernels),
    and the draft's, verify's and extend's graphs replayed alone (they only read the cycle's
    inputs and write the same values again). The accept commits what it accepts, so it is not
    replayed; its table comes last, from 8 eager accepts of one verify's output."""
    dec = SpecDecoder(rt, drafter, steps, topk, n)
    st = dec.start([prompt], 64, [])
    dec.cycle(st)  # every phase once: verify's output is in place for the tables
    out = {}
    for phase in ("draft", "verify", "extend", "accept"):
        fn = getattr(dec, "_" + phase)
        rows, count, busy = kernel_table(lambda f=fn: f(st), 5)
        ms = graphed_ms(lambda p=phase: dec._run(st, p)) if phase != "accept" else None
        out[phase] = {"kernels": count, "kernel_us": busy, "graphed_ms": ms, "top": rows[:80]}
        graphed = f", graphed {ms:.3f} ms" if ms is not None else ""
        print(f"{steps}/{topk}/{n or steps + 1} {phase}: {count} kernels, GPU busy {busy:.0f} us"
              f"{graphed}")
        print_kernels(rows[:40])
    return out


if __name__ == "__main__":
    main()
