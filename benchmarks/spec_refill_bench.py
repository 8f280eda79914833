"""Static batches vs refilled rows for `draftsmith bench`, baseline and speculative, in one process.

Usage: python benchmarks/spec_refill_bench.py --drafter DIR [--device cuda] [--batch-size 8,32]
       [--suite chat --suite humaneval] [--num-prompts 64] [--steps 3] [--topk 1,4]
       [--num-draft-tokens 24] [--max-new-tokens 256] [--out DIR]
Runs `run_bench` twice on the same prompts, static (`refill=False`) then refilled, and prints
each setting's wall-time tokens/s (prefills included) both ways, the refill / static ratio and
speculative / baseline within each mode. Greedy: every answer must be the same both ways
(checked, counted). Writes spec_refill.json and spec_refill.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from draftsmith.bench.run import BenchConfig, run_bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-size", default="8,32")
    ap.add_argument("--suite", action="append", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--steps", default="3")
    ap.add_argument("--topk", default="1,4")
    ap.add_argument("--num-draft-tokens", default="24")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default="spec-refill-out")
    a = ap.parse_args()

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    cuda = a.device == "cuda"
    cfg = dict(target=a.target, drafter=a.drafter, suites=a.suite or ["chat", "humaneval"],
               num_prompts=a.num_prompts, steps=ints(a.steps), topk=ints(a.topk),
               num_draft_tokens=ints(a.num_draft_tokens), batch_sizes=ints(a.batch_size),
               max_new_tokens=a.max_new_tokens, device=a.device,
               dtype=torch.bfloat16 if cuda else torch.float32, compile=a.compile)
    reports = {}
    for mode in ("static", "refill"):
        reports[mode] = run_bench(BenchConfig(**cfg, refill=mode == "refill"),
                                  log=lambda s, m=mode: print(f"[{m}] {s}", flush=True))
    rows = side_by_side(reports)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"meta": reports["static"]["meta"], "config": {**cfg, "dtype": str(cfg["dtype"])},
              "rows": rows}
    (out / "spec_refill.json").write_text(json.dumps(result, indent=1))
    print_table(rows)
    plot(rows, out / "spec_refill.png")
    print(json.dumps({"rows": rows}))


def side_by_side(reports: dict) -> list[dict]:
    rows = []
    base = {(r["suite"], r["batch"], m): r for m, rep in reports.items()
            for r in rep["results"] if r["setting"] == "baseline"}
    for s, r in zip(reports["static"]["results"], reports["refill"]["results"], strict=True):
        k = (s["suite"], s["batch"])
        row = {"suite": k[0], "batch": k[1], "setting": s["setting"],
               "static_tok_s": s["tokens_per_s"], "refill_tok_s": r["tokens_per_s"],
               "refill_over_static": r["tokens_per_s"] / s["tokens_per_s"],
               "new_tokens": [s["new_tokens"], r["new_tokens"]]}
        if s["setting"] != "baseline":
            row["speedup"] = [s["tokens_per_s"] / base[(*k, "static")]["tokens_per_s"],
                              r["tokens_per_s"] / base[(*k, "refill")]["tokens_per_s"]]
            row["accept_length"] = [s["mean_accept_length"], r["mean_accept_length"]]
            row["identical_to_baseline"] = [x["agreement"]["identical"] for x in (s, r)]
            row["prompts"] = s["agreement"]["prompts"]
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| suite | batch | setting | static tok/s | refill tok/s | refill / static | "
          "speedup static / refill | accept static / refill | same as baseline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = "-" if "speedup" not in r else "{:.2f}x / {:.2f}x".format(*r["speedup"])
        acc = "-" if "accept_length" not in r else "{:.2f} / {:.2f}".format(*r["accept_length"])
        same = ("-" if "prompts" not in r else
                f"{r['identical_to_baseline'][0]} / {r['identical_to_baseline'][1]} of "
                f"{r['prompts']}")
        print(f"| {r['suite']} | {r['batch']} | {r['setting']} | {r['static_tok_s']:,.0f} | "
              f"{r['refill_tok_s']:,.0f} | {r['refill_over_static']:.2f}x | {sp} | {acc} | "
              f"{same} |")


def plot(rows: list[dict], path: Path) -> None:
    labels = [f"{r['suite']} b{r['batch']}\n{r['setting']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    ax.bar([i - 0.2 for i in x], [r["static_tok_s"] for r in rows], 0.4, label="static batches")
    ax.bar([i + 0.2 for i in x], [r["refill_tok_s"] for r in rows], 0.4, label="refilled rows")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("tokens/s (wall, prefills included)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
