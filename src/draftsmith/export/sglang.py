"""SGLang's EAGLE-3 layout (`LlamaForCausalLMEagle3`).

Matched against sgl-project/sglang `python/sglang/srt/models/llama_eagle3.py` (commits
03d5a7771f60 and d737979cbd17): `LlamaModel` holds `embed_tokens`, `fc` (3 x target_hidden_size
in when `target_hidden_size` is set), `midlayer` (q/k/v and gate/up loaded as shards of
qkv_proj / gate_up_proj), `norm`; `lm_head` has `draft_vocab_size` rows; `load_weights` turns
`d2t` into `hot_token_id`, skips `t2d`, and silently drops names it does not know (import
leaves them out too, named in a warning; vLLM refuses them). The aux ids
are read from the nested `eagle_config.eagle_aux_hidden_state_layer_ids` in
`python/sglang/srt/model_executor/model_runner.py` (a missing key falls back to the target's
defaults without a word), so they are always written. The embedding is dropped: SGLang's
`eagle_worker.py` hands the draft the target's, except where `target_hidden_size` differs from
`hidden_size` (`LlamaForCausalLM.set_embed` in `models/llama.py` then keeps the draft's own), so
there it is kept. Import, given the target, reads what SGLang serves: the target's embedding
(and the target's head where SGLang takes it), a stored one that differs named in a warning.
vLLM also loads this layout
(`vllm/model_executor/models/llama_eagle3.py`); it reads the top-level
`eagle_aux_hidden_state_layer_ids` in its own convention, so that is written too.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.export.layout import (
    IDS,
    TargetInfo,
    cast,
    check_flags,
    default_feed,
    draft_vocab_of,
    drafter_config,
    engine_feed,
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
from draftsmith.layers import (
    WORDS,
    Convention,
    engine_limits,
    to_convention,
)
from draftsmith.models.eagle3 import (
    NORM_FLAGS,
    Eagle3Config,
    Eagle3Drafter,
    build_empty,
    hf_state_dict,
    load_hf_state_dict,
)

ARCH = "LlamaForCausalLMEagle3"
KNOWN_ARCHS = {ARCH, "Eagle3LlamaForCausalLM"}
# flags SGLang (tie_word_embeddings, bias), vLLM (norm_before_residual, norm_before_fc, which
# eagle_config may set too) or SpecForge (fc_norm, norm_output) read from this layout's config
FLAGS = (*NORM_FLAGS, "tie_word_embeddings", "bias")


# what SGLang's llama_eagle3.py reads from config.json from PR #24663 on (sgl-project/sglang
# #26506 says the MHA draft's fc_norm/norm_output landed there); 03d5a77 and d737979 read neither
SGLANG_NEWER = ("fc_norm", "norm_output")
SGLANG_FLAGS_SINCE = "#24663"
# names that llama_eagle3.py (since #24663) still reads as fc_norm's: the flag and its weights
LEGACY_FC_NORM_FLAG = "use_aux_norm"
LEGACY_FC_NORM = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.",
                  "aux_norm_high.": "fc_norm.2."}


def check_exportable(cfg: Eagle3Config) -> None:
    unsupported = [k for k in NORM_FLAGS if getattr(cfg, k) and k not in SGLANG_NEWER]
    if unsupported:
        raise DraftsmithError(f"SGLang's EAGLE-3 model has no {unsupported}; export to "
                              "speculators instead")
    if cfg.num_layers != 1:
        raise DraftsmithError(
            f"the drafter has {cfg.num_layers} decoder layers; SGLang's extra layers compute "
            "differently (they drop the residual stream), so only 1-layer drafters are "
            "exported; export --format speculators for vLLM"
        )
    if len(cfg.aux_layer_ids) != 3:
        raise DraftsmithError(f"SGLang's fc takes exactly 3 aux states, the drafter has "
                              f"{len(cfg.aux_layer_ids)}")


def served_family(architectures: list[str]) -> str | None:
    """The model family SGLang serves a target of these HF architectures with ("qwen2" for
    Qwen2ForCausalLM), None where none is named (a GGUF's config may lack them)."""
    arch = next((a for a in architectures if isinstance(a, str) and a), "")
    return arch.lower().removesuffix("forcausallm") or None


def sglang_config(cfg: Eagle3Config, info: TargetInfo, dtype: str,
                  source: str = "") -> dict[str, Any]:
    """`source`: the target's portable name for draftsmith's record (`info.name_or_path`, a
    loadable folder, where not given)."""
    ids = cfg.aux_layer_ids
    if limits := engine_limits(ids, info.num_layers, served_family(info.architectures)):
        raise DraftsmithError(f"SGLang cannot feed canonical aux layers {ids}: "
                              f"{'; '.join(limits)}; export --format speculators for vLLM, or "
                              "train on layers SGLang captures")
    sglang_ids = to_convention(ids, Convention.SGLANG, info.num_layers)
    return {
        "architectures": [ARCH],
        **hf_layer_config(cfg, info, 1),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        **{k: True for k in SGLANG_NEWER if getattr(cfg, k)},  # read by newer SGLang alone
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_ids,
            "use_aux_hidden_state": True,
        },
        "eagle_aux_hidden_state_layer_ids": to_convention(ids, Convention.VLLM, info.num_layers),
        "draftsmith": _provenance(cfg, info, sglang_ids, source),
    }


def _provenance(cfg: Eagle3Config, info: TargetInfo, written: list[int],
                source: str) -> dict[str, Any]:
    return {
        "aux_layer_ids_canonical": cfg.aux_layer_ids,
        "canonical_convention": WORDS[Convention.CANONICAL],
        "eagle_config_ids_convention": WORDS[Convention.SGLANG],
        "top_level_ids_convention": WORDS[Convention.VLLM],
        "eagle_config_ids": written,
        "target_num_layers": info.num_layers,
        "target_fingerprint": info.fingerprint or cfg.target_fingerprint,
        "target": source or info.name_or_path,
    }


def write_sglang(
    drafter: Eagle3Drafter,
    out: Path,
    info: TargetInfo,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    source: str = "",
) -> Path:
    check_exportable(drafter.cfg)
    _warn_fc_skipped(drafter.cfg)
    _warn_newer_flags(drafter.cfg)
    tensors = cast(hf_state_dict(drafter), dtype)
    if drafter.cfg.target_hidden_size == drafter.cfg.hidden_size:
        _warn_dropped_embedding(drafter, info)
        tensors.pop("embed_tokens.weight")  # SGLang's set_embed puts the target's there
    config = sglang_config(drafter.cfg, info, run_dtype(tensors, info), source)
    return write_folder(out, config, tensors, overwrite)


def _warn_newer_flags(cfg: Eagle3Config) -> None:
    """fc_norm and norm_output go to config.json, which SGLang's llama_eagle3.py reads from
    PR #24663 on (`fc_norm.{i}` RMSNorms before fc; `aux = hidden_states_to_logits if
    self.norm_output`); an older one loads no fc_norm weight and feeds the pre-norm state back,
    without a word."""
    if used := [k for k in SGLANG_NEWER if getattr(cfg, k)]:
        warnings.warn(f"{' and '.join(used)} written to config.json: SGLang from PR "
                      f"{SGLANG_FLAGS_SINCE} (its llama_eagle3.py reads them) serves the drafter "
                      "as trained; an older one drops them without a word and drafts otherwise "
                      "(check the served accept length against `draftsmith bench`, or export "
                      "--format speculators for vLLM)", stacklevel=3)


def _warn_fc_skipped(cfg: Eagle3Config) -> None:
    """SGLang's LlamaModel.forward applies fc only where the fed state is not as wide as the
    embedding (`hidden_states.shape[-1] != embeds.shape[-1]`), so a drafter exactly 3 x
    target_hidden_size wide drafts its first step from the target's states unfused."""
    n = len(cfg.aux_layer_ids)
    if cfg.hidden_size == n * cfg.target_hidden_size:
        warnings.warn(f"the drafter's hidden size {cfg.hidden_size} is {n} x its target hidden "
                      f"size {cfg.target_hidden_size}, and SGLang's EAGLE-3 model skips fc where "
                      "the fed states are as wide as the embedding, so SGLang drafts the first "
                      "step from the target's states unfused; serve this folder with vLLM (which "
                      "always applies fc), or train a drafter of another hidden size",
                      stacklevel=3)


def _warn_dropped_embedding(drafter: Eagle3Drafter, info: TargetInfo) -> None:
    """The export drops the drafter's embedding and SGLang's EAGLE worker serves the target's
    (`set_embed`); a drafter holding another one (an imported vLLM drafter keeps its own) is
    served otherwise than it drafts here, named where the target is at hand (--target)."""
    own = drafter.embed_tokens.weight.detach()
    if info.embed is None or info.embed.shape != own.shape:
        return
    if torch.equal(own, info.embed.to(own.device, own.dtype)):
        return
    warnings.warn("the drafter's embed_tokens.weight differs from the target's; SGLang serves "
                  "the target's in its place (its EAGLE worker's set_embed; the export leaves "
                  "the drafter's out), so SGLang drafts with other vectors than this drafter; "
                  "export --format speculators, whose vLLM keeps the drafter's own, or check "
                  "that the drafter belongs to this target", stacklevel=3)


def is_sglang(config: dict[str, Any]) -> bool:
    """SGLang's or SpecForge's architecture name, or the EAGLE reference code's folder (its
    traineagle3/config.json names LlamaForCausalLM; vLLM's eagle3 method serves it)."""
    return bool(set(config.get("architectures") or []) & KNOWN_ARCHS) or is_eagle_reference(config)


def is_eagle_reference(config: dict[str, Any]) -> bool:
    """A drafter config under a plain model's architecture name: only an EAGLE-3 drafter's
    names a draft vocabulary or an eagle_config (no target's config does)."""
    if set(config.get("architectures") or []) & KNOWN_ARCHS or "speculators_model_type" in config:
        return False
    return "draft_vocab_size" in config or isinstance(config.get("eagle_config"), dict)


def read_sglang(folder: Path, info: TargetInfo | None) -> Eagle3Drafter:
    """An SGLang/SpecForge/EAGLE-reference EAGLE-3 folder -> Eagle3Drafter."""
    folder = Path(folder)
    c = read_config(folder)
    check_flags(c, (*FLAGS, LEGACY_FC_NORM_FLAG), f"{folder}/config.json")
    w = _legacy_names(read_weights(folder))
    num_layers = _target_layers(c, info, folder)
    ids = _canonical_ids(c, num_layers, folder)
    mc = model_config_of(c)
    vocab, draft_vocab = mc.vocab_size, draft_vocab_of(c, mc.vocab_size,
                                                            f"{folder}/config.json")
    _check_layout(c, folder)
    _note_reference_arch(c, folder)
    _note_norm_output(c, folder)
    _note_fc_skipped(mc.hidden_size, target_hidden_of(c, mc.hidden_size, f"{folder}/config.json"),
                     folder)
    record = section(c, "draftsmith", f"{folder}/config.json")
    cfg = drafter_config(
        f"{folder}/config.json",
        hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        target_hidden_size=target_hidden_of(c, mc.hidden_size, f"{folder}/config.json"),
        vocab_size=vocab, draft_vocab_size=draft_vocab, aux_layer_ids=ids,
        rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta, rope_scaling=mc.rope_scaling,
        max_position_embeddings=mc.max_position_embeddings, target_num_layers=num_layers,
        norm_before_residual=bool(c.get("norm_before_residual")),  # vLLM reads it here
        norm_before_fc=_norm_before_fc(c, f"{folder}/config.json"),
        fc_norm=bool(c.get("fc_norm") or c.get(LEGACY_FC_NORM_FLAG)),  # as SGLang reads it
        norm_output=c.get("norm_output") is True,  # the normed state fed back, as engines read it
        target_fingerprint=record.get("target_fingerprint", ""),
        target_source=info.name_or_path if info else str(record.get("target") or ""),
        target_architectures=list(info.architectures) if info else [],
    )
    w = _drop_unknown(w, cfg, folder)
    w.update(vocab_tensors(w, vocab, draft_vocab, str(folder)))
    replaced = _add_embedding(w, c, mc.hidden_size, info, folder)
    _warn_replaced(replaced + _add_head(w, c, info, folder), folder)
    drafter = build_empty(cfg)
    load_hf_state_dict(drafter, w, str(folder))
    return drafter


def _legacy_names(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`aux_norm_low/mid/high.*` as `fc_norm.0/1/2.*`, as SGLang's load_weights renames them
    (`legacy_name_map`), so the per-aux norms it serves are not left out as unknown."""
    def renamed(k: str) -> str:
        return next((new + k[len(old):] for old, new in LEGACY_FC_NORM.items()
                     if k.startswith(old)), k)
    return {renamed(k): v for k, v in w.items()}


def _check_layout(c: dict[str, Any], folder: Path) -> None:
    """What SGLang's LlamaForCausalLMEagle3 would load but this drafter cannot hold is refused:
    extra decoder layers (`additional_layers`, which drop the residual stream) and an fc bias
    (`config.bias`)."""
    n = c.get("num_hidden_layers", 1)
    if n != 1:
        raise DraftsmithError(f"{folder}/config.json: num_hidden_layers is {n!r}; SGLang's extra "
                              "draft layers compute differently, so only 1-layer SGLang drafters "
                              "are read")
    if c.get("bias"):
        raise DraftsmithError(f"{folder}/config.json: bias true (SGLang gives fc a bias); "
                              "draftsmith's fc has none")
    draft, vocab = c.get("draft_vocab_size"), c.get("vocab_size")
    if c.get("tie_word_embeddings") and draft is not None and draft != vocab:
        raise DraftsmithError(
            f"{folder}/config.json: tie_word_embeddings is true but draft_vocab_size {draft} "
            f"differs from vocab_size {vocab}: a tied head is the embedding (SGLang's lm_head = "
            "embed_tokens), one row per target token, not per draft token; set "
            f"tie_word_embeddings false and store the drafter's lm_head.weight ({draft} rows)")


def _norm_before_fc(c: dict[str, Any], where: str) -> bool:
    """As vLLM's llama_eagle3.py reads it (PR #42143, NVIDIA ModelOpt's checkpoints):
    eagle_config's norm_before_fc where set, else the top-level one."""
    nested = (c.get("eagle_config") or {}).get("norm_before_fc")
    check_flags({"eagle_config.norm_before_fc": nested}, ("eagle_config.norm_before_fc",), where)
    return bool(c.get("norm_before_fc") if nested is None else nested)


def _note_norm_output(c: dict[str, Any], folder: Path) -> None:
    """SGLang and vLLM feed lm_head the final norm's output whatever `norm_output` says; the flag
    picks the state fed to the next step. SpecForge's PR #879 (2026-09-15) turned its meaning
    to theirs, and a folder names no SpecForge version, so both readings are said."""
    flag = c.get("norm_output")
    if flag is False:
        note(f"{folder}/config.json: norm_output false read as plain EAGLE-3 (final norm before "
             "lm_head, pre-norm state fed back), as SGLang and vLLM serve it and SpecForge trains "
             "it since PR #879 (2026-09-15); SpecForge before #879 meant lm_head without the "
             "final norm, which no engine serves",
             "`draftsmith bench --drafter DIR --target T` on the import: a first-position "
             "acceptance far below the drafter's training report means an older SpecForge "
             "trained it without the norm: train it again", stacklevel=3)
    elif flag is True:
        note(f"{folder}/config.json: norm_output true read as Eagle-3.1 (the normed state fed to "
             f"the next draft step), as vLLM and SGLang from PR {SGLANG_FLAGS_SINCE} serve it "
             "and SpecForge trains it since PR #879 (2026-09-15); SpecForge before #879 wrote it "
             "for plain EAGLE-3 (the pre-norm state fed back)",
             "`draftsmith bench --drafter DIR --target T` on the import: acceptance falling from "
             "the second position on means an older SpecForge trained it plain: set norm_output "
             "false in the folder's config.json and import it again", stacklevel=3)


def _note_fc_skipped(hidden: int, target_hidden: int, folder: Path) -> None:
    if hidden == 3 * target_hidden:
        note(f"{folder}/config.json: hidden_size {hidden} is 3 x target_hidden_size "
             f"{target_hidden}, and SGLang's EAGLE-3 model skips fc where the fed states are as "
             "wide as the embedding, so SGLang drafts the first step from the target's states "
             "unfused; vLLM and the import apply fc",
             "serve the folder with vLLM, or use a drafter of another hidden size with SGLang",
             stacklevel=3)


def _note_reference_arch(c: dict[str, Any], folder: Path) -> None:
    if is_eagle_reference(c):
        note(f"{folder}/config.json: architectures {c.get('architectures')} (the EAGLE "
             "reference code's): vLLM's eagle3 method serves it (as Eagle3 + that name), but "
             "SGLang builds a plain model from that name and cannot load it",
             f"for SGLang set architectures to [\"{ARCH}\"], or serve the folder `draftsmith "
             "export --format sglang` writes from the import", stacklevel=3)


def _drop_unknown(w: dict[str, torch.Tensor], cfg: Eagle3Config,
                  folder: Path) -> dict[str, torch.Tensor]:
    """SGLang's `load_weights` skips names it has no parameter for without a word; so does the
    import, naming them once. A missing tensor is still refused by the loader."""
    known = set(hf_state_dict(build_empty(cfg)))
    known |= {"layers.0." + k.removeprefix("midlayer.") for k in known if k.startswith("midlayer.")}
    unknown = sorted(set(w) - known)
    if unknown:
        note(f"{folder}: tensors SGLang does not load, left out: {unknown}",
             "remove them from the folder's weights: vLLM, which loads this layout too, refuses "
             "names it does not know", stacklevel=2)
    _note_vllm_names(w, folder)
    return {k: v for k, v in w.items() if k not in unknown}


def _note_vllm_names(w: dict[str, torch.Tensor], folder: Path) -> None:
    """SGLang's load_weights turns `layers.0.*` into `model.layers.0.*`, which its
    LlamaForCausalLMEagle3 has no parameter for, and skips them: it serves an unloaded decoder
    layer. vLLM maps `midlayer.` to `layers.0.` and loads either, as the import does."""
    if any(k.startswith("layers.0.") for k in w):
        note(f"{folder}: the decoder layer is stored as layers.0.* (vLLM's names), which "
             "SGLang's LlamaForCausalLMEagle3 (as read at 03d5a77) skips without a word (it "
             "loads midlayer.*; later versions may read both, PR #24663), serving that layer "
             "unloaded; vLLM and this import read the stored one",
             "rename layers.0.* to midlayer.* in the folder's weights (`draftsmith export "
             "--format sglang` of the import writes them so)", stacklevel=3)


def _target_layers(c: dict[str, Any], info: TargetInfo | None, folder: Path) -> int:
    n = recorded_layers(c, info, f"{folder}/config.json")
    if n:
        return n
    raise DraftsmithError(f"{folder}: the target's layer count is needed to read the aux layer "
                          "ids; pass --target")


def _canonical_ids(c: dict[str, Any], num_layers: int, folder: Path) -> list[int]:
    where = f"{folder}/config.json"
    canonical = imported_ids(c, "sglang", num_layers, where, folder)
    written, _, conv = engine_ids(c, "sglang", num_layers, where)
    if written is None:
        warn_default_repeat(num_layers, where)
        return canonical
    warn_unsorted(written, canonical, where)
    if not _note_recorded(c, canonical, where):
        _note_other_reading(c, canonical, conv, num_layers, where)
    return canonical


def _note_other_reading(c: dict[str, Any], canonical: list[int], conv: Convention,
                        num_layers: int, where: str) -> None:
    """vLLM loads this layout too but reads only the top-level list (input of layer j), while
    SGLang reads only eagle_config's (else its defaults): the import takes the key the folder's
    own engine reads, and names the other engine's reading where it feeds other layers."""
    if conv is Convention.SGLANG:
        top = c.get(IDS)
        if not (top and isinstance(top, list) and all(type(i) is int for i in top)):
            return  # none, or one vLLM refuses itself
        try:
            other = engine_feed(top, Convention.VLLM, num_layers)
        except DraftsmithError:
            other = None
        if other == canonical:
            return
        fed = f"canonical {other}" if other else "layers this target does not have"
        note(f"{where}: SGLang reads eagle_config.{IDS} as canonical {canonical}, but vLLM, which "
             f"loads this layout too, reads the top-level {IDS} {top} as {fed}: the engines "
             "would feed the drafter other layers; imported as SGLang reads them",
             f"write the top-level {IDS} {to_convention(canonical, Convention.VLLM, num_layers)} "
             "(vLLM's convention, input of layer j) if the drafter was trained on canonical "
             f"{canonical}; `draftsmith doctor --drafter DIR --data DIR` checks it",
             stacklevel=3)
        return
    defaults = default_feed(num_layers)
    if defaults != canonical:
        note(f"{where}: eagle_config names no {IDS}, so SGLang ignores the top-level list and "
             f"feeds its defaults, canonical {defaults}, while vLLM reads the top-level "
             f"{c.get(IDS)} as canonical {canonical}; imported as vLLM reads them",
             f"write eagle_config.{IDS} {to_convention(canonical, Convention.SGLANG, num_layers)}"
             " (SGLang's convention, output of layer j) so both engines feed the drafter alike",
             stacklevel=3)


def _note_recorded(c: dict[str, Any], canonical: list[int], where: str) -> bool:
    """An export whose own record names other canonical ids than SGLang reads: draftsmith
    before 2026-12-07 wrote ids not starting at 1 one higher (the DeepSeek-V2 family's rule),
    which SGLang's Llama classes read a layer late; or the list was edited since."""
    recorded = (c.get("draftsmith") or {}).get("aux_layer_ids_canonical")
    if isinstance(recorded, list) and recorded != canonical:
        note(f"{where}: SGLang reads eagle_config's ids as canonical {canonical}, but the "
             f"export recorded the drafter's as {recorded} (an export by draftsmith before "
             "2026-12-07 wrote ids not starting at 1 one layer high, or the list was edited); "
             "imported as SGLang reads them",
             f"write eagle_config.eagle_aux_hidden_state_layer_ids {recorded} there, or export "
             "the drafter again; `draftsmith doctor --drafter DIR` checks it", stacklevel=3)
        return True
    return False


def _add_embedding(w: dict[str, torch.Tensor], c: dict[str, Any], hidden: int,
                   info: TargetInfo | None, folder: Path) -> list[str]:
    """The embedding SGLang's EAGLE worker leaves in the draft: the target's (`set_embed`, or
    `set_embed_and_head` where the head comes from the target too), unless `target_hidden_size`
    differs from `hidden_size` (models/llama.py `set_embed` then keeps the draft's own). Without
    the target, a stored one stands in. Returns the names whose stored values the target's
    replaced with other values."""
    keeps_own = c.get("target_hidden_size") not in (None, hidden) and not _head_from_target(c)
    if info is not None and info.embed is not None and not keeps_own:
        return _take_target(w, "embed_tokens.weight", info.embed)
    if "embed_tokens.weight" not in w:
        if info is None or info.embed is None:
            raise DraftsmithError(f"{folder}: no embed_tokens.weight (SGLang reuses the "
                                  "target's); pass --target to take it from there")
        w["embed_tokens.weight"] = info.embed.to(w["fc.weight"].dtype)
    return []


def _head_from_target(c: dict[str, Any]) -> bool:
    # LlamaForCausalLMEagle3's load_lm_head_from_target: untied and no draft_vocab_size
    return not c.get("tie_word_embeddings") and c.get("draft_vocab_size") is None


def _take_target(w: dict[str, torch.Tensor], name: str, theirs: torch.Tensor) -> list[str]:
    """Put the target's tensor at `name` (in the checkpoint's dtype); [name] where a stored one
    of that shape held other values. One of another shape is left for the fit checks to name."""
    dtype = w["fc.weight"].dtype
    stored = w.get(name)
    if stored is not None and stored.shape != theirs.shape:
        return []
    w[name] = theirs.to(dtype)
    return [] if stored is None or torch.equal(stored.to(dtype), w[name]) else [name]


def _add_head(w: dict[str, torch.Tensor], c: dict[str, Any], info: TargetInfo | None,
              folder: Path) -> list[str]:
    """SGLang's LlamaForCausalLMEagle3: tie_word_embeddings makes lm_head the embedding module
    (a stored lm_head.weight is never read, and set_embed replaces both); untied without
    draft_vocab_size it serves the target's lm_head (`load_lm_head_from_target`), a stored one
    or not. Without the target, a stored one stands in."""
    if c.get("tie_word_embeddings"):
        w["lm_head.weight"] = w["embed_tokens.weight"]
        return []
    if _head_from_target(c) and info is not None and info.head is not None:
        return _take_target(w, "lm_head.weight", info.head)
    if "lm_head.weight" in w:
        return []
    if c.get("draft_vocab_size") is not None:
        raise DraftsmithError(f"{folder}: no lm_head.weight, and config.json's draft_vocab_size "
                              "says the drafter has its own head (SGLang takes the target's only "
                              "without a draft_vocab_size)")
    raise DraftsmithError(f"{folder}: no lm_head.weight (SGLang takes the target's); pass "
                          "--target to take it from there")


def _warn_replaced(names: list[str], folder: Path) -> None:
    if not names:
        return
    vllm = (" (vLLM, which loads this layout too, keeps a stored embedding: the two engines "
            "would run different drafters)" if "embed_tokens.weight" in names else "")
    note(f"{folder}: the stored {' and '.join(names)} {'differs' if len(names) == 1 else 'differ'}"
         " from the target's; SGLang's EAGLE worker serves the target's (set_embed / "
         f"set_embed_and_head), so the import takes the target's{vllm}; a SpecForge drafter "
         "normally stores the target's own",
         "check that the drafter was trained for this target; `draftsmith import --target` "
         "and `draftsmith export` write the target's own, which every engine serves alike",
         stacklevel=3)
