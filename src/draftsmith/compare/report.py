"""The comparison as Markdown, a PNG of the acceptance curves, and rich tables."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from draftsmith.compare.paired import words
from draftsmith.compare.params import CONVENTIONS, HEADS, human
from draftsmith.layers import CANONICAL_WORDS
from draftsmith.measured import figure, gaps


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(map(_fmt, v)) if v and not isinstance(v[0], list) else str(v)
    return str(v)


def sections(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for every table of the report."""
    ds = res["drafters"]
    names = [d["label"] for d in ds]
    out = [("Architecture", ["", *names], _rows(ds, "architecture")),
           ("Aux layer ids", ["", *names], _ids(ds)),
           ("Parameters", ["convention", *names], _params(ds)),
           ("Training data", ["", *names], _data(ds))]
    if res.get("speed"):
        sp = res["speed"]
        busy = " · BUSY MACHINE (see the notes)" if machine_busy(sp) else ""
        on = f", target {res['context']['target']}" if res["context"].get("target") else ""
        out.append((f"Acceptance on the same prompts ({prompts_measured(sp)}, "
                    f"{setting(sp)}), {decoding(sp)}{on}{busy}", ["", *names],
                    _speed(sp, names)))
    return out


def _rows(ds: list[dict], key: str) -> list[list[str]]:
    keys = list(dict.fromkeys(k for d in ds for k in d[key]))
    return [[k, *[_fmt(d[key].get(k)) for d in ds]] for k in keys]


def _ids(ds: list[dict]) -> list[list[str]]:
    rows = [[f"canonical ({CANONICAL_WORDS})", *[_fmt(d["aux_ids_canonical"]) for d in ds]]]
    measured = [d.get("aux_ids_measured") for d in ds]
    if any(m is not None and m != d["aux_ids_canonical"] for m, d in zip(measured, ds,
                                                                        strict=True)):
        rows.append(["canonical, as compare measured (as `draftsmith import` reads it)",
                     *map(_fmt, measured)])
    keys = list(dict.fromkeys(k for d in ds for k in d["aux_ids_written"]))
    rows += [[f"as written: {k}", *[_fmt(d["aux_ids_written"].get(k)) for d in ds]] for k in keys]
    if any(d["aux_ids_note"] for d in ds):
        rows.append(["note", *[d["aux_ids_note"] or "" for d in ds]])
    return rows


def _params(ds: list[dict]) -> list[list[str]]:
    rows = [[f"{k}: {words}", *[f"{d['params'][k]:,} ({human(d['params'][k])})" for d in ds]]
            for k, words in CONVENTIONS.items()]
    rows.append(["embedding (frozen, the target's)",
                 *[f"{d['params']['embedding']:,}" + ("" if d["params"]["embedding_stored"]
                                                     else " (not stored)") for d in ds]])
    rows.append(["lm_head (as the engine serves it)", *[_head(d["params"]) for d in ds]])
    rows.append(["bytes on disk", *[f"{d['params']['bytes_on_disk']:,} "
                                    f"({d['params']['bytes_on_disk'] / 2**20:.1f} MiB)"
                                    for d in ds]])
    return rows


def _head(p: dict[str, Any]) -> str:
    words = HEADS.get(p.get("lm_head_source") or "stored", "")
    return f"{p['lm_head']:,}" + (f" ({words})" if words else "")


def _data(ds: list[dict]) -> list[list[str]]:
    keys = ["kind", "samples", "tokens", "dataset samples", "dataset tokens", "loss tokens",
            "input conversations", "regenerated", "sources", "folder", "note",
            "manifest_error"]
    rows = []
    for k in keys:
        vals = [(d["data"] or {}).get(k) for d in ds]
        if any(v is not None for v in vals):
            rows.append([k, *[_fmt(v) for v in vals]])
    tkeys = ["steps", "tokens", "last_accept_length", "last_cond_acc"]
    for k in tkeys:
        vals = [(d["training"] or {}).get(k) for d in ds]
        if any(v is not None for v in vals):
            cells = [_fmt(_round(v)) for v in vals]
            if k == "last_accept_length":
                cells = [c + _stops(d["training"]) for c, d in zip(cells, ds, strict=True)]
            rows.append([f"training {k}", *cells])
    return rows or [["(not recorded)", *["unknown" for _ in ds]]]


def _stops(training: dict[str, Any] | None) -> str:
    """Where the log's accept length stops: a position no chain reached (None) was not
    measured, so the figure counts the positions before it only."""
    cond = (training or {}).get("last_cond_acc")
    if not isinstance(cond, list) or (training or {}).get("last_accept_length") is None:
        return ""
    from draftsmith.train.objective import measured_words

    words = measured_words(cond)
    return f" ({words})" if words else ""


def _round(v: Any) -> Any:
    # a position a run never measured is None (null in the drafter's files): "-" in the table
    return [round(x, 3) if isinstance(x, float) else x for x in v] if isinstance(v, list) else v


def _speed(s: dict[str, Any], names: list[str]) -> list[list[str]]:
    runs = s["drafters"]
    n = max(len(runs[k]["position_rates"]) for k in names)
    rows = [[f"P(accept position {i} | reached)", *[
        figure(runs[k]["position_rates"][i] if i < len(runs[k]["position_rates"]) else None,
               ".1%")
        for k in names]] for i in range(n)]
    rows.append(["mean accept length (tokens/cycle)",
                 *[figure(runs[k]["mean_accept_length"], ".2f") for k in names]])
    rows += _paired(s, names)
    rows.append([f"accept rate (accept length / {s['steps'] + 1}, steps + 1; not per draft "
                 "token)", *[figure(runs[k].get("accept_rate"), ".3f") for k in names]])
    rows.append([timed_on(s), *[f"{runs[k]['tokens_per_s']:.1f}" for k in names]])
    rows += _paired(s, names, "paired_tokens_per_s", "tokens/s")
    rows.append([f"speedup vs the target alone ({s['baseline_tokens_per_s']:.1f} tok/s)",
                 *[f"{runs[k]['speedup']:.2f}x" if runs[k]["speedup"] else "-" for k in names]])
    return rows


def _paired(s: dict[str, Any], names: list[str], key: str = "paired",
            figure_name: str = "accept length") -> list[list[str]]:
    """Each drafter's figure (accept length, tokens/s) against the first's, prompt by prompt:
    the gap and whether the spread over prompts covers it."""
    fmt = ".1f" if key == "paired_tokens_per_s" else ".2f"  # as the pooled row shows it
    gaps = {p["drafter"]: words(p, fmt) for p in s.get(key) or []}
    if not gaps:
        return []
    return [[f"{figure_name} minus {names[0]}'s, paired over prompts",
             *[gaps.get(k, "(reference)") for k in names]]]


def timed_on(s: dict[str, Any]) -> str:
    """The tokens/s row's name: the device and dtype it was timed on (an older compare.json
    without them: as it was)."""
    on = [str(s[k]) for k in ("device", "dtype") if s.get(k)]
    if s.get("max_new_tokens"):
        on.append(f"at most {s['max_new_tokens']} new tokens a prompt")
    return f"tokens/s ({', '.join(on)})" if on else "tokens/s"


def decoding(s: dict[str, Any]) -> str:
    """How the tokens were chosen (compare decodes greedily)."""
    return s.get("decoding") or "greedy"


def machine_busy(s: dict[str, Any]) -> bool:
    """Whether the timed runs shared the machine with other work (`bench.load`)."""
    return bool((s.get("machine_load") or {}).get("busy"))


def prompts_measured(s: dict[str, Any]) -> str:
    """The prompts measured: "8 chat prompts", or a ctrl-C's "PARTIAL: 3 of 8 chat prompts"."""
    if part := s.get("partial"):
        return f"PARTIAL: {part['prompts_finished']} of {part['prompts']} {s['suite']} prompts"
    return f"{s['prompts']} {s['suite']} prompts"


def setting(s: dict[str, Any]) -> str:
    """The drafting the acceptance was measured under, as steps/topk/draft tokens."""
    topk = s.get("topk", 1)
    if topk == 1:
        return f"chain of {s['steps']} steps"
    return f"tree {s['steps']}/{topk}/{s['num_draft_tokens']}"


def markdown(res: dict[str, Any], png: str | None) -> str:
    names = " vs ".join(d["label"] for d in res["drafters"])
    lines = [f"# draftsmith compare: {names}", ""]
    lines += [f"- {k}: {v}" for k, v in res["context"].items() if v is not None]
    lines.append("")
    for title, header, rows in sections(res):
        lines += [f"## {title}", "", _table_row(header), "|" + "---|" * len(header)]
        lines += [_table_row(r) for r in rows]
        lines.append("")
        if title == "Parameters":
            lines += [f"- {x}" for x in res["claims"]] + [""]
        if title.startswith("Acceptance") and png:
            lines += [f"![per-position acceptance]({png})", ""]
    if res["notes"]:
        lines += ["## Differences", ""] + [f"- {n}" for n in res["notes"]] + [""]
    return "\n".join(lines)


def _table_row(cells: list[str]) -> str:
    """One Markdown table row, a `|` in a cell escaped: headers too (a folder `exp|v2`)."""
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["speed"]["drafters"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in runs.items():
        xs = list(range(len(r["position_rates"])))
        a.plot(xs, gaps(r["position_rates"]), marker="o", label=name)
        reach = [x / r["reached"][0] if r["reached"][0] else math.nan for x in r["accepted"]]
        b.plot(xs, reach, marker="o", label=f"{name} (accept length "
               f"{figure(r['mean_accept_length'], '.2f')})")
    a.set(xlabel="draft position", ylabel="P(accepted | reached)", ylim=(0, 1.02),
          title="per-position acceptance")
    b.set(xlabel="draft position", ylabel="P(accepted)", ylim=(0, 1.02),
          title="share of cycles accepting this far")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    sp = res["speed"]
    busy = "\nBUSY MACHINE while timing: tokens/s skewed (see compare.md)" \
        if machine_busy(sp) else ""
    target = (res.get("context") or {}).get("target")
    on = f", target {target}" if target else ""
    fig.suptitle(f"{prompts_measured(sp)}, {setting(sp)}, {decoding(sp)}{on}"
                 f"{busy}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
