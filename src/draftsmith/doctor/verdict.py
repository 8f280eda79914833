"""The wiring verdict: what the data holds, what each engine will feed, and what to write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.doctor import engines as eng
from draftsmith.doctor.artifacts import IDS, DrafterInfo
from draftsmith.doctor.report import Finding
from draftsmith.doctor.wiring import MARGIN, TOL, MatchMatrix
from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS, Convention, engine_limits, to_convention

DATA = "the data holds"  # what a drafter's ids are checked against, with --data


def data_findings(mm: MatchMatrix, data: Path) -> list[Finding]:
    where = str(data / "manifest.json")
    out = _nonfinite(mm, where) + _shift_finding(mm, data) + _paired_finding(mm, data)
    unread = {s.slot for s in mm.slots if s.status == "nonfinite"}  # said above
    out += [f for s in mm.slots[:-1] if s.slot not in unread
            and (f := _slot_finding(mm, s, where))]
    hidden = mm.slots[-1]
    if hidden.slot not in unread and (f := _hidden_finding(mm, hidden, where)):
        out.append(f)
    true = mm.true_ids()
    listed = _listed_ids(data)
    if None in true:
        return out
    if not isinstance(listed, list) or len(listed) != len(true):
        out.append(Finding(
            "error", "wiring", f"the manifest lists aux_layer_ids {listed} but the shards "
            f"hold {len(true)} aux slots, of layers {true} ({CANONICAL_WORDS})",
            where, _relabel_fix(true)))
    elif true != listed:
        out.append(Finding(
            "error", "wiring", f"the manifest says aux layers {listed} but the data holds "
            f"{true} ({CANONICAL_WORDS})", where, _relabel_fix(true)))
    return out


def _shift_finding(mm: MatchMatrix, data: Path) -> list[Finding]:
    """The one cause of every slot matching nothing where the ids sit tokens off the states
    (what follows is said of the realigned data)."""
    if not mm.token_shift:
        return []
    k = abs(mm.token_shift)
    tokens = "one token" if k == 1 else f"{k} tokens"
    if mm.token_shift > 0:
        way, plus, fix = "behind", f"+ {k}", f"input_ids[{k}:] beside the states [:-{k}]"
    else:
        way, plus = "ahead of", f"- {k}"
        dropped = (f"token {mm.dropped[0]}" if k == 1 else
                   f"tokens {list(mm.dropped)}")
        fix = f"the dropped first {dropped} prepended to input_ids[:-{k}]"
    return [Finding(
        "error", "wiring", f"the shards' input_ids run {tokens} {way} their hidden states: "
        f"every stored state matches the live one of the token at input_ids[t {plus}], none "
        f"that of input_ids[t]; trained on as stored, the drafter learns the wrong token's states",
        str(data), "recapture (`draftsmith data capture` stores them aligned), or realign each "
        f"sample: {fix}")]


def _paired_finding(mm: MatchMatrix, data: Path) -> list[Finding]:
    """States stored beside another sample's tokens (what follows is said of the re-paired
    samples)."""
    if not mm.paired:
        return []
    (i, j), *rest = mm.paired.items()
    pairs = "".join([f"sample {i}'s stored states are those of sample {j}'s input_ids"]
                    + [f", sample {a}'s those of sample {b}'s" for a, b in rest])
    return [Finding(
        "error", "wiring", f"the shards pair tokens with another conversation's hidden states: "
        f"{pairs}, not of their own (sample ids shuffled between tokens and states); trained on "
        "as stored, the drafter learns states of text it never sees", str(data),
        "recapture (`draftsmith data capture` stores each sample's tokens and states together), "
        "or re-pair each sample's states with its own input_ids")]


def _listed_ids(data: Path) -> Any:
    """The manifest's own aux_layer_ids, as written (None where absent or unreadable)."""
    try:
        return json.loads((data / "manifest.json").read_text()).get("aux_layer_ids")
    except (OSError, ValueError, AttributeError):
        return None


def _relabel_fix(true: list[int]) -> str:
    if len(set(true)) < len(true):
        return (f"recapture with distinct ascending --aux-layers: the data holds {true}, a "
                "layer in two slots")
    if true != sorted(true):  # `train` takes any order, `export` refuses it
        ids = sorted(true)
        return (f"recapture with ascending ids (`draftsmith data capture --aux-layers "
                f"{','.join(map(str, ids))}`), or reorder the stored aux slots to {ids} and set "
                f"aux_layer_ids to that; `draftsmith export` refuses a drafter trained on {true}")
    return (f"set aux_layer_ids in manifest.json to {true}; a drafter trained on this data was "
            f"trained on {true}")


def _hidden_finding(mm: MatchMatrix, s: Any, where: str) -> Finding | None:
    best = mm.rows[s.best_row]
    wrong = "the training targets lm_head(hidden) are wrong"
    if s.status in ("none", "ambiguous"):
        return Finding("error", "wiring", f"the stored final hidden matches no live state "
                       f"clearly (nearest: {best}, median relative error {s.rel:.3g}, runner-up "
                       f"{s.runner_up_rel:.3g})", where, "the data was not captured from this "
                       f"target, or not after its final norm: check --target, recapture ({wrong})")
    best_id = mm.row_ids[s.best_row]
    if s.matched and best_id is not None and best_id == max(i for i in mm.row_ids
                                                            if i is not None):
        return Finding("error", "wiring", f"the stored final hidden is the last layer's output "
                       f"before the final norm ({best}, median relative error {s.rel:.3g}), not "
                       "the hidden after it", where, "apply the target's final norm to the "
                       f"stored hidden, or recapture: as stored, {wrong}")
    if not s.matched or best_id is not None:
        return Finding("error", "wiring", f"the stored final hidden best matches {best} (median "
                       f"relative error {s.rel:.3g}, status {s.status}), not the live hidden after"
                       " the final norm", where, f"recapture: {wrong}")
    if s.status == "approximate":
        return Finding("warning", "wiring", f"the stored final hidden matches the live one "
                       f"only approximately (relative error {s.rel:.3g})", where,
                       "expected when the data was captured in bf16; else recapture")
    return None


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
    if s.status == "normed":
        return _normed_finding(mm, s, where)
    if s.status == "ambiguous":
        if (near := _nearest_alike(mm, s)) is not None:
            return Finding("error", "wiring", f"{s.slot} matches canonical layers {alike} alike "
                           f"(relative errors within {MARGIN:g}x of the best, {s.rel:.3g}: they "
                           f"cannot be told apart at this capture's precision), and "
                           f"{_manifest_words(s.claimed)} none of them", where,
                           _alike_fix(mm, s.slot, near))
        return Finding("error", "wiring", f"{s.slot} matches canonical layers {alike} alike "
                       f"(relative errors within {MARGIN:g}x of the best, {s.rel:.3g}) and none "
                       f"clearly (manifest: {s.claimed})", where, "check --target; if the data "
                       "is from it, recompare with more --samples or --all-tokens")
    if s.status == "none":
        if (row := _direction(mm, s)) is not None:  # a norm's output, by another norm's weights
            return _normed_copy(mm, s, row, where)
        return Finding("error", "wiring", f"{s.slot} matches no live layer clearly (nearest "
                       f"{best}, relative error {s.rel:.3g}, runner-up {s.runner_up_rel:.3g})",
                       where, "the data was not captured from this target, or not from the "
                       "residual stream: check --target, recapture")
    if s.status == "tied":
        return Finding("info", "wiring", f"{s.slot} matches canonical layers {alike} alike "
                       f"(relative errors within {MARGIN:g}x of the best, {s.rel:.3g}): they "
                       f"cannot be told apart at this capture's precision; the manifest's "
                       f"{s.claimed} is one of them", where, "nothing to fix")
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


COS_NEAR = 0.9  # a slot this aligned with one residual row, clearly more than with any other


def _direction(mm: MatchMatrix, s: Any) -> int | None:
    """The residual row a slot matching none by scale clearly points along (None: none)."""
    col = mm.cols.index(s.slot)
    rows = [r for r, k in enumerate(mm.row_kinds) if k == "residual"]
    cos = sorted(((float(mm.cos[r, col].nan_to_num(-1.0)), r) for r in rows), reverse=True)
    if len(cos) < 2 or not cos[0][0] >= COS_NEAR:
        return None
    (best, row), (second, _) = cos[0], cos[1]
    # at the stream's own scale a cosine of 0.9 is a relative error of at most 0.45: past 0.5
    # the scale differs (a norm's output), not the values (another target's, a fine-tune's)
    scaled = float(mm.rel[row, col]) > 0.5
    return row if scaled and 1 - second >= MARGIN * (1 - best) else None


def _normed_copy(mm: MatchMatrix, s: Any, row: int, where: str) -> Finding:
    cos = float(mm.cos[row, mm.cols.index(s.slot)])
    name = mm.rows[row] if mm.row_ids[row] == -1 else f"{mm.rows[row]}'s output"
    return Finding("error", "wiring", f"{s.slot} matches no live layer's scale (nearest "
                   f"{mm.rows[s.best_row]}, relative error {s.rel:.3g}) but follows {name} in "
                   f"direction (mean cosine {cos:.3f}): a normed copy of it, a norm's output "
                   "rather than the stream", where, f"recapture storing the stream before any "
                   f"norm, {name} (canonical {mm.row_ids[row]})")


def _nearest_alike(mm: MatchMatrix, s: Any) -> int | None:
    """The layer nearest the manifest's id among those `s` matches alike, each a clear match
    on its own (`TOL`); None where they are not all that close (a truly ambiguous slot)."""
    col = mm.cols.index(s.slot)
    ids = [mm.row_ids[i] for i in s.tied]
    if s.status != "ambiguous" or None in ids or any(float(mm.rel[i, col]) > TOL for i in s.tied):
        return None
    anchor = s.claimed if s.claimed is not None else mm.row_ids[s.best_row]
    return min(ids, key=lambda i: (abs(i - anchor), i))


def _manifest_words(claimed: int | None) -> str:
    return "the manifest names" if claimed is None else f"the manifest's {claimed} is"


def _alike_fix(mm: MatchMatrix, slot: str, near: int) -> str:
    ids = [mm.row_ids[x.best_row] if x.matched else _nearest_alike(mm, x)
           for x in mm.slots[:-1]]
    if None in ids:
        return f"set {slot}'s entry of aux_layer_ids in manifest.json to {near}, the nearest"
    return (f"set aux_layer_ids in manifest.json to {ids} ({slot}: {near}, the nearest of the "
            "layers it matches)")


def _normed_finding(mm: MatchMatrix, s: Any, where: str) -> Finding:
    post, j = divmod(s.normed, len(mm.normed_rows) // 2)
    state = j if post else j - 1  # the stream the norm read, canonical (post: j's after attention)
    name = "the embedding output" if state == -1 else f"layer {state}'s output"
    what = (f"layer {j}'s post-attention norm output (what its MLP reads)" if post else
            f"layer {j}'s input norm output (what its attention reads: {name}, normed)")
    return Finding("error", "wiring", f"{s.slot} holds {what}, not a residual stream (relative "
                   f"error {s.rel:.3g}; manifest: {s.claimed})", where,
                   f"recapture storing the stream before the norm, e.g. {name} (canonical "
                   f"{state}); a drafter trained on this data learnt from states no engine "
                   "feeds it")


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
    if info.layout == "speculators":
        return _speculators_feed(info, engine, num_layers)
    written, key, note = info.written(engine)
    nested, nested_key, _ = info.written("sglang")
    if engine == "vllm" and written is None and nested:
        return eng.vllm_fallback(nested, num_layers,
                                 f"{nested_key} (vLLM's fallback: no top-level ids)")
    return eng.feed_from_written(written, engine, num_layers, key, note)


def _speculators_feed(info: DrafterInfo, engine: str, num_layers: int) -> eng.Feed:
    """vLLM's reading of a speculators folder, at the key path it finds the ids (inside
    transformer_layer_config's eagle_config only from its fallback on); SGLang loads none."""
    if engine.startswith("sglang"):
        return eng.Feed(engine, eng.KEY[engine], None, None,
                        "SGLang does not load the speculators layout: export the drafter with "
                        "`draftsmith export --format sglang` to serve it there")
    written, key, note = info.written(engine)
    if written is not None and ".eagle_config." in key:
        feed = eng.vllm_fallback(written, num_layers, key)
    else:
        feed = eng.feed_from_written(written, engine, num_layers, key, note)
    if written is not None and note:
        feed.note = "; ".join(filter(None, [note, feed.note]))
    return feed


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
                     num_layers: int, basis: str = DATA) -> list[Finding]:
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


def other_training_data(info: DrafterInfo, data: Path, true_ids: list[int]) -> Finding | None:
    """A draftsmith drafter whose config holds the layers of the data it records training on,
    in another folder, against data of other layers: the pair is wrong, not the config."""
    trained = (info.meta.get("data") or {}) if info.layout == "draftsmith" else {}
    folder, ids = trained.get("folder"), trained.get("aux_layer_ids")
    if (not folder or ids is None or list(ids) != info.canonical_ids() or ids == true_ids
            or Path(folder).resolve() == data.resolve()):
        return None
    return Finding("error", "wiring", f"the drafter was trained on {folder}, of canonical layers "
                   f"{list(ids)} as its config says, not on this data, which holds {true_ids}",
                   _where(info), f"check the pair: pass --data {folder}, or retrain on this data")


def _where(info: DrafterInfo) -> str:
    return str(info.folder / "draftsmith.json")


def _export_note(true_ids: list[int] | None, engine: str, num_layers: int) -> str:
    if true_ids is None:
        return ""
    written, words = eng.what_to_write(list(true_ids), engine, num_layers)
    if written is None:
        return f"; but {words}"
    return f"; `draftsmith export` then writes for {engine}: {words.removeprefix('write ')}"


def _feed_findings(true_ids: list[int] | None, feed: eng.Feed, info: DrafterInfo,
                   num_layers: int, basis: str = DATA) -> list[Finding]:
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
        if feed.version_dependent:  # vLLM's eagle_config fallback, the one such reading
            out.append(Finding("warning", "wiring", f"{feed.engine}: {feed.note}", where,
                               f"write the top-level {IDS} (vLLM's key, input of layer j), "
                               "which every vLLM version reads; run with --data to learn the "
                               "layers the drafter was trained on"))
        return out
    if (basis == DATA and len(feed.canonical) != len(true_ids)
            and info.fc_inputs() not in (None, len(true_ids))):
        return out  # the sizes check names the count: no ids written make fc read the data's
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
    """The same canonical ids in every convention (None where inexpressible, and for SGLang
    where its capture hook cannot take one: the embedding, the last layer's output)."""
    out: dict[str, Any] = {}
    for conv in Convention:
        if conv is Convention.SGLANG_LEGACY:  # a recorded name of SGLang's one reading
            continue
        try:
            out[conv.value] = to_convention(ids, conv, num_layers)
        except DraftsmithError:  # inexpressible in that convention
            out[conv.value] = None
    if engine_limits(ids, num_layers):
        out[Convention.SGLANG.value] = None
    out[HF_INDEX] = hf_indices(ids, num_layers)
    return out


VLLM_READ = (Convention.VLLM.value, Convention.SPECULATORS.value)


def convention_words(conv: dict[str, Any], ids: list[int], num_layers: int) -> str:
    """`conventions` as one line of "name ids" (not draftsmith's own), each missing or edge
    entry saying why."""
    return ", ".join(f"{k} {_written(k, v, ids, num_layers)}" for k, v in conv.items()
                     if k != Convention.CANONICAL.value)


def _written(name: str, written: list[int] | None, ids: list[int], num_layers: int) -> str:
    if name == Convention.SGLANG.value and written is None:
        return f"cannot capture ({'; '.join(engine_limits(ids, num_layers))})"
    if name == HF_INDEX and written is None:
        last = num_layers - 1
        return (f"none (layer {last}'s output: hidden_states[{num_layers}] is after the final "
                "norm)")
    if written is None:
        return "none"
    edges = [v for v in written if v in (0, num_layers)] if name in VLLM_READ else []
    if edges:  # `export.speculators.vllm_edge_notes`: older vLLM model files capture neither
        return f"{written} ({', '.join(map(str, edges))}: newer vLLM model files only)"
    return str(written)


HF_INDEX = "hf_hidden_states"  # transformers' output_hidden_states tuple, by index


def hf_indices(ids: list[int], num_layers: int) -> list[int] | None:
    """Canonical ids as indices of transformers' hidden_states (j + 1; 0 the embedding), None
    where one is the last layer's output: hidden_states[L] is after the final norm."""
    if any(i >= num_layers - 1 for i in ids):
        return None
    return [i + 1 for i in ids]
