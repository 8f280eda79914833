"""Two or more gpu_suite.json files (the spec stage) side by side: for each suite, batch and
setting they share, decode-only tok/s, the speedup over each process's own baseline, the ratio
to the first file's, the cycle and its draft and verify phases, and tokens accepted a cycle;
a bar plot of the decode-only speedups.

Usage: python benchmarks/ab_report.py LABEL=RUN/gpu_suite.json LABEL=... --out OUT_DIR [--name ab]
Writes OUT_DIR/NAME.md and OUT_DIR/NAME.png and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

Key = tuple[str, int, str]


def load_rows(path: Path) -> dict[Key, dict]:
    """{(suite, batch, setting): row} of one gpu_suite.json's spec stage."""
    res = json.loads(path.read_text())
    try:
        rows = res["spec"]["result"]["rows"]
    except (KeyError, TypeError):
        raise SystemExit(f"{path}: no spec stage rows (a gpu_suite.json of STAGES=spec?)") from None
    return {(r["suite"], r["batch"], r["setting"]): r for r in rows}


def tok_s(r: dict) -> float:
    return r.get("decode_tok_s", r["tok_s"])


def phase(r: dict, name: str) -> str:
    ms = (r.get("phases") or {}).get("ms") or {}
    return f"{ms[name]:.3f}" if name in ms else ""


def baseline_of(setting: str) -> str:
    """The row a setting divides by: "baseline", or "baseline T0.7" for one sampled at 0.7."""
    tag = re.search(r" T\S+$", setting)
    return "baseline" + (tag.group() if tag else "")


def shared_keys(runs: list[dict[Key, dict]]) -> list[Key]:
    """The rows every run has, baselines first within each (suite, batch)."""
    keys = set(runs[0]).intersection(*runs[1:])
    return sorted(keys, key=lambda k: (k[0], k[1], baseline_of(k[2]), k[2] != baseline_of(k[2]),
                                     k[2]))


def own_speedup(run: dict[Key, dict], key: Key) -> float:
    return tok_s(run[key]) / tok_s(run[(key[0], key[1], baseline_of(key[2]))])


def table(labels: list[str], runs: list[dict[Key, dict]]) -> str:
    """One row per shared (suite, batch, setting); cells `a / b / ...` in the labels' order."""
    head = (f"| suite | batch | setting | decode tok/s ({' / '.join(labels)}) | "
            f"speedup over own baseline | ratio to {labels[0]} | cycle ms | draft ms | "
            "verify ms | accepted a cycle |")
    out = [head, "|" + "---|" * 10]
    for key in shared_keys(runs):
        def cells(f, key=key) -> str:
            return " / ".join(f(run, run[key]) for run in runs)

        spec = not key[2].startswith("baseline")
        has_base = all((key[0], key[1], baseline_of(key[2])) in run for run in runs)
        ratio = " / ".join(f"{tok_s(run[key]) / tok_s(runs[0][key]):.3f}" for run in runs[1:])
        per = [cells(lambda run, r: f"{tok_s(r):,.0f}"),
               cells(lambda run, r, key=key: f"{own_speedup(run, key):.2f}x")
               if spec and has_base else "", ratio]
        if spec:
            per += [cells(lambda run, r: f"{r.get('wall_cycle_ms', 0):.3f}"),
                    cells(lambda run, r: phase(r, "draft")),
                    cells(lambda run, r: phase(r, "verify")),
                    cells(lambda run, r: f"{r.get('accept_length', 0):.2f}")]
        else:
            per += [""] * 4
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(per) + " |")
    return "\n".join(out)


def plotted(runs: list[dict[Key, dict]]) -> list[Key]:
    """The shared speculative rows whose baseline every file has."""
    return [k for k in shared_keys(runs) if not k[2].startswith("baseline")
            and all((k[0], k[1], baseline_of(k[2])) in run for run in runs)]


def plot(labels: list[str], runs: list[dict[Key, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = plotted(runs)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(keys) * len(runs)), 4))
    width, top = 0.8 / len(runs), 0.0
    for i, (label, run) in enumerate(zip(labels, runs, strict=True)):
        ys = [own_speedup(run, k) for k in keys]
        top = max([top, *ys])
        bars = ax.bar([j + i * width for j in range(len(keys))], ys, width, label=label)
        ax.bar_label(bars, fmt="%.2fx", fontsize=8)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))],
                  [f"{s}, b{b}\n{setting}" for s, b, setting in keys])
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("decode-only speedup over own baseline")
    ax.set_title("Side by side, one call")
    ax.set_ylim(0, top * 1.25)
    ax.legend(loc="upper center", ncols=len(runs))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="LABEL=path/to/gpu_suite.json, two or more")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="ab")
    a = ap.parse_args(argv)
    if len(a.runs) < 2 or any("=" not in r for r in a.runs):
        raise SystemExit("give two or more LABEL=path/to/gpu_suite.json")
    labels = [r.split("=", 1)[0] for r in a.runs]
    runs = [load_rows(Path(r.split("=", 1)[1])) for r in a.runs]
    if not shared_keys(runs):
        raise SystemExit("the files share no (suite, batch, setting) row")
    if not plotted(runs):
        raise SystemExit("no shared speculative row has a baseline in every file")
    a.out.mkdir(parents=True, exist_ok=True)
    text = table(labels, runs)
    (a.out / f"{a.name}.md").write_text(text + "\n")
    plot(labels, runs, a.out / f"{a.name}.png")
    print(text)


if __name__ == "__main__":
    main()
