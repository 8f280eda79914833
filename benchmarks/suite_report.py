"""Markdown tables and a plot from a gpu_suite.json (the spec stage): speedup over the same run's
baseline, accept length, per-position acceptance, phase split and greedy agreement.

Usage: python benchmarks/suite_report.py RUN/gpu_suite.json OUT_DIR
Writes OUT_DIR/speculative_tables.md and OUT_DIR/speculative.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def phase_cells(r: dict) -> tuple[str, str]:
    ph = r.get("phases") or {}
    ms, pct = ph.get("ms") or {}, ph.get("pct") or {}
    if not ms:
        return "", ""
    split = " / ".join(f"{ms[k]:.2f}" for k in ("draft", "verify", "accept", "extend"))
    return split, f"{pct.get('draft', 0):.0f}%"


def agreement_cell(r: dict) -> str:
    g = r.get("greedy_agreement")
    if not g:
        return ""
    gaps = g["top2_gaps_at_divergence"]
    rows = g.get("rows", g.get("prompts"))  # "prompts" (through run 18) counted rows too
    return f"{g['diverged']}/{rows}" + (f" (gaps {max(gaps):g} max)" if gaps else "")


def table(rows: list[dict]) -> str:
    split_time = any("decode_tok_s" in r for r in rows)  # runs before 2026-12-01 lack it
    head = ("| suite | batch | steps/topk/tokens | tok/s | speedup | "
            + ("prefill ms | decode-only speedup | wall ms a cycle or step | " if split_time
               else "")
            + "accept length | per-position acceptance | ms draft / verify / accept / extend | "
            "draft share | diverged from greedy |")
    out = [head, "|" + "---|" * (13 if split_time else 10)]
    for r in rows:
        split, share = phase_cells(r)
        pos = " ".join(f"{p:.2f}" for p in r.get("position_acceptance", []))
        acc = f"{r['accept_length']:.2f}" if "accept_length" in r else ""
        wall = f"{r['wall_cycle_ms']:.2f}" if "wall_cycle_ms" in r else ""
        if "host_launch_ms" in r:  # host ms a step: replaying graphs / blocked on the device
            wall += f" (host {r['host_launch_ms']:.2f} launch, {r['host_wait_ms']:.2f} wait)"
        times = (f"{r['prefill_ms']:.1f} | {r.get('decode_speedup', 1.0):.2f}x | {wall} | "
                 if split_time else "")
        out.append(f"| {r['suite']} | {r['batch']} | {r['setting']} | {r['tok_s']:.0f} | "
                   f"{r.get('speedup', 1.0):.2f}x | {times}{acc} | {pos} | {split} | {share} | "
                   f"{agreement_cell(r)} |")
    return "\n".join(out)


def is_chain(r: dict) -> bool:
    return r["setting"].split("/")[1] == "1"


def speedup(r: dict) -> float:
    return r.get("decode_speedup", r.get("speedup", 1.0))


def plot(rows: list[dict], path: Path) -> None:
    """Chains as lines over their steps, trees as bars (decode-only speedup where the run has
    it): one panel each, only those the run has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # eager-bookkeeping rows ("... eager-bk") repeat a setting: the table has them
    spec = [r for r in rows if not r["setting"].startswith("baseline")
            and " eager-bk" not in r["setting"]]
    chains, trees = [r for r in spec if is_chain(r)], [r for r in spec if not is_chain(r)]
    panels = [p for p in (chains, trees) if p] or [spec]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    keys = sorted({(r["suite"], r["batch"], r.get("temperature", 0.0)) for r in rows})
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel is chains:
            for suite, b, temp in keys:
                line = [r for r in chains
                        if (r["suite"], r["batch"], r.get("temperature", 0.0)) == (suite, b, temp)]
                if line:
                    ax.plot([int(r["setting"].split("/")[0]) for r in line],
                            [speedup(r) for r in line], marker="o",
                            label=f"{suite}, batch {b}" + (f", T {temp:g}" if temp else ""))
            ax.set_xlabel("chain steps (topk 1)")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.legend()
        else:
            bars = ax.bar(range(len(panel)), [speedup(r) for r in panel])
            ax.bar_label(bars, fmt="%.2fx", fontsize=8)
            ax.set_xticks(range(len(panel)), [f"{r['suite']}, b{r['batch']}\n{r['setting']}"
                                              for r in panel], fontsize=8)
            ax.set_xlabel("tree steps/topk/tokens")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("speedup over the same run's baseline")
    fig.suptitle("Speculative decoding, default target + its drafter")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    res = json.loads(src.read_text())
    rows = res["spec"]["result"]["rows"]
    out.mkdir(parents=True, exist_ok=True)
    text = (f"Device {res['device']}, torch {res['torch']}, {res['date']}, "
            f"{res['spec']['result']['new_tokens']} new tokens per prompt.\n\n{table(rows)}\n")
    (out / "speculative_tables.md").write_text(text)
    plot(rows, out / "speculative.png")
    print(text)


if __name__ == "__main__":
    main()
