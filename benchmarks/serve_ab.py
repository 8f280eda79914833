"""serve_bench.json files of two or more code versions side by side: each version's runs of one
mode pooled over its files (completion tokens over summed wall time; latencies averaged over
runs), and each version's ratio to the first.

Usage: python benchmarks/serve_ab.py LABEL=DIR[,DIR...] LABEL=DIR[,DIR...] [--engine baseline]
       [--png PATH]
Prints a markdown table; --png: tok/s of each version and mode as bars.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def pooled(dirs: list[str], engine: str, mode: str) -> dict:
    runs = [v for d in dirs
            for k, v in json.loads((Path(d) / "serve_bench.json").read_text())["runs"].items()
            if k.startswith(f"{engine} {mode} ")]
    return {"runs": len(runs),
            "tok_s": sum(r["completion_tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
            "latency_mean_s": statistics.fmean(r["latency_mean_s"] for r in runs),
            "latency_p90_s": statistics.fmean(r["latency_p90_s"] for r in runs),
            "batches": statistics.fmean(r["batches"] for r in runs),
            "joined_rows": statistics.fmean(r["joined_rows"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("versions", nargs="+", help="LABEL=DIR[,DIR...]")
    ap.add_argument("--engine", default="baseline")
    ap.add_argument("--png", type=Path)
    a = ap.parse_args()
    versions = dict(v.split("=", 1) for v in a.versions)
    print("| mode | version | runs | tok/s | vs first | latency mean s | vs first | p90 s "
          "| batches a run | joined rows a run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    table: dict[tuple[str, str], dict] = {}
    for mode in ("static", "continuous"):
        first = None
        for label, dirs in versions.items():
            p = table[mode, label] = pooled(dirs.split(","), a.engine, mode)
            first = first or p
            print(f"| {mode} | {label} | {p['runs']} | {p['tok_s']:.1f} | "
                  f"{p['tok_s'] / first['tok_s']:.2f}x | {p['latency_mean_s']:.2f} | "
                  f"{p['latency_mean_s'] / first['latency_mean_s']:.2f}x | "
                  f"{p['latency_p90_s']:.2f} | {p['batches']:.1f} | {p['joined_rows']:.1f} |")
    if a.png:
        plot(table, list(versions), a.engine, a.png)


def plot(table: dict[tuple[str, str], dict], labels: list[str], engine: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(labels), 3.6))
    width = 0.8 / 2
    for j, mode in enumerate(("static", "continuous")):
        xs = [i + (j - 0.5) * width for i in range(len(labels))]
        ax.bar(xs, [table[mode, k]["tok_s"] for k in labels], width, label=mode)
    ax.set_xticks(range(len(labels)), labels)
    ax.set(ylabel="completion tok/s (pooled)", title=f"serve, {engine}: versions side by side")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
