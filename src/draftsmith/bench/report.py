"""Bench output: a rich table, the profiler table of each batch's fastest setting, a JSON file
and a PNG (tokens/s and speedup, accept-length histogram, per-position acceptance, phases)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from draftsmith.engine.profiler import PHASES, PhaseSummary, table
from draftsmith.measured import figure, gaps

SHORT = {"draft": "draft", "verify": "verify", "accept": "accept", "extend": "extend",
         "refill": "refill"}


def phase_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The cycle's phases, and `refill` where a refilled run was profiled."""
    seen = {k for r in rows if r.get("phases") for k in r["phases"]["ms"]}
    return [*PHASES, *sorted(seen - set(PHASES))]


def results_table(report: dict[str, Any]) -> Table:
    rows = report["results"]
    npos = max((len(r.get("position_rates", [])) for r in rows), default=0)
    show = min(npos, 4)
    profiled, keys = any(r.get("phases") for r in rows), phase_keys(rows)
    t = Table(title=f"draftsmith bench · {report['meta']['device']} · {report['meta']['dtype']}")
    for col in ("suite", "batch", "setting", "tok/s", "speedup", "decode tok/s",
                "decode speedup", "accept len", "len/max"):  # of steps + 1, a cycle's most
        t.add_column(col, justify="left" if col in ("suite", "setting") else "right")
    for i in range(show):
        t.add_column(f"p{i + 1}", justify="right")
    if profiled:
        for k in keys:
            t.add_column(f"{SHORT.get(k, k)} %", justify="right")
        t.add_column("cycle ms", justify="right")
    if any("agreement" in r for r in rows):
        t.add_column("same", justify="right")
    for r in rows:
        base = r["setting"] == "baseline"
        cells = [r["suite"], str(r["batch"]), r["setting"], f"{r['tokens_per_s']:.1f}",
                 "1.00x" if base else figure(r["speedup"], ".2f", "x"),
                 f"{r['decode_tokens_per_s']:.1f}",
                 "1.00x" if base else figure(r["decode_speedup"], ".2f", "x"),
                 "" if base else figure(r["mean_accept_length"], ".2f"),
                 "" if base else figure(r["accept_rate"], ".2f")]
        rates = r.get("position_rates", [])
        cells += [figure(rates[i], ".0%") if i < len(rates) else "" for i in range(show)]
        if profiled:
            ph = r.get("phases")
            cells += [f"{ph['pct'].get(k, 0.0):.1f}" if ph else "" for k in keys]
            cells.append(f"{ph['cycle_ms']:.2f}" if ph else "")
        if any("agreement" in x for x in rows):
            a = r.get("agreement")
            cells.append(f"{a['identical']}/{a['prompts']}" if a else "")
        t.add_row(*cells, style="dim" if base else None)
    return t


def print_report(report: dict[str, Any], console: Console) -> None:
    console.print(results_table(report))
    for r in fastest(report):
        if r.get("phases"):
            ph = PhaseSummary(**r["phases"])
            console.print(table(ph, f"{r['suite']} · batch {r['batch']} · {r['setting']}"))
    for r in report["results"]:
        a = r.get("agreement")
        if a and a["identical"] < a["prompts"]:
            console.print(
                f"{r['suite']} batch {r['batch']} {r['setting']}: "
                f"{a['prompts'] - a['identical']} completions diverge from the baseline; "
                f"largest candidate-logit gap at a divergence {figure(a['max_gap'], '.4f')}"
            )
    print(json.dumps(strict(report), separators=(",", ":"), allow_nan=False))


def fastest(report: dict[str, Any]) -> list[dict[str, Any]]:
    best: dict[tuple, dict[str, Any]] = {}
    for r in report["results"]:
        if r["setting"] == "baseline":
            continue
        key = (r["suite"], r["batch"])
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r
    return list(best.values())


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strict(report), indent=1, allow_nan=False) + "\n")
    return path


def strict(v: Any) -> Any:
    """`v` with every non-finite float as None: strict JSON readers (jq, JavaScript) refuse the
    NaN and Infinity literals Python writes."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict(x) for x in v]
    return v


def write_png(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["setting"] != "baseline"]
    fig, ax = plt.subplots(2, 2, figsize=(14, 9))
    groups = sorted({(r["suite"], r["batch"]) for r in rows})
    names = list(dict.fromkeys(r["setting"] for r in rows))
    width = 0.8 / max(1, len(groups))
    for gi, (suite, b) in enumerate(groups):
        ys = gaps([next((r["speedup"] for r in rows if (r["suite"], r["batch"], r["setting"])
                          == (suite, b, n)), None) for n in names])
        ax[0, 0].bar([i + gi * width for i in range(len(names))], ys, width,
                     label=f"{suite} b{b}")
    ax[0, 0].axhline(1.0, color="k", lw=0.8)
    ax[0, 0].set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=45,
                        ha="right")
    ax[0, 0].set_ylabel("speedup over baseline")
    ax[0, 0].legend(fontsize=7)
    for r in fastest(report):
        h, label = r["accept_hist"], f"{r['suite']} b{r['batch']} {r['setting']}"
        if sum(h):  # a run of no cycle has no histogram, not one of zeros
            ax[0, 1].plot(range(1, len(h)), [c / sum(h) for c in h[1:]], marker="o", label=label)
        ax[1, 0].plot(range(1, len(r["position_rates"]) + 1), gaps(r["position_rates"]),
                      marker="o", label=label)
    ax[0, 1].set(xlabel="tokens per cycle", ylabel="share of cycles",
                 title="accept length (fastest setting)")
    ax[1, 0].set(xlabel="draft position", ylabel="P(accepted | reached)", ylim=(0, 1.05),
                 title="per-position acceptance")
    for a in (ax[0, 1], ax[1, 0]):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    _phases(ax[1, 1], rows)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _phases(ax, rows: list[dict[str, Any]]) -> None:
    prof = [r for r in rows if r.get("phases")]
    if not prof:
        ax.text(0.5, 0.5, "run with --profile for the phase breakdown", ha="center")
        ax.set_axis_off()
        return
    labels = [f"{r['suite']} b{r['batch']} {r['setting']}" for r in prof]
    bottom = [0.0] * len(prof)
    for k in phase_keys(prof):
        vals = [r["phases"]["ms"].get(k, 0.0) for r in prof]
        ax.barh(labels, vals, left=bottom, label=k)
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    ax.set(xlabel="ms per cycle", title="phase breakdown")
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7)
