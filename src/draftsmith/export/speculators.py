"""speculators' EAGLE-3 layout, which vLLM serves (`--speculative-config '{"model": DIR}'`).

Matched against vllm-project/speculators `src/speculators/models/eagle3/config.py`
(`Eagle3SpeculatorConfig`) and `src/speculators/models/eagle3/core.py` (`Eagle3DraftModel`:
`embed_tokens`, `fc` = num_aux x hidden_size in, `layers.{i}`, `norm`, `lm_head`, buffers `d2t`,
`t2d`, optional `input_norm` / `fc_norm.{i}`), speculators 0.9.0, and against vLLM's reader
`vllm/transformers_utils/configs/speculators/algos.py` (`update_eagle3`: it copies the top-level
`eagle_aux_hidden_state_layer_ids`, vLLM convention, and defaults `norm_before_residual` to
True when absent, so both are always written). The embedding is kept: a speculators folder
without `embed_tokens.weight` loads with uninitialised memory there. A folder without lm_head
weights reads as vLLM serves it: with the target's head shared (`_shared_head`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.export.layout import (
    IDS,
    LAYER,
    TargetInfo,
    cast,
    check_flags,
    default_ids,
    draft_vocab_of,
    drafter_config,
    engine_ids,
    hf_layer_config,
    imported_ids,
    model_config_of,
    note,
    read_config,
    read_weights,
    recorded_layers,
    run_dtype,
    section,
    target_hidden_of,
    vocab_tensors,
    warn_default_repeat,
    warn_unsorted,
    write_folder,
)
from draftsmith.layers import WORDS, Convention, default_aux_layers, to_convention
from draftsmith.models.eagle3 import (
    NORM_FLAGS,
    Eagle3Config,
    Eagle3Drafter,
    build_empty,
    hf_state_dict,
    load_hf_state_dict,
)

# vLLM's update_eagle3 reads a missing norm_before_residual as True (speculators' own default is
# False, but vLLM serves the folder); the other flags as False.
VLLM_DEFAULTS = {"norm_before_residual": True}


def flags_of(config: dict[str, Any]) -> dict[str, bool]:
    """The speculators flags of `config` as vLLM reads them."""
    return {k: bool(config.get(k, VLLM_DEFAULTS.get(k, False))) for k in NORM_FLAGS}


# The PR from which vLLM's speculators reader (algos.update_eagle3) passes each flag on to its
# Eagle-3 model; an older one drops norm_output without a word and skips or refuses the extra
# norm weights, drafting otherwise than the drafter was trained.
VLLM_FLAG_SINCE = {"norm_before_fc": "#38111", "fc_norm": "#46488", "norm_output": "#46488"}
VLLM_AUX = 3  # the aux-state count vLLM's Eagle-3 fc takes where it reads no other


class VllmNote(UserWarning):
    """What vLLM may serve otherwise than the export's config says (the CLI's hint says it)."""


def vllm_notes(config: dict[str, Any]) -> list[str]:
    """One line per thing an older vLLM reads otherwise in a speculators `config`: an aux count
    other than 3, and flags its reader drops. The one wording, for export and the CLI hint."""
    notes, written = [], config.get(IDS) or []
    if written and len(written) != VLLM_AUX:
        notes.append(f"{len(written)} aux layers: speculators loads this drafter, but vLLM's "
                     "Eagle-3 model builds its fc for exactly 3 and will refuse the weights, "
                     "unless it reads num_aux_hidden_states (written in "
                     "transformer_layer_config)")
    if unread := [k for k in VLLM_FLAG_SINCE if config.get(k)]:
        prs = sorted({VLLM_FLAG_SINCE[k] for k in unread})
        notes.append(f"{', '.join(unread)} set: speculators reads them, and vLLM from PR "
                     f"{' and '.join(prs)}, but an older vLLM's Eagle-3 model does not (it "
                     "ignores norm_output and skips or refuses the extra norm weights); serve "
                     "it with a vLLM that has them")
    return notes


def warn_vllm_notes(config: dict[str, Any]) -> None:
    for line in vllm_notes(config):
        warnings.warn(VllmNote(f"vLLM: {line}"), stacklevel=3)


def speculators_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
            for k, v in tensors.items()}


def speculators_config(
    cfg: Eagle3Config, info: TargetInfo, dtype: str, speculative_tokens: int, source: str = ""
) -> dict[str, Any]:
    """The verifier is named as vLLM loads it (an HF folder); draftsmith's record names the
    target portably (`source`: "default", a GGUF's file; `info.name_or_path` where not given)."""
    if cfg.target_hidden_size != cfg.hidden_size:
        raise DraftsmithError(
            f"speculators' fc takes num_aux x hidden_size inputs; this drafter's target hidden "
            f"size {cfg.target_hidden_size} differs from its hidden size {cfg.hidden_size}; "
            "export --format sglang instead: SGLang and vLLM both load that layout and read its "
            "target_hidden_size"
        )
    if not info.name_or_path:
        raise DraftsmithError("speculators needs the verifier's name or path; pass --target")
    vllm_ids = to_convention(cfg.aux_layer_ids, Convention.VLLM, info.num_layers)
    warn_edge_ids(cfg.aux_layer_ids, info.num_layers)
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": _layer_config(cfg, info),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **{k: getattr(cfg, k) for k in NORM_FLAGS},
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{
                "proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1, "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": info.name_or_path, "architectures": info.architectures},
        },
        "tie_word_embeddings": False,
        # transformers before 4.56 reads only torch_dtype, from 4.56 dtype; one value, both keys
        "torch_dtype": dtype,
        "dtype": dtype,
        "draftsmith": {
            "aux_layer_ids_canonical": cfg.aux_layer_ids,
            "canonical_convention": WORDS[Convention.CANONICAL],
            "written_convention": WORDS[Convention.SPECULATORS],
            "target_num_layers": info.num_layers,
            "target_fingerprint": info.fingerprint or cfg.target_fingerprint,
            "target": source or info.name_or_path,
        },
    }


def _layer_config(cfg: Eagle3Config, info: TargetInfo) -> dict[str, Any]:
    """The drafter layer's HF config, which vLLM's speculators reader makes the draft's config:
    an aux count other than 3 named there, where vLLM's Eagle-3 model sizes fc by it."""
    layer = hf_layer_config(cfg, info, cfg.num_layers)
    if len(cfg.aux_layer_ids) != VLLM_AUX:
        layer["num_aux_hidden_states"] = len(cfg.aux_layer_ids)
    return layer


def vllm_edge_notes(ids: list[int], num_layers: int) -> list[str]:
    """One line per canonical id that only newer vLLM model files capture: -1 (vLLM id 0, the
    embedding: older files add a residual still None at layer 0) and L-1 (vLLM id L, the last
    layer's output: older files capture inside the layer loop only, so fc gets too few
    states). The one wording of this advice, for export's warning and the doctor's finding."""
    edges = {-1: (0, "the embedding output"),
             num_layers - 1: (num_layers, "the last layer's output")}
    return [f"id {i} needs vLLM id {j}; vLLM aux layer id {j} ({what}) is captured only by "
            "newer vLLM model files, an older vLLM fails on this drafter"
            for i, (j, what) in edges.items() if i in ids]


def vllm_edge_fix(num_layers: int, n: int) -> str:
    """What to do about `vllm_edge_notes`: newer vLLM, or `n` layers every vLLM captures."""
    ids = _inner_ids(num_layers, n)
    if ids is None:
        return (f"serve it with newer vLLM model files: this {num_layers}-layer target has "
                f"fewer than {n} layers besides the embedding and the last one")
    return ("serve it with newer vLLM model files, or retrain on layers all capture: "
            f"`draftsmith data capture --aux-layers {','.join(map(str, ids))}`")


def _inner_ids(num_layers: int, n: int) -> list[int] | None:
    """`n` distinct canonical ids, neither the embedding (-1) nor the last layer's output: the
    default where it is such, else spread over the layers between."""
    first = default_aux_layers(num_layers) if num_layers >= 2 else []  # 1 layer: no default
    if len(first) == n and -1 not in first and num_layers - 1 not in first:
        return first
    inner = num_layers - 1  # layers 0 .. L-2
    if inner < n:
        return None
    return [k * (inner - 1) // max(n - 1, 1) for k in range(n)]


def warn_edge_ids(ids: list[int], num_layers: int) -> None:
    """Canonical `ids` that only newer vLLM captures: a warning, as the doctor's finding, not a
    refusal of a drafter newer vLLM serves."""
    notes = vllm_edge_notes(ids, num_layers)
    if notes:
        warnings.warn(f"{'; '.join(notes)}: {vllm_edge_fix(num_layers, len(ids))}",
                      stacklevel=3)


def write_speculators(
    drafter: Eagle3Drafter,
    out: Path,
    info: TargetInfo,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    overwrite: bool = False,
    source: str = "",
) -> Path:
    tensors = speculators_names(cast(hf_state_dict(drafter), dtype))
    config = speculators_config(drafter.cfg, info, run_dtype(tensors, info),
                                speculative_tokens, source)
    warn_vllm_notes(config)
    return write_folder(out, config, tensors, overwrite)


def verifier_of(config: dict[str, Any], where: str) -> dict[str, Any]:
    """speculators_config.verifier, {} where absent; a null or non-object section is refused
    naming its key (vLLM's and speculators' readers fail on one)."""
    spec = section(config, "speculators_config", where)
    return section(spec, "verifier", where, "speculators_config.verifier")


def is_speculators(config: dict[str, Any]) -> bool:
    return config.get("speculators_model_type") == "eagle3"


def read_speculators(folder: Path, info: TargetInfo | None) -> Eagle3Drafter:
    folder = Path(folder)
    c = read_config(folder)
    where = f"{folder}/config.json"
    layer = section(c, "transformer_layer_config", where)
    if not layer:
        raise DraftsmithError(f"{where}: transformer_layer_config is missing; a speculators "
                              "EAGLE-3 config holds the drafter layer's HF config there")
    check_flags(c, NORM_FLAGS, where)
    mc = model_config_of(layer)
    record = section(c, "draftsmith", where)
    verifier = verifier_of(c, where)
    num_layers = _verifier_layers(c, info, folder)
    ids = imported_ids(c, "speculators", num_layers, where, folder)
    written, key, _ = engine_ids(c, "speculators", num_layers, where)
    if written is not None:
        warn_unsorted(written, ids, where)
        _note_nested_ids(key, written, num_layers, where)
    else:
        warn_default_repeat(num_layers, where)
    vocab, draft_vocab = mc.vocab_size, draft_vocab_of(c, mc.vocab_size,
                                                            f"{folder}/config.json")
    cfg = drafter_config(
        f"{folder}/config.json",
        hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        target_hidden_size=target_hidden_of(c, mc.hidden_size, f"{folder}/config.json"),
        vocab_size=vocab, draft_vocab_size=draft_vocab,
        aux_layer_ids=ids,
        rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta, rope_scaling=mc.rope_scaling,
        max_position_embeddings=mc.max_position_embeddings, num_layers=mc.num_layers,
        **flags_of(c),
        target_num_layers=num_layers,
        target_fingerprint=record.get("target_fingerprint", ""),
        target_source=str(record.get("target") or verifier.get("name_or_path") or ""),
        target_architectures=list(verifier.get("architectures") or []),
    )
    w = read_weights(folder)
    w = {k: v for k, v in w.items() if not k.startswith("verifier_")}
    w.update(vocab_tensors(w, vocab, draft_vocab, str(folder)))
    if "embed_tokens.weight" not in w:
        if info is None or info.embed is None:
            raise DraftsmithError(f"{folder}: no embed_tokens.weight; pass --target")
        w["embed_tokens.weight"] = info.embed.to(w["fc.weight"].dtype)
    else:
        _warn_own_embedding(w, info, folder)
    if not any(k.startswith("lm_head.") for k in w):
        w["lm_head.weight"] = _shared_head(w, info, cfg, folder)
    kind = layer.get("model_type")
    _check_qk_norms(kind, w, folder)
    drafter = build_empty(cfg)
    try:
        load_hf_state_dict(drafter, w, str(folder))
    except DraftsmithError as e:
        if kind in (None, "llama"):
            raise
        raise DraftsmithError(
            f"{folder}/config.json: transformer_layer_config.model_type is {kind!r}, and "
            f"draftsmith reads only llama-type drafter layers; its tensors do not fit one: {e}"
        ) from None
    _note_layer_kind(kind, where)
    return drafter


def _note_layer_kind(kind: Any, where: str) -> None:
    """A layer the import reads as llama but an engine reads otherwise: vLLM's update_eagle3
    takes a missing model_type as llama, speculators' config validator builds a Qwen3Config
    for it (q/k normed per head); a type outside {llama, qwen3} speculators (`model_classes`)
    and newer vLLM refuse. (qwen3 itself is refused by `_check_qk_norms`.)"""
    if kind == "llama":
        return
    if kind is None:
        what = ("names no model_type: vLLM reads it as llama, as the import does, but "
                "speculators builds a Qwen3 layer for it (q and k normed per head)")
    else:
        what = (f"model_type is {json.dumps(kind)[:40]}: the import reads it as llama, as an "
                "older vLLM serves it, but speculators and newer vLLM (their Eagle-3 readers "
                "take llama or qwen3) refuse it")
    note(f"{where}: transformer_layer_config {what}", "if the drafter was trained as a llama "
         "layer, write transformer_layer_config.model_type \"llama\", which every reader "
         "takes", stacklevel=3)


def _note_nested_ids(key: str, written: list[int], num_layers: int, where: str) -> None:
    """Ids vLLM reads from inside transformer_layer_config (its draft config), where
    speculators reads only the top-level list and, finding none, takes its defaults."""
    if not key.startswith(LAYER):
        return
    older = (", as vLLM before its eagle_config fallback does (vLLM issue 50170)"
             if ".eagle_config." in key else "")
    note(f"{where}: the aux layer ids {written} sit at {key}, which vLLM reads (the import "
         f"too), but speculators reads only the top level and takes its defaults "
         f"{default_ids(num_layers)} there{older}", f"move the list to {IDS} at the top "
         "level, where every reader takes it", stacklevel=3)


def _warn_own_embedding(w: dict[str, torch.Tensor], info: TargetInfo | None,
                        folder: Path) -> None:
    """vLLM's EAGLE proposer (`_maybe_share_embeddings`) shares the target's embedding only
    where the draft stores none or an identical one, and otherwise keeps the stored one, as the
    import does: named where it differs, since a drafter trained on the target's frozen
    embedding then drafts from other vectors (SGLang, which swaps in the target's, does not load
    this layout)."""
    stored = w["embed_tokens.weight"]
    if info is None or info.embed is None or stored.shape != info.embed.shape:
        return  # without the target nothing to compare; another shape: the fit checks say so
    if torch.equal(stored, info.embed.to(stored.dtype)):
        return
    note(f"{folder}: the stored embed_tokens.weight differs from the target's; vLLM keeps a "
         "draft's own embedding where it differs (\"Keeping separate embedding weights from the "
         "target model\"), so vLLM, and this import, draft with the stored one, not the "
         "target's", "check that the drafter was trained for this target; to have vLLM share "
         "the target's embedding, remove embed_tokens.weight from the folder's weights",
         stacklevel=3)


def _shared_head(w: dict[str, torch.Tensor], info: TargetInfo | None, cfg: Eagle3Config,
                 folder: Path) -> torch.Tensor:
    """The head vLLM serves a folder without lm_head weights: the target's, shared
    (`has_own_lm_head` false, `_maybe_share_lm_head`). Its LogitsProcessor keeps the first
    draft_vocab_size logits and places logit i at target id i + d2t[i], so the shared head fits
    only where every d2t offset is 0 (the draft vocabulary is target ids 0..N-1, the whole
    vocabulary where N is its size); else vLLM would draft other tokens' logits, refused."""
    if info is None or info.head is None:
        raise DraftsmithError(f"{folder}: no lm_head.weight (vLLM then shares the target's); "
                              "pass --target to take it from there")
    n, hidden = cfg.draft_vocab_size, cfg.hidden_size
    if info.head.shape[1] != hidden:
        raise DraftsmithError(
            f"{folder}: no lm_head.weight, and the target's, which vLLM would share, takes "
            f"{info.head.shape[1]} inputs, not the drafter's hidden size {hidden}; store the "
            "drafter's own lm_head.weight")
    if bool(w["d2t"].ne(0).any()):
        raise DraftsmithError(
            f"{folder}: no lm_head.weight, and vLLM's shared target head gives draft id i the "
            f"logit of target token i (its first {n} rows), but d2t maps draft ids to other "
            "target tokens, so it would draft wrong tokens; store the drafter's own "
            f"lm_head.weight ({n} rows)")
    whole = "the target's lm_head" if n == info.head.shape[0] else \
        f"the first {n} rows of the target's lm_head (target ids 0..{n - 1}, as d2t maps them)"
    note(f"{folder}: no lm_head.weight; vLLM shares the target's head with such a folder, so "
         f"the import takes {whole}",
         "nothing to do if the drafter was trained on the target's head; `draftsmith export` "
         "writes it into the folder, which every engine serves alike", stacklevel=3)
    return info.head[:n].to(w["fc.weight"].dtype)


def _check_qk_norms(kind: Any, w: dict[str, torch.Tensor], folder: Path) -> None:
    """A qwen3 layer is refused even without q_norm/k_norm tensors: speculators builds it as
    Qwen3DecoderEagle3FirstLayer and vLLM (Eagle3Qwen3ForCausalLM, in versions that route qwen3
    to it) as a Qwen3DecoderLayer, both normalizing q and k per head, which a llama layer does
    not; read as llama it would draft otherwise than it was trained, without a word."""
    if not (isinstance(kind, str) and kind.startswith("qwen3")):
        return
    norms = sorted(k for k in w if k.endswith(("q_norm.weight", "k_norm.weight")))
    held = (f"its tensors {norms} have no place in one" if norms else "this folder holds no "
            "q_norm/k_norm weights, which that layer needs (a vLLM that builds "
            "Eagle3Qwen3ForCausalLM refuses the folder, an older one serves it as llama: the "
            "engines disagree)")
    raise DraftsmithError(
        f"{folder}/config.json: transformer_layer_config.model_type is {kind!r}, and draftsmith "
        f"reads only llama-type drafter layers: speculators and vLLM build a Qwen3 layer, which "
        f"normalizes q and k per head (q_norm/k_norm); {held}; if the drafter was trained as a "
        "llama layer, set transformer_layer_config.model_type to \"llama\"")


def _verifier_layers(c: dict[str, Any], info: TargetInfo | None, folder: Path) -> int:
    n = recorded_layers(c, info, f"{folder}/config.json")
    if n:
        return n
    verifier = verifier_of(c, f"{folder}/config.json").get("name_or_path")
    vcfg = Path(str(verifier)) / "config.json" if verifier else None
    if vcfg is not None and vcfg.is_file():
        vc = read_config(vcfg.parent)
        n = vc.get("num_hidden_layers") or section(vc, "text_config", str(vcfg)).get(
            "num_hidden_layers")
        if not n:
            raise DraftsmithError(f"{vcfg}: no num_hidden_layers (nor text_config's) to read the "
                                  "aux layer ids with; pass --target")
        return int(n)
    raise DraftsmithError(f"{folder}: the target's layer count is needed to read the aux layer "
                          "ids; pass --target")
