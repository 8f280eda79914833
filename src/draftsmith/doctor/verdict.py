"""The wiring verdict: what the data holds, what each engine will feed, and what to write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.doctor import engines as eng
from draftsmith.doctor.artifacts import DrafterInfo
from draftsmith.doctor.report import Finding
from draftsmith.doctor.wiring import MARGIN, MatchMatrix
from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS, Convention, engine_limits, to_convention


def data_findings(mm: MatchMatrix, data: Path) -> list[Finding]:
    where = str(data / "manifest.json")
    out = _nonfinite(mm, where)
    unread = {s.slot for s in mm.slots if s.status == "nonfinite"}  # said above
    out += [f for s in mm.slots[:-1] if s.slot not in unread
            and (f := _slot_finding(mm, s, where))]
    hidden = mm.slots[-1]
    best = mm.rows[hidden.best_row]
    if hidden.slot not in unread and (not hidden.matched
                                      or mm.row_ids[hidden.best_row] is not None):
        out.append(Finding(
            "error", "wiring", f"the stored final hidden best matches {best} (median relative "
            f"error {hidden.rel:.3g}, status {hidden.status}), not the live hidden after the final"
            " norm", where, "recapture: the training targets lm_head(hidden) are wrong"))
    elif hidden.status == "approximate":
        out.append(Finding("warning", "wiring", f"the stored final hidden matches the live one "
                           f"only approximately (relative error {hidden.rel:.3g})", where,
                           "expected when the data was captured in bf16; else recapture"))
    true = mm.true_ids()
    claimed = [s.claimed for s in mm.slots[:-1]]
    if None not in true and true != claimed:
        out.append(Finding(
            "error", "wiring", f"the manifest says aux layers {claimed} but the data holds "
            f"{true} ({CANONICAL_WORDS})", where,
            f"set aux_layer_ids in manifest.json to {true}; a drafter trained on this data was "
            f"trained on {true}"))
    return out


def _nonfinite(mm: MatchMatrix, where: str) -> list[Finding]:
    out = []
    for s, n in zip(mm.slots, mm.nonfinite, strict=False):
        if n:
            out.append(Finding(
                "error", "wiring", f"{_named(s.slot)} holds NaN/inf at {n} of "
                f"{mm.sample_tokens} tokens of samples {mm.samples}; training on them gives NaN "
                "losses", where,
                "recapture with --dtype bfloat16 or float32 (float16 overflows on many targets)"))
    return out


def _named(slot: str) -> str:
    return "the stored final hidden" if slot == "hidden" else slot


def _slot_finding(mm: MatchMatrix, s: Any, where: str) -> Finding | None:
    best = mm.rows[s.best_row]
    alike = [mm.row_ids[i] for i in s.tied]
    if s.status == "ambiguous":
        return Finding("error", "wiring", f"{s.slot} matches canonical layers {alike} alike "
                       f"(relative errors within {MARGIN:g}x of the best, {s.rel:.3g}) and none "
                       f"clearly (manifest: {s.claimed})", where, "check --target; if the data "
                       "is from it, recompare with more --samples or --all-tokens")
    if s.status == "none":
        return Finding("error", "wiring", f"{s.slot} matches no live layer clearly (nearest "
                       f"{best}, relative error {s.rel:.3g}, runner-up {s.runner_up_rel:.3g})",
                       where, "the data was not captured from this target, or not from the "
                       "residual stream: check --target, recapture")
    if s.status == "tied":
        return Finding("info", "wiring", f"{s.slot} matches canonical layers {alike} alike "
                       f"(their states are near-identical on these tokens): the manifest's "
                       f"{s.claimed} is one of them, and feeding any of them feeds the same "
                       "states", where, "nothing to fix")
    if s.residual_row is not None:
        return _part_finding(mm, s, where)
    if mm.row_kinds[s.best_row] == "final norm":
        return Finding("error", "wiring", f"{s.slot} holds the final normed hidden (as HF's "
                       "hidden_states[-1]), not a residual stream", where,
                       "recapture at a decoder layer's output")
    if s.status == "approximate":
        return Finding("warning", "wiring", f"{s.slot} matches {best} only approximately "
                       f"(relative error {s.rel:.3g}, runner-up {s.runner_up_rel:.3g})", where,
                       "expected for bf16 captures of deep targets; else check the target")
    return None


def _part_finding(mm: MatchMatrix, s: Any, where: str) -> Finding:
    j = mm.row_layers[s.best_row]
    what = ("stream after attention, before its MLP (SGLang's `residual` alone)"
            if s.status == "mid-layer" else "MLP output alone (SGLang's `hidden_states` alone)")
    return Finding("error", "wiring", f"{s.slot} holds layer {j}'s {what}, not a residual "
                   f"stream (relative error {s.rel:.3g}; next best {mm.rows[s.residual_row]}, "
                   f"{s.runner_up_rel:.3g}; manifest: {s.claimed})",
                   where, f"recapture storing hidden_states + residual, layer {j}'s output "
                   f"(canonical {j}); a drafter trained on this data learnt from states no "
                   "engine feeds it")


def engine_rows(true_ids: list[int] | None, info: DrafterInfo | None,
                num_layers: int) -> list[dict[str, Any]]:
    """Per engine: the ids to write for the true layers, and what the drafter's config feeds."""
    rows = []
    for name in eng.ENGINES:
        row: dict[str, Any] = {"engine": name, "key": eng.KEY[name]}
        if true_ids is not None:
            row["write"], row["how"] = eng.what_to_write(true_ids, name, num_layers)
        if info is not None:
            row["feed"] = drafter_feed(info, name, num_layers).to_dict()
        rows.append(row)
    return rows


def drafter_feed(info: DrafterInfo, engine: str, num_layers: int) -> eng.Feed:
    if info.layout == "draftsmith":
        ids = info.canonical_ids()
        if engine == "draftsmith" or not ids:
            return eng.feed_from_written(ids or None, "draftsmith", num_layers)
        return eng.feed_from_canonical(ids, engine, num_layers)
    if engine == "draftsmith":  # draftsmith serves its own layout: what `import` reads
        return eng.feed_from_import(info.config, info.layout, num_layers, "config.json")
    written, key, note = info.written(engine)
    nested, nested_key, _ = info.written("sglang")
    if engine == "vllm" and written is None and nested:
        return eng.vllm_fallback(nested, num_layers,
                                 f"{nested_key} (vLLM's fallback: no top-level ids)")
    return eng.feed_from_written(written, engine, num_layers, key, note)


def default_engines(info: DrafterInfo | None, engine: str | None) -> list[str]:
    if engine:
        return [engine]
    if info is None or info.layout == "draftsmith":
        return ["draftsmith"]
    if info.layout == "speculators":
        return ["vllm"]
    # vLLM loads this layout too, and a top-level key is written for it alone
    return ["sglang", "vllm"] if info.written("vllm")[0] is not None else ["sglang"]


def drafter_findings(true_ids: list[int] | None, info: DrafterInfo, engines: list[str],
                     num_layers: int, basis: str = "the data holds") -> list[Finding]:
    """A draftsmith config is checked first; when it is wrong, each engine's reading of the
    wrong ids is moot and the fix names what export will write for the right ones. `basis`
    says where `true_ids` come from."""
    out: list[Finding] = []
    others = [e for e in engines if e != "draftsmith" or info.layout != "draftsmith"]
    if info.layout == "draftsmith":
        base = _feed_findings(true_ids, drafter_feed(info, "draftsmith", num_layers), info,
                              num_layers)
        if any(f.severity == "error" for f in base):
            for f in base:
                f.fix += "".join(_export_note(true_ids, e, num_layers) for e in others)
            return base
        out += base
    for name in others:
        if name.startswith("sglang") and info.layout == "speculators":
            out.append(Finding("error", "wiring", "SGLang does not load the speculators layout",
                               str(info.folder), "export the drafter with `draftsmith export "
                               "--format sglang`, or serve this folder with vLLM"))
            continue
        out += _feed_findings(true_ids, drafter_feed(info, name, num_layers), info, num_layers,
                              basis)
    return out


def _export_note(true_ids: list[int] | None, engine: str, num_layers: int) -> str:
    if true_ids is None:
        return ""
    written, words = eng.what_to_write(list(true_ids), engine, num_layers)
    if written is None:
        return f"; but {words}"
    if engine == "sglang-legacy":  # export writes current SGLang's ids: the words say both
        return f"; for {engine}: {words.removeprefix('write ')}"
    return f"; `draftsmith export` then writes for {engine}: {words.removeprefix('write ')}"


def _feed_findings(true_ids: list[int] | None, feed: eng.Feed, info: DrafterInfo,
                   num_layers: int, basis: str = "the data holds") -> list[Finding]:
    where = f"{info.folder}: {feed.key}"
    out = []
    fix_as = feed.engine
    if feed.engine == "draftsmith" and info.layout != "draftsmith":  # fixed where `import` reads
        fix_as = "sglang" if info.layout == "sglang" else "vllm"
    if feed.canonical is None:
        return [Finding("error", "wiring", f"{feed.engine}: {feed.note}", where,
                        _fix(true_ids, fix_as, num_layers))]
    if feed.engine.startswith("sglang") and (limits := engine_limits(feed.canonical,
                                                                    num_layers)):
        out.append(Finding("error", "wiring", f"{feed.engine} cannot feed canonical layers "
                           f"{feed.canonical}: {'; '.join(limits)}", where,
                           "serve it with vLLM (`draftsmith export --format speculators`), or "
                           "retrain on layers SGLang captures"))
    if feed.written is None and feed.note:
        sev = "warning" if true_ids is None else "info"
        # defaults that repeat a layer are no ids to write: the trained ones are
        basis_ids = true_ids or (feed.canonical if len(set(feed.canonical)) ==
                                 len(feed.canonical) else None)
        out.append(Finding(sev, "wiring", f"{feed.engine}: {feed.note} (it feeds canonical "
                           f"{feed.canonical})", where, _fix(basis_ids, fix_as, num_layers)))
    if true_ids is None:
        if feed.version_dependent:
            out.append(Finding("warning", "wiring", f"{feed.engine}: {feed.note}", where,
                               "export ids that start at 1, or pin the SGLang version"))
        return out
    if feed.canonical != list(true_ids):
        what = (f"{feed.engine} will feed the drafter canonical layers {feed.canonical} but "
                f"{basis} {list(true_ids)} ({CANONICAL_WORDS})")
        if feed.version_dependent:
            what += f"; {feed.note}"
        out.append(Finding("error", "wiring", what, where, _fix(true_ids, fix_as,
                                                               num_layers)))
    elif feed.version_dependent:
        out.append(Finding("warning", "wiring", f"{feed.engine}: {feed.note}", where,
                           _fix(true_ids, fix_as, num_layers)))
    return out


def _fix(true_ids: list[int] | None, engine: str, num_layers: int) -> str:
    if true_ids is None:
        return "run with --data to learn which layers the drafter was trained on"
    _, words = eng.what_to_write(list(true_ids), engine, num_layers)
    return words


def conventions(ids: list[int], num_layers: int) -> dict[str, Any]:
    """The same canonical ids in every convention (None where inexpressible)."""
    out: dict[str, Any] = {}
    for conv in Convention:
        try:
            out[conv.value] = to_convention(ids, conv, num_layers)
        except DraftsmithError:  # inexpressible in that convention
            out[conv.value] = None
    return out
