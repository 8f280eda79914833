"""Which kinds of prompt a drafter fails on: its acceptance per category of a question file
whose records name one (MT-bench's, Spec-Bench's `question.jsonl`), one run.

Each category's first turns are decoded greedily by the speculative engine (batches of
`--batch` within a category), and tokens a cycle and per-position acceptance are pooled over
the category's cycles. Acceptance is a property of drafter and prompts, not of the device, so a
CPU run in fp32 answers the question (speed figures come from the GPU benchmarks: `bench`
gives the same per-category figures there, timed, at batch 1).

Usage: python benchmarks/acceptance_by_category.py --drafter DIR --questions FILE --out DIR
       [--steps 7 --topk 4 --num-draft-tokens 24] [--new 128] [--batch 4]
Writes OUT/acceptance_by_category.{json,md,png} and prints the table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from acceptance_by_prompts import cpu_pair, measure, write_results


def by_category(t, questions: str) -> dict[str, list[list[int]]]:
    """Each category's prompts (first turns as the target's chat ids), in first-seen order."""
    from draftsmith.bench.suites import suite_prompts

    out: dict[str, list[list[int]]] = {}
    for messages, cat in suite_prompts(questions, 0):
        out.setdefault(cat or "(none)", []).append(t.chat_ids(messages))
    return out


def report(res: dict, out: Path) -> str:
    lines = ["| category | prompts | cycles | tokens a cycle | per-position acceptance |",
             "|---|---|---|---|---|"]
    for name, r in res["sets"].items():
        pos = " ".join(f"{p:.2f}" for p in r["position_acceptance"] if p is not None)
        lines.append(f"| {name} | {r['prompts']} | {r['cycles']} | {r['accept_length']:.2f} | "
                     f"{pos} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["sets"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, [res["sets"][n]["accept_length"] for n in names], color="C0")
    ax.axhline(res["all"]["accept_length"], color="k", ls="--", label="all questions")
    ax.set_ylabel("tokens a cycle (greedy)")
    ax.set_title(f"Acceptance by category, tree {res['setting']}, {res['new_tokens']} new "
                 f"tokens ({res['device']})")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_category.png", dpi=120)
    return "\n".join(lines)


def pooled(sets: dict[str, dict]) -> dict:
    """All categories' cycles together: tokens a cycle weighted by each category's cycles."""
    cycles = sum(r["cycles"] for r in sets.values())
    mean = sum(r["accept_length"] * r["cycles"] for r in sets.values()) / max(cycles, 1)
    return {"prompts": sum(r["prompts"] for r in sets.values()), "cycles": cycles,
            "accept_length": mean}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--questions", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="default")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=24)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()

    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder

    out, t, model, drafter = cpu_pair(a.target, a.drafter, a.out)
    t0 = time.perf_counter()
    cats = by_category(t, a.questions)
    tree = a.topk > 1
    dec = SpecDecoder(Runtime(model, a.batch, 1024), drafter, a.steps, a.topk,
                      a.num_draft_tokens if tree else None)
    setting = f"{a.steps}/{a.topk}/{a.num_draft_tokens if tree else a.steps + 1}"
    res = {"drafter": a.drafter, "target": a.target, "questions": a.questions,
           "setting": setting, "new_tokens": a.new, "batch": a.batch, "device": "cpu, fp32",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "sets": {}}
    for name, prompts in cats.items():
        res["sets"][name] = measure(dec, prompts, a.new, list(t.eos_ids), a.batch)
        print(name, res["sets"][name]["accept_length"], flush=True)
    res["all"] = pooled(res["sets"])
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_results(res, out, "acceptance_by_category", report)


if __name__ == "__main__":
    main()
