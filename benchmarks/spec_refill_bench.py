"""Static batches vs refilled rows for `draftsmith bench`, baseline and speculative, in one process.

Usage: python benchmarks/spec_refill_bench.py --drafter DIR [--device cuda] [--batch-size 8,32]
       [--suite chat --suite humaneval] [--num-prompts 64] [--steps 3] [--topk 1,4]
       [--num-draft-tokens 24] [--max-new-tokens 256] [--refill-every 4] [--out DIR]
Runs `run_bench` on the same prompts static (`refill=False`), then refilled once per
`--refill-every` value (a comma list), and prints each setting's wall-time tokens/s (prefills
included) every way, refill / static, and speculative / baseline within each mode. Greedy: each
answer is compared with its mode's baseline (identical answers counted). Writes
spec_refill.json and spec_refill.png.
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
    ap.add_argument("--refill-every", default="4")
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
    reports = {"static": run_bench(BenchConfig(**cfg),
                                   log=lambda s: print(f"[static] {s}", flush=True))}
    for e in ints(a.refill_every):
        reports[f"refill {e}"] = run_bench(
            BenchConfig(**cfg, refill=True, refill_every=e),
            log=lambda s, e=e: print(f"[refill {e}] {s}", flush=True))
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
    """A row per (suite, batch, setting): tokens/s per mode, each refill mode over static, and
    speculative over its own mode's baseline."""
    base = {(r["suite"], r["batch"], m): r for m, rep in reports.items()
            for r in rep["results"] if r["setting"] == "baseline"}
    rows = []
    for i, s in enumerate(reports["static"]["results"]):
        k = (s["suite"], s["batch"])
        row: dict = {"suite": k[0], "batch": k[1], "setting": s["setting"], "modes": {}}
        for m, rep in reports.items():
            r = rep["results"][i]
            mode = {"tok_s": r["tokens_per_s"], "new_tokens": r["new_tokens"],
                    "over_static": r["tokens_per_s"] / s["tokens_per_s"]}
            if r["setting"] != "baseline":
                mode.update(speedup=r["tokens_per_s"] / base[(*k, m)]["tokens_per_s"],
                            accept_length=r["mean_accept_length"],
                            identical=r["agreement"]["identical"],
                            prompts=r["agreement"]["prompts"])
            row["modes"][m] = mode
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    modes = list(rows[0]["modes"])
    refills = modes[1:]
    print("| suite | batch | setting | static tok/s | "
          + " | ".join(f"{m} tok/s (/ static)" for m in refills)
          + " | speedup, " + " / ".join(modes) + " | same as baseline |")
    print("|---|---|---|---|" + "---|" * len(refills) + "---|---|")
    for r in rows:
        ms = r["modes"]
        cells = [f"{ms[m]['tok_s']:,.0f} ({ms[m]['over_static']:.2f}x)" for m in refills]
        sp = ("-" if "speedup" not in ms["static"] else
              " / ".join(f"{ms[m]['speedup']:.2f}x" for m in modes))
        same = ("-" if "identical" not in ms["static"] else
                " / ".join(str(ms[m]["identical"]) for m in modes)
                + f" of {ms['static']['prompts']}")
        print(f"| {r['suite']} | {r['batch']} | {r['setting']} | {ms['static']['tok_s']:,.0f} | "
              + " | ".join(cells) + f" | {sp} | {same} |")


def plot(rows: list[dict], path: Path) -> None:
    modes = list(rows[0]["modes"])
    labels = [f"{r['suite']} b{r['batch']}\n{r['setting']}" for r in rows]
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.1), 4.5))
    for j, m in enumerate(modes):
        ax.bar([i - 0.4 + width * (j + 0.5) for i in range(len(rows))],
               [r["modes"][m]["tok_s"] for r in rows], width,
               label="static batches" if m == "static" else f"refilled rows, every {m[7:]}")
    ax.set_xticks(list(range(len(rows))), labels, fontsize=7)
    ax.set_ylabel("tokens/s (wall, prefills included)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
