"""One drafter folder described: architecture, aux ids (as written and canonical), parameter
counts by convention, and its training data where a manifest records it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.compare.params import ParamCounts, count
from draftsmith.doctor.artifacts import IDS, DrafterInfo, read_drafter
from draftsmith.doctor.engines import feed_from_written
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import NORM_FLAGS
from draftsmith.targets.hf import read_config

# draftsmith's config key -> an engine config's (speculators: in transformer_layer_config)
SIZES = {"hidden_size": "hidden_size", "vocab_size": "vocab_size",
         "num_heads": "num_attention_heads", "draft_vocab_size": "draft_vocab_size",
         "target_hidden_size": "target_hidden_size"}
OPTIONAL = ("draft_vocab_size", "target_hidden_size")
UNKNOWN_DEPTH = 10**6  # a target depth no id reaches: ids read without the range check


@dataclass
class Description:
    label: str
    info: DrafterInfo
    arch: dict[str, Any]
    ids_written: dict[str, list[int]]
    ids_canonical: list[int] | None
    ids_note: str
    params: ParamCounts
    data: dict[str, Any] | None
    training: dict[str, Any] | None
    ids_measured: list[int] | None = None  # canonical, as compare's own run read them
    load_notes: list[str] = field(default_factory=list)  # what loading it as `import` warned

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "folder": str(self.info.folder), "layout": self.info.layout,
                "architecture": self.arch, "aux_ids_written": self.ids_written,
                "aux_ids_canonical": self.ids_canonical, "aux_ids_note": self.ids_note,
                "aux_ids_measured": self.ids_measured,
                "params": self.params.to_dict(), "data": self.data, "training": self.training}


def describe(folder: str | Path | DrafterInfo, label: str,
             num_layers: int | None = None) -> Description:
    """The folder described; given as a `DrafterInfo`, one `read_drafter` read already."""
    info = folder if isinstance(folder, DrafterInfo) else read_drafter(folder)
    check_sizes(info)
    shapes = readable_shapes(info)
    if "fc.weight" not in shapes:
        raise DraftsmithError(f"{info.folder}: no fc.weight: not an EAGLE-3 drafter")
    layers = num_layers or target_layers(info)
    canonical, note = canonical_ids(info, layers)
    size = sum(f.stat().st_size for f in info.weight_files())
    params = count({k: s for k, (s, _) in shapes.items()}, info.vocab_size, info.hidden_size,
                   size, head_source(info, set(shapes)))
    dtype = shapes["fc.weight"][1]
    return Description(label, info, architecture(info, dtype), written_ids(info), canonical,
                       note, params, training_data(info), training_summary(info))


def head_source(info: DrafterInfo, names: set[str]) -> str:
    """Where the lm_head the engine serves comes from. SGLang's LlamaForCausalLMEagle3:
    tie_word_embeddings makes it the embedding module (a stored lm_head.weight is never read);
    untied without draft_vocab_size it loads the target's (`load_lm_head_from_target`). vLLM's
    Eagle3LlamaForCausalLM (speculators): a folder without lm_head weights has the target's
    shared (`has_own_lm_head` false, `_maybe_share_lm_head`), whose first draft_vocab_size
    logits it keeps: they fit only a draft vocabulary of target ids 0..N-1 (every d2t offset 0,
    as import reads it). The draftsmith layout stores its own."""
    if info.layout == "speculators" and not any(n.startswith("lm_head.") for n in names):
        fits = info.draft_vocab_size == info.vocab_size or _offsets_zero(info, names)
        return "shared" if fits else "shared_misfit"
    if info.layout != "sglang":
        return "stored"
    if info.config.get("tie_word_embeddings"):
        return "tied"
    return "target" if info.config.get("draft_vocab_size") is None else "stored"


def _offsets_zero(info: DrafterInfo, names: set[str]) -> bool:
    """Whether the folder's d2t maps draft id i to target id i (no d2t and a smaller draft
    vocabulary is refused elsewhere)."""
    d2t = info.tensor("d2t") if "d2t" in names else None
    return d2t is not None and not bool(d2t.ne(0).any())


def readable_shapes(info: DrafterInfo) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import SafetensorError

    try:
        return info.shapes()
    except (SafetensorError, OSError) as e:  # a truncated or foreign file
        raise DraftsmithError(f"{info.folder}: cannot read its weights ({e})") from None


def check_sizes(info: DrafterInfo) -> None:
    """The sizes the tables and counts use, each a whole number: a missing or odd one is named
    with its file, not a TypeError."""
    for key, written in SIZES.items():
        value = info.get(key)
        if value is None and key in OPTIONAL:
            continue
        if type(value) is not int or value < 1:
            mine = info.layout == "draftsmith"
            where = info.folder / ("draftsmith.json" if mine else "config.json")
            raise DraftsmithError(f"{where}: {key if mine else written} is {value!r}, not a "
                                  "whole number >= 1")


def architecture(info: DrafterInfo, dtype: str) -> dict[str, Any]:
    heads = int(info.get("num_heads"))
    hidden = info.hidden_size
    return {
        "layout": info.layout,
        "hidden_size": hidden,
        "intermediate_size": info.get("intermediate_size"),
        "attention heads": heads,
        "kv heads": info.get("num_kv_heads", heads),
        "head_dim": info.get("head_dim") or hidden // heads,
        "decoder layers": info.get("num_layers", 1),
        "vocab_size (target)": info.vocab_size,
        "draft_vocab_size": info.draft_vocab_size,
        "target_hidden_size": info.target_hidden_size,
        "max_position_embeddings": info.max_position_embeddings,
        "rope_theta": info.get("rope_theta"),
        "rms_norm_eps": info.get("rms_norm_eps"),
        **norms(info),
        "weights dtype": dtype,
    }


def norms(info: DrafterInfo) -> dict[str, bool]:
    """The norm flags as the layout's engine reads them (vLLM: a missing norm_before_residual is
    True)."""
    if info.layout == "speculators":
        from draftsmith.export.speculators import flags_of

        return flags_of(info.config)
    return {k: bool(info.config.get(k, False)) for k in NORM_FLAGS}


def written_ids(info: DrafterInfo) -> dict[str, list[int]]:
    """Every key the folder writes aux ids at, by its full path: a speculators folder's
    inside transformer_layer_config too, where vLLM reads them (`speculators_lists`)."""
    if info.layout == "draftsmith":
        return {"config.aux_layer_ids": info.canonical_ids() or []}
    from draftsmith.export.layout import speculators_lists

    nested = info.config.get("eagle_config")
    places = [(f"eagle_config.{IDS}", nested.get(IDS) if isinstance(nested, dict) else None)]
    if info.layout == "speculators":
        places += [(key, ids) for key, ids, _ in speculators_lists(info.config)]
    else:
        places.append((f"{IDS} (top level)", info.config.get(IDS)))
    return {key: list(ids) for key, ids in places if ids is not None}  # checked as read


def target_layers(info: DrafterInfo) -> int | None:
    prov = info.config.get("draftsmith") or {}
    key = "draftsmith.target_num_layers" if prov.get("target_num_layers") else \
        "target_num_layers"
    n = prov.get("target_num_layers") or info.config.get("target_num_layers")
    if n:  # 0 or none: not recorded
        if type(n) is not int or n < 1:  # the ids' range check reads it
            raise DraftsmithError(f"{info.config_path}: {key} is {n!r}, not a whole number "
                                  ">= 1; correct it, or pass --target")
        return n
    verifier = ((info.config.get("speculators_config") or {}).get("verifier") or {})
    path = Path(str(verifier.get("name_or_path") or "")) / "config.json"
    if verifier.get("name_or_path") and path.is_file():
        vc = read_config(path.parent)  # a multimodal verifier's layers are its text model's
        n = vc.get("num_hidden_layers") or (vc.get("text_config") or {}).get("num_hidden_layers")
        return n if type(n) is int and n > 0 else None
    return None


def canonical_ids(info: DrafterInfo, layers: int | None) -> tuple[list[int] | None, str]:
    """Canonical ids as the layout's own engine reads them."""
    if info.layout == "draftsmith":
        return info.canonical_ids(), ""
    engine = "sglang" if info.layout == "sglang" else "vllm"
    written, key, note = info.written(engine)
    notes = [note]
    if layers is None:
        if written is None:
            return None, f"{note}; the target's layer count is unknown (pass --target)"
        layers = UNKNOWN_DEPTH  # convert without the range check
        notes.append("target depth unknown (pass --target): ids not range-checked")
    feed = feed_from_written(written, engine, layers, key, note)
    notes.append(feed.note.replace(f"for this target ({UNKNOWN_DEPTH} layers: ",
                                   "for any target ("))  # an id below every layer
    prov = (info.config.get("draftsmith") or {}).get("aux_layer_ids_canonical")
    if prov is not None and feed.canonical is not None and prov != feed.canonical:
        notes.append(f"the file's draftsmith record says canonical {prov}")
    return feed.canonical, "; ".join(dict.fromkeys(n for n in notes if n))


def training_summary(info: DrafterInfo) -> dict[str, Any] | None:
    t = info.meta.get("training")
    if not t or not isinstance(t, dict):  # a hand-edited record: nothing to summarise
        return None
    keep = ("steps", "tokens", "world_size", "last_loss", "last_accept_length", "last_cond_acc")
    return {k: t[k] for k in keep if k in t}


def training_data(info: DrafterInfo) -> dict[str, Any] | None:
    d = info.meta.get("data")
    if not d or not isinstance(d, dict):
        imported = info.meta.get("imported")
        if not isinstance(imported, dict) or not imported.get("from"):
            return None
        return {"known": False, "note": f"imported from {imported['from']}"}
    out = {"known": True, "kind": d.get("kind"), "samples": d.get("samples"),
           "tokens": d.get("tokens"), "folder": d.get("folder") or d.get("prompts")}
    folder = Path(str(out["folder"] or ""))
    if out["folder"] and (folder / "manifest.json").is_file():
        out.update(manifest_summary(folder))
    return out


def manifest_summary(folder: Path) -> dict[str, Any]:
    from draftsmith.data.shards import read_manifest

    try:
        m = read_manifest(folder)
    except DraftsmithError as e:
        return {"manifest_error": str(e)}
    totals = m.get("totals") or {}
    given = m.get("input")
    return {
        "dataset samples": totals.get("samples"), "dataset tokens": totals.get("tokens"),
        "loss tokens": totals.get("loss_tokens"), "sources": commands(m),
        "input conversations": given.get("conversations") if isinstance(given, dict) else None,
        "regenerated": regenerated(folder, m),
    }


def commands(m: dict[str, Any]) -> list[str]:
    """The manifest's command lines (a lone string is one command, not its letters)."""
    cmds = m.get("commands") or []
    return [str(c) for c in ([cmds] if isinstance(cmds, str) else cmds)] \
        if isinstance(cmds, (str, list)) else []


def regenerated(folder: Path, m: dict[str, Any]) -> bool | None:
    """True/False where recorded; None when nothing says (captured answers as given)."""
    if isinstance(m.get("regenerated"), bool):
        return m["regenerated"]
    if "regenerate" in _make_stages(folder.parent / "make.json"):
        return True
    cmds = " ".join(commands(m))
    return True if "regenerate" in cmds or "data make" in cmds else None


def _make_stages(path: Path) -> dict[str, Any]:
    """The stages a `data make` record lists; none where it is missing or unreadable (the
    summary goes on without it)."""
    try:
        stages = json.loads(path.read_text()).get("stages") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return {}
    return stages if isinstance(stages, dict) else {}
