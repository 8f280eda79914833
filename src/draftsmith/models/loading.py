"""HF-named weights -> our fused, sharded state dict, loaded into a meta-built model."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import ModelConfig
from draftsmith.models.llama import Transformer
from draftsmith.models.parallel import (
    SINGLE,
    TP,
    ColumnLinear,
    RowLinear,
    VocabEmbedding,
    VocabHead,
)


@dataclass(frozen=True, slots=True)
class Fused:
    """The call that forms a fused tensor: its pieces (checkpoint names and tensors) in order."""
    names: tuple[str, ...]
    pieces: tuple[torch.Tensor, ...]

    def __call__(self) -> torch.Tensor:
        return torch.cat(self.pieces)


@dataclass(frozen=True, slots=True)
class Lacking:
    """A fused tensor the checkpoint holds only some pieces of: the checkpoint names it lacks."""
    names: tuple[str, ...]


# a full tensor, or the call that forms it (a fused one), or the pieces a partial one lacks
Full = torch.Tensor | Callable[[], torch.Tensor] | Lacking

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_RENAME = {
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.o_proj.bias": "attn.o.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
}
_FUSED = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_hf_names(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, Full]:
    """Full-size state dict in our names (QKV and gate/up fused, not yet sharded); a fused
    tensor is left as the call that concatenates it (`full_tensor`), so a build holds one at a
    time, not a second copy of every layer's weights."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
        elif name == "model.embed_tokens.weight":
            out["embed.weight"] = t
        elif name == "model.norm.weight":
            out["norm.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
    if "lm_head.weight" not in out:
        if not cfg.tie_word_embeddings and "embed.weight" in out:
            raise DraftsmithError(
                "the checkpoint has no lm_head.weight (a base model's weights?) and its "
                "config.json does not set tie_word_embeddings: use the model's ForCausalLM "
                "checkpoint, which holds its head")
        out["lm_head.weight"] = out.get("embed.weight")
    for i in range(cfg.num_layers):
        if i not in layers:
            raise DraftsmithError(f"checkpoint has no weights for decoder layer {i}")
        _fuse_layer(i, layers[i], out)
    if (last := max(layers, default=-1)) >= cfg.num_layers:
        raise DraftsmithError(f"checkpoint has weights for decoder layers up to {last}, but its "
                              f"config says num_hidden_layers {cfg.num_layers}")
    return out


_BASE = re.compile(r"^(embed_tokens\.|norm\.|layers\.\d+\.)")


def with_model_prefix(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A base model's checkpoint (LlamaModel.save_pretrained: no "model." prefix, no lm_head)
    under the causal LM's names, as transformers' from_pretrained adds its base_model_prefix;
    any other checkpoint as it is."""
    if any(n.startswith("model.") for n in hf) or not any(_BASE.match(n) for n in hf):
        return hf
    return {("model." + n if _BASE.match(n) else n): t for n, t in hf.items()}


def _fuse_layer(i: int, w: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    pre, hf = f"layers.{i}.", f"model.layers.{i}."
    for src, dst in _RENAME.items():
        if src in w:
            out[pre + dst] = w[src]
    for dst, srcs in _FUSED.items():
        for kind in ("weight", "bias"):
            names = tuple(f"{s}.{kind}" for s in srcs)
            if kind == "weight" and (lack := [n for n in names if n not in w]):
                raise DraftsmithError(f"decoder layer {i} lacks weight {hf}{lack[0]}")
            if all(n in w for n in names):
                out[f"{pre}{dst}.{kind}"] = Fused(tuple(hf + n for n in names),
                                                  tuple(w[n] for n in names))
            elif any(n in w for n in names):  # refused only where the config builds it
                out[f"{pre}{dst}.{kind}"] = Lacking(tuple(hf + n for n in names if n not in w))


def hf_names(key: str) -> list[str]:
    """The checkpoint (HF) names one of our parameters is formed from, for messages."""
    top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    m = re.match(r"^layers\.(\d+)\.(.+)\.(weight|bias)$", key)
    if not m:
        return [top.get(key, key)]
    pre, module, kind = f"model.layers.{m.group(1)}.", m.group(2), m.group(3)
    if module in _FUSED:
        return [f"{pre}{src}.{kind}" for src in _FUSED[module]]
    ours = {dst: src for src, dst in _RENAME.items()}
    return [pre + ours.get(f"{module}.{kind}", f"{module}.{kind}")]


def full_tensor(t: Full) -> torch.Tensor:
    """A `fuse_hf_names` entry as a tensor (a fused one concatenated now)."""
    return t if isinstance(t, torch.Tensor) else t()


def shard_state(model: nn.Module, full: dict[str, Full],
                convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                ) -> dict[str, torch.Tensor]:
    """Cut each full tensor to this rank's slice, as the module owning it is sharded, and
    `convert` it (to the build's device and dtype) before the next is formed."""
    local: dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        for pname, param in mod.named_parameters(recurse=False):
            key = f"{mname}.{pname}" if mname else pname
            if full.get(key) is None or isinstance(full[key], Lacking):
                lacks = full[key].names if full.get(key) is not None else hf_names(key)
                raise DraftsmithError(
                    f"the checkpoint lacks {', '.join(lacks)}, which its config.json "
                    "asks for: the weights and config.json belong to different models")
            if isinstance(full[key], Fused):
                _check_pieces(full[key], mod, tuple(param.shape))
            whole = full_tensor(full[key])
            mine = _shard_one(mod, pname, whole, key)
            if mine.shape != param.shape:  # config.json and weights disagree
                tp = getattr(mod, "tp", SINGLE)
                rank = f" (this rank's slice of {tp.size})" if tp.size > 1 else ""
                raise DraftsmithError(
                    f"{' + '.join(hf_names(key))}: the checkpoint holds a tensor of shape "
                    f"{tuple(whole.shape)}, where the model that config.json describes takes "
                    f"{tuple(param.shape)}{rank}")
            local[key] = convert(mine)
            del whole, mine
    return local


def _check_pieces(fused: Fused, mod: nn.Module, local: tuple[int, ...]) -> None:
    """Each piece of a fused tensor at the shape the config gives it, named as the checkpoint
    names it: a q_proj of another input width was a torch.cat error, other rows a fused name."""
    parts = getattr(mod, "full_parts", None)
    if parts is None or len(parts) != len(fused.pieces):
        return
    for name, piece, rows in zip(fused.names, fused.pieces, parts, strict=True):
        want = (rows, *local[1:])  # a column-sharded weight keeps its input width whole
        if tuple(piece.shape) != want:
            raise DraftsmithError(
                f"{name}: the checkpoint holds a tensor of shape {tuple(piece.shape)}, where the "
                f"model that config.json describes takes {want}")


def _shard_one(mod: nn.Module, pname: str, t: torch.Tensor, key: str) -> torch.Tensor:
    tp: TP = getattr(mod, "tp", SINGLE)
    if tp.size == 1:
        return t
    if isinstance(mod, ColumnLinear):
        if t.shape[0] != sum(mod.full_parts):
            raise DraftsmithError(f"{key} has {t.shape[0]} rows, expected {sum(mod.full_parts)}")
        parts = t.split(mod.full_parts, dim=0)
        return torch.cat([tp.shard(p, 0) for p in parts])
    if isinstance(mod, RowLinear):
        return tp.shard(t, 1).contiguous() if pname == "weight" else t
    if isinstance(mod, VocabEmbedding | VocabHead):
        return tp.shard_padded(t)
    return t


def build_model(
    cfg: ModelConfig,
    hf_weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: TP = SINGLE,
) -> Transformer:
    """Build on the meta device, then load with assign=True; no weight is initialised twice."""
    with torch.device("meta"):
        model = Transformer(cfg, tp)
    hf_weights = with_model_prefix(hf_weights)  # a base model's names read as its causal LM's
    full = fuse_hf_names(hf_weights, cfg)
    local = shard_state(model, full, lambda t: t.to(device=device, dtype=dtype))
    warn_unread(hf_weights, local)
    model.load_state_dict(local, strict=True, assign=True)
    if cfg.tie_word_embeddings:  # under TP both hold the same vocabulary rows, so one shard serves
        model.lm_head.weight = model.embed.weight
    model.inv_freq = torch.tensor(cfg.inv_freq(), device=device, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


# each layer's RoPE frequencies, which transformers 4.3x saved and every loader computes again
_RECOMPUTED = re.compile(r"\.rotary_emb\.inv_freq$")


def warn_unread(names: Iterable[str], local: dict[str, torch.Tensor]) -> None:
    """One warning line naming the checkpoint's tensors that no parameter is formed from (a
    bias or norm the config does not build): dropped as transformers and the engines drop
    them, but a config.json of another model than the weights' is said, not silent."""
    read = {n for key in local for n in hf_names(key)}
    unread = sorted(n for n in names if n not in read and not _RECOMPUTED.search(n))
    if unread:
        shown = ", ".join(unread[:3]) + (f" (and {len(unread) - 3} more)" if len(unread) > 3
                                         else "")
        warnings.warn(f"the checkpoint holds {len(unread)} tensor(s) that the model its "
                      f"config.json describes has no place for, not read: {shown}; check that "
                      "config.json belongs to these weights", stacklevel=3)
