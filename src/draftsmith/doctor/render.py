"""The doctor's report as rich tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from draftsmith.doctor.behaviour import promise_words, promised_length
from draftsmith.doctor.report import Finding, Report
from draftsmith.doctor.verdict import convention_words
from draftsmith.measured import figure

STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def show(rep: Report, console: Console | None = None) -> None:
    con = console or Console()
    _context(con, rep.context)
    if rep.wiring:
        con.print(matrix_table(rep.wiring))
        _verdict(con, rep)
    if rep.engines:
        con.print(engines_table(rep.engines))
    if rep.behaviour:
        con.print(behaviour_table(rep.behaviour))
    if rep.findings:
        con.print(findings_table(rep))
    for s in rep.skipped:
        con.print(f"[dim]skipped {escape(s)}[/dim]")
    n_err, n_warn = len(rep.errors()), sum(f.severity == "warning" for f in rep.findings)
    if rep.ok and not n_warn:
        notes = len(rep.findings)  # info only, listed in the table above
        con.print(f"[bold green]OK[/bold green]: {len(rep.passed)} checks passed, "
                  + (f"{notes} note(s), no errors or warnings" if notes else "no findings"))
    else:
        style = "bold red" if n_err else "yellow"
        con.print(f"[{style}]{n_err} error(s), {n_warn} warning(s)[/{style}]; "
                  f"passed: {', '.join(rep.passed) or 'none'}")


def _context(con: Console, ctx: dict[str, Any]) -> None:
    t = ctx.get("target", {})
    # paths and names are text, not markup: exp[v2] would lose its "[v2]", a "[/x]" raise
    con.print(f"target: {t.get('source')} ({t.get('layers')} layers, hidden "
              f"{t.get('hidden_size')}, fingerprint {t.get('fingerprint')}; from {t.get('from')})",
              markup=False)
    for key in ("data", "drafter"):
        if key in ctx:
            con.print(f"{key}: " + ", ".join(f"{k} {v}" for k, v in ctx[key].items()),
                      markup=False)


def matrix_table(w: dict[str, Any]) -> Table:
    """Every residual row and the final norm; a layer's part rows only where a slot matches
    one (all are in the JSON)."""
    kinds = w.get("row_kinds") or ["residual"] * len(w["rows"])
    best = {(s["best"], i) for i, s in enumerate(w["slots"])}
    named = {s["best"] for s in w["slots"]}
    shown = [r for r, k in enumerate(kinds) if k in ("residual", "final norm")
             or w["rows"][r] in named]
    hidden = len(kinds) - sum(k in ("residual", "final norm") for k in kinds)
    tab = Table(title=f"stored vs live: median relative error / mean cosine over "
                f"{w['tokens']} {w['token_set']} tokens of samples {w['samples']}",
                caption=f"also compared: {hidden} layer parts (stream after attention, MLP "
                        "output alone), shown where a slot matches one" if hidden else None)
    tab.add_column("live (canonical id)")
    for col, s in zip(w["cols"], w["slots"], strict=True):
        claimed = "" if s["claimed"] is None else f" (manifest: {s['claimed']})"
        tab.add_column(col + claimed, justify="right")
    for r in shown:
        name, rid = w["rows"][r], w["row_ids"][r]
        label = name if rid is None else f"{name} ({rid})"
        cells = []
        for c in range(len(w["cols"])):
            cell = f"{figure(w['rel_err'][r][c], '.3g')} / {figure(w['cosine'][r][c], '.3f')}"
            cells.append(f"[bold green]{cell}[/bold green]" if (name, c) in best else cell)
        tab.add_row(label, *cells)
    return tab


def _verdict(con: Console, rep: Report) -> None:
    w = rep.wiring or {}
    true = w.get("true_ids")
    if true and None not in true:
        con.print(f"[bold]the data holds canonical layers {true}[/bold] ({w['convention']})")
        conv = rep.context.get("in_each_convention") or {}
        layers = (rep.context.get("target") or {}).get("layers")
        con.print("  as each convention writes them: " + convention_words(conv, true, layers),
                  markup=False)
    else:
        con.print("[bold red]some stored aux states match no layer's output clearly (see the "
                  "findings)[/bold red]")


def engines_table(rows: list[dict[str, Any]]) -> Table:
    """One row an engine: its name, then its key, what it writes for the data's layers, what
    the drafter's config feeds it and the note on labelled lines of one wide cell (five folded
    columns ran a row over ~14 lines at 80 columns)."""
    tab = Table(title="what each engine reads", show_lines=True)
    tab.add_column("engine", no_wrap=True)
    tab.add_column("key / write (for the data's layers) / the drafter's config feeds / note",
                   overflow="fold", ratio=1)
    for r in rows:
        feed = r.get("feed") or {}
        write = "" if "how" not in r else (str(r["write"]) if r["write"] is not None
                                           else "cannot")
        fed = "" if not feed else f"{feed.get('written')}{_read_at(feed, r['key'])} -> " \
            f"canonical {feed.get('canonical')}"
        note = "; ".join(filter(None, [feed.get("note", ""), r.get("how", "")
                                       if r.get("write") is None else ""]))
        tab.add_row(escape(r["engine"]), _labelled((("key", r["key"]), ("write", write),
                                                   ("feeds", fed), ("note", note))))
    return tab


def _read_at(feed: dict[str, Any], key: str) -> str:
    """Where the config's ids were read, where that is not the row's key (vLLM's fallback,
    ids inside a speculators folder's transformer_layer_config)."""
    at = feed.get("key")
    return f" at {at}" if at and feed.get("written") is not None and at != key else ""


def _labelled(parts: tuple[tuple[str, str], ...]) -> Text:
    """Labelled lines of plain text (paths and ids are no markup), the empty ones left out."""
    text = Text()
    for label, value in parts:
        if value:
            text.append(("\n" if text.plain else "") + f"{label}: ", style="bold")
            text.append(value)
    return text


def behaviour_table(b: dict[str, Any]) -> Table:
    runs = b["runs"]
    promise = b.get("promised") or {}
    tab = Table(title=f"speculative run ({b['prompts']} prompts): per-position acceptance",
                caption=_behaviour_caption(b))  # escaped: it names the log's path
    tab.add_column("draft position")
    tab.add_column("promised (train log)", justify="right")
    for label in runs:
        tab.add_column(f"{label} {runs[label]['aux_layer_ids']}", justify="right")
    n = max(len(r["position_rates"]) for r in runs.values())
    cond = promise.get("cond_acc") or []
    for i in range(n):
        cells = [figure(r["position_rates"][i], ".1%") if i < len(r["position_rates"]) else ""
                 for r in runs.values()]
        tab.add_row(str(i), figure(cond[i] if i < len(cond) else None, ".1%"), *cells)
    acc = promised_length(promise, n) if promise else None
    tab.add_row(f"accept length ({n} draft steps)", _promised_cell(acc, cond[:n]),
                *[figure(r["mean_accept_length"], ".2f") for r in runs.values()])
    tab.add_row("tokens/s", "", *[f"{r['tokens_per_s']:.1f}" for r in runs.values()])
    return tab


def _promised_cell(acc: float | None, cond: list[float | None]) -> str:
    """The promised accept length, naming the positions it counts where the log stopped
    measuring before the run's draft steps (the caption says why)."""
    from draftsmith.train.objective import cut_short, measured

    if acc is None or not cut_short(cond):
        return figure(acc, ".2f")
    return f"{acc:.2f} (positions 0..{measured(cond) - 1})"


def _behaviour_caption(b: dict[str, Any]) -> str | None:
    words = []
    if b.get("draft_steps_why"):
        words.append(f"{b['draft_steps']} draft steps: {b['draft_steps_why']}")
    if b.get("promised") and b.get("draft_steps"):
        words.append(f"promised: {promise_words(b['promised'], b['draft_steps'])}")
    return escape("; ".join(words)) or None


def findings_table(rep: Report) -> Table:
    """One row a finding: its severity and check in narrow columns, and what it found, where
    and the fix, each on its own line of one wide cell (five columns at 80 columns wrapped each
    finding over ~40 lines)."""
    tab = Table(title="findings", show_lines=True)
    tab.add_column("severity", no_wrap=True)
    tab.add_column("check", max_width=14, overflow="fold")
    tab.add_column("what / where / fix", overflow="fold", ratio=1)
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(rep.findings, key=lambda f: order[f.severity]):
        s = STYLE[f.severity]
        tab.add_row(f"[{s}]{f.severity}[/{s}]", escape(f.check), _finding_text(f))
    return tab


def _finding_text(f: Finding) -> Text:
    """What, where and fix as plain text (paths are no markup), labelled lines."""
    text = Text(f.what)
    for label, value in (("where", f.where), ("fix", f.fix)):
        if value:
            text.append(f"\n{label}: ", style="bold")
            text.append(value)
    return text
