"""`data regenerate`'s engine: static batches vs refilled rows, same prompts, same run.

Usage: python benchmarks/refill_bench.py [--device cpu|cuda] [--batch 8] [--new 96]
       [--rounds 2] [--out FILE.json]
Greedy, so both ways must give every prompt the same answer (checked); the prompts are the
built-in chat suite (22) and HumanEval's first `--humaneval` (10), cycled up to `--n` (default:
all of them once), in the embedded default target's chat template. Prints a table and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from draftsmith.bench.suites import suite_messages
from draftsmith.data.regenerate import EngineBackend, RegenConfig
from draftsmith.targets import load_target


def run(backend: EngineBackend, msgs: list, device: str) -> tuple[list, float]:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    answers = backend.answer(msgs)
    if device == "cuda":
        torch.cuda.synchronize()
    return answers, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--humaneval", type=int, default=10)
    ap.add_argument("--n", type=int, default=0, help="prompts, cycling the suites (0 = once)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dt = torch.bfloat16 if args.device == "cuda" else torch.float32
    t = load_target("default")
    model = t.build(dt, args.device)
    msgs = suite_messages("chat", 0) + suite_messages("humaneval", args.humaneval)
    msgs = [msgs[i % len(msgs)] for i in range(args.n or len(msgs))]
    res: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda"
                 else platform.processor() or "cpu", "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "prompts": len(msgs), "batch": args.batch,
                 "max_new_tokens": args.new, "greedy": True, "runs": []}
    backends = {name: EngineBackend(t, model, RegenConfig(args.new, 1024, batch_size=args.batch,
                                                          temperature=0.0, refill=refill))
                for name, refill in (("static", False), ("refill", True))}
    for b in backends.values():  # warm-up (graphs on GPU)
        b.answer(msgs[: args.batch])
    texts = {}
    for r in range(args.rounds):  # alternate, so drift hits both
        for name, b in backends.items():
            answers, secs = run(b, msgs, args.device)
            toks = sum(a.tokens for a in answers)
            texts[name] = [a.text for a in answers]
            res["runs"].append({"round": r, "mode": name, "answer_tokens": toks,
                                "seconds": secs, "tok_s": toks / secs})
            print(json.dumps(res["runs"][-1]), flush=True)
    res["same_answers"] = texts["static"] == texts["refill"]
    best = {m: max(x["tok_s"] for x in res["runs"] if x["mode"] == m) for m in backends}
    res["best_tok_s"], res["ratio"] = best, best["refill"] / best["static"]
    print(f"| mode | answer tok/s (best of {args.rounds}) |\n|---|---|")
    for m, v in best.items():
        print(f"| {m} | {v:,.1f} |")
    print(f"refill / static: {res['ratio']:.2f}x; same answers: {res['same_answers']}")
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
