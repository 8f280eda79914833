"""Accept lengths of draft-tree shapes (and tree-score temperatures) for one drafter, on CPU.

Acceptance is a property of drafter, target and prompts, not of the device: the H200 measured
accept length 3.91 for tree 7/4/24 with run 8's drafter on the chat suite, and this script's fp32
CPU run gives 3.910. So larger trees can be sized here before a lease spends time on them
(speed figures come from the GPU benchmarks, not from here).

A score temperature T ranks the tree's candidates by log-softmax(logits / T): each node's k
children stay the same, the choice of which N-1 candidates to verify changes (T < 1 favours
depth, T > 1 breadth).

Usage: python benchmarks/tree_acceptance.py --drafter DIR --out DIR
       [--trees 7/4/24,7/8/48] [--temps 1.0 (the first tree's)] [--n 8] [--new 96]
Writes OUT/tree_acceptance.json, OUT/tree_acceptance.md and OUT/tree_acceptance.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from acceptance_by_prompts import cpu_pair, write_results


def report(res: dict, out: Path) -> str:
    lines = [f"Drafter `{res['drafter']}`, chat suite ({res['prompts']} prompts, "
             f"{res['new_tokens']} new tokens, batch {res['batch']}), {res['device']}, torch "
             f"{res['torch']}, "
             f"{res['date']}, {res['seconds']} s.", "",
             "| tree | score temperature | accept length | per-position acceptance |",
             "|---|---|---|---|"]
    for r in res["rows"]:
        pos = " ".join(f"{p:.2f}" for p in r["position_acceptance"])
        lines.append(f"| {r['tree']} | {r['temp']:g} | {r['accept_length']:.3f} | {pos} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ones = [r for r in res["rows"] if r["temp"] == 1.0]
    ax.bar([r["tree"] for r in ones], [r["accept_length"] for r in ones])
    ax.set_ylabel("accept length")
    ax.set_title("Accept length by tree shape (chat suite, greedy)")
    fig.tight_layout()
    fig.savefig(out / "tree_acceptance.png", dpi=120)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="default")
    ap.add_argument("--trees", default="7/4/24")
    ap.add_argument("--temps", default="1.0")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()

    from rich.progress import track

    from draftsmith.bench.suites import suite_messages
    from draftsmith.engine import tree
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.spec_state import SpecResult
    from draftsmith.engine.speculative import SpecDecoder

    out, t, model, drafter = cpu_pair(a.target, a.drafter, a.out)
    prompts = [t.chat_ids(m) for m in suite_messages("chat", a.n)]
    rt = Runtime(model, a.batch, 1024)
    plain = tree.top_k_log_softmax
    first, *rest = a.trees.split(",")  # the temperatures sweep the first tree only
    runs = [(first, float(x)) for x in a.temps.split(",")] + [(s, 1.0) for s in rest]
    res = {"drafter": a.drafter, "target": a.target, "prompts": len(prompts), "new_tokens": a.new,
           "batch": a.batch, "device": "cpu, fp32", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": []}
    t0 = time.perf_counter()
    try:
        for shape, temp in track(runs, description="trees"):
            tree.top_k_log_softmax = lambda x, k, temp=temp: plain(x / temp, k)
            steps, topk, n = (int(v) for v in shape.split("/"))
            dec = SpecDecoder(rt, drafter, steps, topk, n)
            parts = [dec.generate(prompts[i : i + a.batch], a.new, list(t.eos_ids))
                     for i in range(0, len(prompts), a.batch)]
            m = SpecResult.merged(parts)
            res["rows"].append({"tree": shape, "temp": temp,
                                "accept_length": m.mean_accept_length,
                                "position_acceptance": m.position_rates,
                                "new_tokens": m.new_tokens})
            print(json.dumps(res["rows"][-1]), flush=True)
    finally:
        tree.top_k_log_softmax = plain
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_results(res, out, "tree_acceptance", report)


if __name__ == "__main__":
    main()
