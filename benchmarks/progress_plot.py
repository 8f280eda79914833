"""The best batch-1 decode-only speedup of each H200 run, read from the run headings of
benchmarks/speculative_default.md, against the 2.5x goal of issue 5. Runs 1-3 reported whole
generation only, so their headings carry no decode-only figure and are left out. A run whose
heading says its baseline got faster (run 12: "the baseline 21-26 % faster") is marked: from
there on every ratio divides by the faster baseline.

Usage: python benchmarks/progress_plot.py [--md benchmarks/speculative_default.md]
       [--out benchmarks/speculative_progress.png]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HEADING = re.compile(r"^## Run (\d+) \((\d{4}-\d\d-\d\d)[^)]*\):.*?decode-only "
                     r"(?:speedups at most )?([\d.]+)x", re.M)
REBASED = re.compile(r"^## Run (\d+) .*baseline ([\d-]+ %) faster", re.M)
GOAL = 2.5


def runs(md: str) -> list[tuple[int, str, float]]:
    """(run, date, best batch-1 decode-only speedup) per run heading, oldest first."""
    return sorted((int(n), d, float(x)) for n, d, x in HEADING.findall(md))


def rebased(md: str) -> dict[int, str]:
    """{run: how much faster its baseline got} for the headings that say so."""
    return {int(n): pct for n, pct in REBASED.findall(md)}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser()
    ap.add_argument("--md", default="benchmarks/speculative_default.md")
    ap.add_argument("--out", default="benchmarks/speculative_progress.png")
    a = ap.parse_args()
    md = Path(a.md).read_text(encoding="utf-8")
    rows = runs(md)
    for n, d, x in rows:
        print(f"run {n} ({d}): {x:.2f}x")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([n for n, _, _ in rows], [x for _, _, x in rows], "o-", label="best, batch 1")
    ax.axhline(GOAL, ls="--", color="gray", label=f"goal {GOAL}x")
    ax.axhline(1.0, color="black", lw=0.5)
    for i, (n, pct) in enumerate(sorted(rebased(md).items())):
        ax.axvline(n - 0.5, ls=":", color="tab:red")
        # labels of neighbouring runs step down so they do not overlap
        ax.annotate(f"baseline\n{pct} faster", (n - 0.45, GOAL - 0.05 - 0.25 * (i % 3)),
                    va="top", fontsize=8, color="tab:red")
    ax.set_xticks([n for n, _, _ in rows])
    ax.set(xlabel="H200 run", ylabel="decode-only speedup",
           title="Default target, chat suite, batch 1")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)


if __name__ == "__main__":
    main()
