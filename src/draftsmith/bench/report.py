"""Bench output: a rich table, the profiler table of each batch's fastest setting, one JSON line
on stdout (the headline figures and where bench.json is), bench.json (the whole report) and a
PNG (tokens/s and speedup, accept-length histogram, per-position acceptance, phases)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from draftsmith.bench.load import busy_note
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
    t = Table(title=escape(run_title(report["meta"])))
    clocked = host_keys(rows)
    for col in ("suite", "batch", "setting", "tok/s", "speedup", "decode tok/s",
                "decode speedup", "accept len", "len/max"):  # of steps + 1, a cycle's most
        t.add_column(col, justify="left" if col in ("suite", "setting") else "right")
    for i in range(show):
        t.add_column(f"p{i + 1}", justify="right")
    if profiled:
        for k in keys:
            t.add_column(f"{SHORT.get(k, k)} %", justify="right")
        t.add_column("cycle ms", justify="right")
    for k in clocked:  # DRAFTSMITH_HOST_TIMING=1: ms a decode step or cycle
        t.add_column(f"host {k.removesuffix('_ms')} ms", justify="right")
    if any("agreement" in r for r in rows):
        t.add_column("same", justify="right")
    for r in rows:
        base = r["setting"] == "baseline"
        up, dup = (_own(r, "tokens_per_s"), _own(r, "decode_tokens_per_s")) if base else (
            ranged(r, "speedup", ".2f", "x"), ranged(r, "decode_speedup", ".2f", "x"))
        cells = [escape(r["suite"]), str(r["batch"]),  # a file's name, not rich markup
                 r["setting"], ranged(r, "tokens_per_s", ".1f"), up,
                 ranged(r, "decode_tokens_per_s", ".1f"), dup,
                 "" if base else figure(r["mean_accept_length"], ".2f"),
                 "" if base else figure(r["accept_rate"], ".2f")]
        rates = r.get("position_rates", [])
        cells += [figure(rates[i], ".0%") if i < len(rates) else "" for i in range(show)]
        if profiled:
            ph = r.get("phases")
            cells += [f"{ph['pct'].get(k, 0.0):.1f}" if ph else "" for k in keys]
            cells.append(f"{ph['cycle_ms']:.2f}" if ph else "")
        host = r.get("host") or {}
        cells += [figure(host.get(k), ".3f") for k in clocked]
        if any("agreement" in x for x in rows):
            a = r.get("agreement")
            cells.append(f"{a['identical']}/{a['prompts']}" if a else "")
        t.add_row(*cells, style="dim" if base else None)
    return t


def table_width(report: dict[str, Any]) -> int:
    """The columns the results table needs unfolded, where rounds gave it ranges; else 0."""
    if (report.get("meta") or {}).get("repeats", 1) == 1:
        return 0
    return Console(width=1000).measure(results_table(report)).maximum


def ranged(row: dict[str, Any], key: str, fmt: str, unit: str = "") -> str:
    """A figure, and where rounds measured it (`key_min`/`key_max`) its range: `1.42x
    (1.38-1.47)`."""
    cell = figure(row[key], fmt, unit)
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if row[key] is None or lo is None or hi is None:
        return cell
    return f"{cell} ({lo:{fmt}}-{hi:{fmt}})"


def run_title(meta: dict[str, Any]) -> str:
    """The table's and the plot's title: device, dtype, how tokens were chosen and how many a
    prompt, and a partial run or a busy machine."""
    title = " · ".join(str(x) for x in ("draftsmith bench", meta.get("device"), meta.get("dtype"),
                                        sampling(meta), meta.get("max_new_tokens")) if x)
    title += " new tokens" if meta.get("max_new_tokens") else ""
    if meta.get("partial"):
        title += " · PARTIAL (failed)" if meta.get("failed") else " · PARTIAL (interrupted)"
    return title + (" · BUSY MACHINE (see the note)" if busy(meta) else "")


def sampling(meta: dict[str, Any]) -> str | None:
    """"greedy", or the sampled setting and seed: a sampled run's speedups and accept lengths
    are not a greedy one's; None where the report does not say (an old one)."""
    if not (p := meta.get("params")):
        return None
    if not p["temperature"]:
        return "greedy"
    parts = [f"temperature {p['temperature']:g}"]
    parts += [f"top-p {p['top_p']:g}"] if p.get("top_p", 1.0) < 1 else []
    parts += [f"top-k {p['top_k']}"] if p.get("top_k") else []
    parts += [f"seed {meta['seed']}"] if meta.get("seed") is not None else []
    return "sampled: " + ", ".join(parts)


def _own(base: dict[str, Any], rate: str) -> str:
    """A baseline's speedup over itself: 1.00x, or "-" where it decoded nothing (0 over 0, as
    the settings timed against it show) or the rate was not measured (refilled rows' decode)."""
    return "1.00x" if base[rate] else "-"


def host_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The host clock's `<lap>_ms` figures any row has (launch, wait)."""
    return list(dict.fromkeys(k for r in rows for k in (r.get("host") or {}) if k.endswith("_ms")))


def print_report(report: dict[str, Any], console: Console, json_path: Path | None = None) -> None:
    """The tables and notes, then one JSON line: the headline figures and `json_path` where the
    whole report was written, else (no file to point at) the whole report."""
    console.print(results_table(report))
    if (by_category := category_table(report)) is not None:
        console.print(by_category)
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
                f"largest candidate-logit gap at a divergence {figure(a['max_gap'], '.4f')}",
                markup=False, highlight=False)
    for note in notes(report):
        console.print(note, markup=False, highlight=False)
    line = strict(report if json_path is None else headline(report, json_path))
    print(json.dumps(line, separators=(",", ":"), allow_nan=False), flush=True)


def notes(report: dict[str, Any]) -> list[str]:
    """What the figures carry besides the suites' prompts, and what an interrupted run left out."""
    out = []
    # 'same' is a greedy run's column; a sampled run has none to leave padding out of
    same = ", not in 'same'" if any("agreement" in r for r in report["results"]) else ""
    for r in report["results"]:
        if r["setting"] == "baseline" and (n := r.get("padding_rows")):
            out.append(f"{r['suite']} batch {r['batch']}: {r['prompts']} prompts, the last "
                       f"batch topped up with {n} repeated prompt{'s' if n > 1 else ''}; "
                       "padding rows are timed and count in tok/s and in the acceptance "
                       f"figures (accept len, per position, histogram){same}")
    if any(r.get("refill") or (r["setting"] == "baseline" and report["meta"].get("refill"))
           for r in report["results"]):
        out.append("refilled rows: tok/s over wall time, the refills' prompt passes included; "
                   "no decode-only rate ('-')")
    if host_keys(report["results"]):
        out.append("host ms (DRAFTSMITH_HOST_TIMING=1): the host's mean time a baseline decode "
                   "step or speculative cycle, launching its graphs and waiting on the device")
    if not_run := report["meta"].get("not_run"):
        stop = report["meta"].get("failed")
        why = f"failed in {stop['run']}: {stop['error']}" if stop else "interrupted"
        out.append(f"partial ({why}), not timed: " + "; ".join(not_run))
    if (timing := report["meta"].get("timing")) and report["meta"].get("repeats", 1) > 1:
        out.append(f"timed in {report['meta']['repeats']} rounds, {timing}: a speedup whose "
                   "range holds 1.00x (within_noise) is no measured difference")
    elif timing:
        out.append(f"timed in this order, {timing}: no spread is measured, so a speedup within "
                   "a few percent of 1.00x is no measured difference")
    if note := busy_note(report["meta"].get("machine_load")):
        out.append(note)
    return out


def busy(meta: dict[str, Any]) -> bool:
    """Whether the timings were taken while other work loaded the machine."""
    return bool((meta.get("machine_load") or {}).get("busy"))


HEADLINE = ("suite", "batch", "setting", "steps", "topk", "num_draft_tokens")


def headline(report: dict[str, Any], json_path: Path) -> dict[str, Any]:
    """The JSON line: per speculative setting its baseline's and its own tok/s, speedups and
    accept length; everything else is in `bench_json`."""
    rows = report["results"]
    base = {(r["suite"], r["batch"]): r["tokens_per_s"] for r in rows
            if r["setting"] == "baseline"}
    meta = report["meta"]
    out: dict[str, Any] = {"bench_json": str(json_path), "device": meta["device"],
                           "params": meta.get("params"), "seed": meta.get("seed"),
                           "max_new_tokens": meta.get("max_new_tokens"),
                           "partial": bool(meta.get("partial"))}
    if meta.get("repeats", 1) > 1:
        out["repeats"] = meta["repeats"]
    if meta.get("partial"):
        out["not_run"] = meta["not_run"]
    if meta.get("failed"):
        out["failed"] = meta["failed"]
    out["machine_busy"] = busy(meta)
    out["definitions"] = meta.get("definitions") or definitions(meta)
    if note := busy_note(meta.get("machine_load")):
        out["note"] = note
    out["results"] = [
        {**{k: r[k] for k in HEADLINE}, "baseline_tokens_per_s": base.get((r["suite"], r["batch"])),
         "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"],
         "decode_speedup": r["decode_speedup"], "mean_accept_length": r["mean_accept_length"],
         **{k: r[k] for k in SPREAD if k in r}}
        for r in rows if r["setting"] != "baseline"]
    return out


def definitions(meta: dict[str, Any]) -> dict[str, str]:
    """What each figure of a row and the JSON line is, for the run `meta` describes: a rate
    with or without prefill, acceptance pooled over row-cycles, not a mean of per-prompt
    figures, and with rounds a speedup that is no ratio of the medians beside it."""
    rounds, refill = meta.get("repeats", 1), bool(meta.get("refill"))
    over = ("the wall time of the run, the refills' prompt passes included" if refill else
            "prefill and decode time summed over the run's batches")
    median = f"; the median over the {rounds} rounds (_min/_max: their range)" if rounds > 1 \
        else ""
    out = {
        "tokens_per_s": f"new tokens of every row (padding rows included) over {over}{median}",
        "decode_tokens_per_s": "null: refilled rows have one wall rate" if refill else
        "new tokens less each row's first (the prefill's) over decode time alone" + median,
        "mean_accept_length": "tokens a cycle makes, the target's own included (1 to steps "
                              "+ 1), pooled over every row-cycle of the run (padding rows "
                              "included): each prompt weighted by its cycles, not a mean of "
                              "per-prompt figures" + _accept_rounds(meta, rounds),
    }
    for key, rate, base in (("speedup", "tokens_per_s", "baseline_tokens_per_s"),
                            ("decode_speedup", "decode_tokens_per_s",
                             "the baseline row's decode_tokens_per_s")):
        out[key] = (f"the median over the rounds of each round's {rate} over the baseline's in "
                    f"that round: not {rate} / {base}" if rounds > 1 else
                    f"{rate} / {base} of the same suite and batch")
    if refill:
        out["decode_speedup"] = out["decode_tokens_per_s"]
    return out


def _accept_rounds(meta: dict[str, Any], rounds: int) -> str:
    if rounds == 1:
        return ""
    if (meta.get("params") or {}).get("temperature"):
        return f"; pooled over the {rounds} rounds"
    return "; round 1's (greedy rounds make the same tokens)"


def category_definition(meta: dict[str, Any]) -> str:
    """What a row's `by_category` holds: batch 1's figures per record category."""
    rounds = meta.get("repeats", 1)
    pooled = (f"; with {rounds} rounds, rates pooled: tokens and decode seconds summed over "
              f"every round (not a median), acceptance as the row's"
              f"{_accept_rounds(meta, rounds)}" if rounds > 1 else "")
    return ("batch 1 only (a batch of several rows mixes categories): per record category "
            "(null: prompts of none), its prompts, new_tokens, the baseline's and the setting's "
            "decode_tokens_per_s (new tokens less each prompt's first over decode seconds, "
            "summed over the category's prompts), decode_speedup their ratio, and "
            "mean_accept_length pooled over the category's cycles (accept_hist, cycles)"
            + pooled)


def category_table(report: dict[str, Any]) -> Table | None:
    """Batch 1's figures per prompt category, each setting's; None where no row has them."""
    rows = [r for r in report["results"] if r.get("by_category")]
    if not rows:
        return None
    rounds = (report.get("meta") or {}).get("repeats", 1)
    t = Table(title="by category · batch 1 · decode rates"
              + (f" pooled over {rounds} rounds" if rounds > 1 else ""))
    for col in ("suite", "setting", "category", "prompts", "base decode tok/s",
                "decode tok/s", "decode speedup", "accept len"):
        t.add_column(col, justify="left" if col in ("suite", "setting", "category") else "right")
    for r in rows:
        for c in r["by_category"]:
            t.add_row(escape(r["suite"]), r["setting"],
                      escape(c["category"]) if c["category"] is not None else "(none)",
                      str(c["prompts"]), figure(c["baseline_decode_tokens_per_s"], ".1f"),
                      figure(c["decode_tokens_per_s"], ".1f"),
                      figure(c["decode_speedup"], ".2f", "x"),
                      figure(c["mean_accept_length"], ".2f"))
    return t


# what rounds add to a setting's headline (`--repeats` above 1)
SPREAD = ("tokens_per_s_min", "tokens_per_s_max", "speedup_min", "speedup_max", "within_noise")


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
    """Through a temporary name: a write that fails leaves an earlier bench.json whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(strict(report), indent=1, allow_nan=False) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
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
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in report["results"] if r["setting"] != "baseline"]
    fig, ax = plt.subplots(2, 2, figsize=(14, 9))
    groups = sorted({(r["suite"], r["batch"]) for r in rows})
    names = list(dict.fromkeys(r["setting"] for r in rows))
    width = 0.8 / max(1, len(groups))
    for gi, (suite, b) in enumerate(groups):
        found = [next((r for r in rows if (r["suite"], r["batch"], r["setting"])
                       == (suite, b, n)), {}) for n in names]
        ys = gaps([r.get("speedup") for r in found])
        bars = _error_bars(found, ys)
        ax[0, 0].bar([i + gi * width for i in range(len(names))], ys, width,
                     label=f"{suite} b{b}", **({"yerr": bars, "capsize": 3} if bars else {}))
    ax[0, 0].axhline(1.0, color="k", lw=0.8)
    ax[0, 0].set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=45,
                        ha="right")
    ax[0, 0].set_ylabel("speedup over baseline")
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
        a.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # no 1.5 tokens
    for a in (ax[0, 0], ax[0, 1], ax[1, 0]):  # an interrupted run may have no setting timed
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    _phases(ax[1, 1], rows)
    # a plot shared alone says what was run, and a busy machine, too
    title = run_title(report["meta"])
    if note := busy_note(report["meta"].get("machine_load")):
        fig.suptitle(f"{title}\n{note}", color="tab:red")
    else:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # a ctrl-C or full disk leaves no half a plot
    try:
        with tmp.open("wb") as f:
            fig.savefig(f, dpi=110, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _error_bars(rows: list[dict[str, Any]], ys: list[float]) -> list[list[float]] | None:
    """Each speedup's min-max range as bars below and above it (rounds only; nan: none)."""
    if not any("speedup_min" in r for r in rows):
        return None
    lo, hi = gaps([r.get("speedup_min") for r in rows]), gaps([r.get("speedup_max") for r in rows])
    return [[y - a for y, a in zip(ys, lo, strict=True)],
            [b - y for y, b in zip(ys, hi, strict=True)]]


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
