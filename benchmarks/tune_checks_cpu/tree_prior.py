"""How many pooled row-cycles should each prompt's own tree counts start from (TREE_PRIOR)?

Measures, as `draftsmith tune` does, each prompt's chain (decoded alone) and its row of the wide
tree run, then predicts batch 4's busy share under several priors, static and refilled, against
the busy shares a tune run measured on the same prompts and drafter.

Usage (repository root, `.kept19` restored as runs/cpu/drafter):
  python benchmarks/tune_checks_cpu/tree_prior.py STATIC_TUNE_JSON REFILL_TUNE_JSON
Or, from tune runs that kept each prompt's tree counts (`prompt_tree_counts`, 2026-12-05 on),
without measuring anything, every batch above 1 of each run against itself:
  python benchmarks/tune_checks_cpu/tree_prior.py --from-json TUNE_JSON...
"""

import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.runtime import Runtime
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import load_target
from draftsmith.tune import measure
from draftsmith.tune.cli import refill_plan, suite
from draftsmith.tune.cost_model import (
    Acceptance,
    CostModelError,
    PromptMix,
    SpecSetting,
    prompt_tree,
)

BATCH, STEPS, TOPK, NEW = 4, 4, 4, 48  # the CPU tune runs' --batch-sizes 1,4 --max-steps 4 ...
PRIORS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, math.inf)  # inf: the chain's spread (before)


def setting(text: str) -> SpecSetting:
    steps, topk, tokens = (int(part.split()[1 if i < 2 else 0])
                           for i, part in enumerate(text.split(", ")))
    return SpecSetting(steps, topk, tokens)


def measured(path: str) -> dict[SpecSetting, float]:
    rows = json.loads(Path(path).read_text())["phases"]
    return {setting(r["setting"]): r["measured_busy"] for r in rows
            if r["batch"] == BATCH and r.get("measured_busy") is not None}


def fit(mix_of, meas: dict[SpecSetting, float], busy) -> dict:
    """Predicted minus measured busy share of the trees, at each prior."""
    out = {}
    if not any(s.topk > 1 for s in meas):
        return out  # this batch's sweep timed no tree
    for prior in PRIORS:
        try:
            mix = mix_of(prior)
        except CostModelError as e:  # prior 0: a prompt that never reached depth 1
            out[f"prior {prior:g}"] = str(e)
            continue
        trees = [busy(mix, s) - b for s, b in meas.items() if s.topk > 1]
        out[f"prior {prior:g}"] = {"trees": len(trees),
                                   "mean_abs": round(statistics.mean(map(abs, trees)), 3),
                                   "bias": round(statistics.mean(trees), 3),
                                   "max_abs": round(max(map(abs, trees)), 3)}
    return out


def mixes(pooled: Acceptance, chains: list, rows: list):
    def mix_of(prior: float) -> PromptMix:
        return PromptMix(tuple(
            Acceptance(chain=c) if math.isinf(prior) else prompt_tree(pooled, r, a, c, prior)
            for (r, a), c in zip(rows, chains, strict=True)))
    return mix_of


def from_json(paths: list[str]) -> None:
    for path in paths:
        d = json.loads(Path(path).read_text())
        if not d.get("prompt_tree_counts"):
            raise SystemExit(f"{path}: no prompt_tree_counts (a tune run before they were kept)")
        pooled = Acceptance.from_dict(d["acceptance"])
        rows = [(c["reached"], c["accepted"]) for c in d["prompt_tree_counts"]]
        mix_of = mixes(pooled, [a["chain"] for a in d["prompt_acceptance"]], rows)
        batches = sorted({r["batch"] for r in d["phases"]} - {1})
        plan = refill_plan(d["new_tokens"], batches) if d["refill"] else None
        for b in batches:
            meas = {setting(r["setting"]): r["measured_busy"] for r in d["phases"]
                    if r["batch"] == b and r.get("measured_busy") is not None}
            res = fit(mix_of, meas, busy_at(plan, pooled, b))
            print(json.dumps({"run": path, "refill": d["refill"], "batch": b, **res}), flush=True)


def busy_at(plan, pooled: Acceptance, batch: int):
    """busy(mix, setting): a static batch's (plan None) or refilled rows' predicted share."""
    def busy(mix: PromptMix, s: SpecSetting) -> float:
        if plan is None:
            return mix.busy(s, batch)
        return plan.busy(pooled, s, batch, mix)
    return busy


def main() -> None:
    if sys.argv[1] == "--from-json":
        return from_json(sys.argv[2:])
    static, refilled = measured(sys.argv[1]), measured(sys.argv[2])
    torch.manual_seed(0)
    t = load_target("default")
    model = t.build(torch.float32, "cpu")
    drafter = load_drafter("runs/cpu/drafter", "cpu", torch.float32, embed=model.embed.weight)
    ids = [t.chat_ids([{"role": "user", "content": p}])
           for p in suite(Path("benchmarks/tune_refill_cpu/prompts8.jsonl"))]
    max_seq = max(len(p) for p in ids) + NEW + 64
    eng = measure.Engine(Runtime(model, BATCH, max_seq + 40),
                         DrafterRuntime(drafter, BATCH, max_seq + 40 + 64 * STEPS, False), drafter)
    s = time.time()
    chain, mix = measure.chain_acceptance(eng, ids, STEPS, NEW, t.eos_ids)
    pooled, own = measure.tree_acceptance(eng, ids, STEPS, TOPK, NEW, t.eos_ids, chain, mix)
    rows = list(own.tree_counts)  # as tune measures them
    plan = refill_plan(NEW, [1, BATCH])
    mix_of = mixes(pooled, [p.chain for p in mix.prompts], rows)
    out = {"measure_s": round(time.time() - s),
           "static": fit(mix_of, static, busy_at(None, pooled, BATCH)),
           "refill": fit(mix_of, refilled, busy_at(plan, pooled, BATCH))}
    for prior in PRIORS:
        key = f"prior {prior:g}"
        print(json.dumps({key: {"static": out["static"][key], "refill": out["refill"][key]}}),
              flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
