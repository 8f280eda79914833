"""The EAGLE-3 drafter: fc over three aux hidden states, one decoder layer that reads
concat(norm(embedding), norm(hidden)), a final norm and an lm_head over the draft vocabulary.

Inference contract (used by the speculative engine):
- `fuse(aux)`: [B, T, n_aux, target_hidden] -> [B, T, hidden].
- `forward(tokens, hidden, positions, caches, ...)`: the pair (token x_{t+1}, hidden h_t) sits at
  position t; returns draft-vocab logits and the pre-norm hidden to feed to the next step.
- `to_target(draft_ids)`: draft id -> target id through d2t.
Module names follow SGLang's layout (`fc`, `midlayer`, `norm`, `lm_head`, `d2t`, `t2d`) with q/k/v
and gate/up fused; `hf_state_dict` / `load_hf_state_dict` give the unfused names every engine
reads, and `save_drafter` / `load_drafter` are the draftsmith checkpoint layout.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.jsonfile import read_versioned
from draftsmith.layers import CANONICAL_WORDS
from draftsmith.models import llama, triton_draft_layer, triton_norm_linear
from draftsmith.models.config import ModelConfig
from draftsmith.models.llama import MLP, Attention, KVCache, RMSNorm, causal_mask
from draftsmith.models.parallel import SINGLE, TP, linear
from draftsmith.weightsfile import read_weights_file


def _whole(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


SIZES = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
         "target_hidden_size", "vocab_size", "draft_vocab_size", "max_position_embeddings",
         "num_layers")
# the drafter's norm options, under the names every engine's config uses (train, export, compare)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass(slots=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: list[int]  # canonical: output of decoder layer j; -1 = embedding
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    num_layers: int = 1
    norm_before_residual: bool = False  # residual is hidden_norm(h) instead of h
    norm_before_fc: bool = False  # one RMSNorm over concat(aux) before fc (speculators' name)
    fc_norm: bool = False  # an RMSNorm per aux state before fc (speculators' name)
    norm_output: bool = False  # feed norm(h) back to the next step instead of pre-norm h
    aux_convention: str = CANONICAL_WORDS
    target_fingerprint: str = ""
    target_num_layers: int = 0
    target_source: str = ""  # an HF folder or hub id where known (export writes it as verifier)
    target_architectures: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_kinds()
        if len(self.aux_layer_ids) < 1:
            raise DraftsmithError("an EAGLE-3 drafter needs at least one aux layer id")
        if self.draft_vocab_size > self.vocab_size:
            raise DraftsmithError(
                f"draft_vocab_size {self.draft_vocab_size} > target vocab {self.vocab_size}"
            )
        if self.norm_before_fc and self.fc_norm:
            raise DraftsmithError("norm_before_fc and fc_norm are mutually exclusive")

    def _check_kinds(self) -> None:
        """Sizes whole numbers >= 1 and ids a list of whole numbers: a hand-edited 2.0 or "576"
        was a TypeError traceback from torch when the drafter was built."""
        for name in SIZES:
            v = getattr(self, name)
            if not _whole(v) or v < 1:
                raise DraftsmithError(f"{name} {v!r} is not a size (a whole number >= 1)")
            setattr(self, name, int(v))  # numpy's too, as the JSON it is saved to writes them
        n = self.target_num_layers
        if not _whole(n) or n < 0:
            raise DraftsmithError(f"target_num_layers {n!r} is not a layer count (a whole number "
                                  ">= 1, or 0 where unknown)")
        self.target_num_layers = int(n)
        ids = self.aux_layer_ids
        if not isinstance(ids, (list, tuple)) or not all(_whole(i) for i in ids):
            raise DraftsmithError(f"aux_layer_ids {ids!r} is not a list of whole numbers")
        self.aux_layer_ids = [int(i) for i in ids]
        # ids past target_num_layers are the engine's (`check_pair`) and the doctor's to name
        if bad := [i for i in self.aux_layer_ids if i < -1]:
            raise DraftsmithError(f"aux layer ids {bad} out of range: canonical ids "
                                  f"({CANONICAL_WORDS}) are -1 or more")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            real = isinstance(v, numbers.Real) and not isinstance(v, bool)
            if not real or not math.isfinite(v) or not v > 0:
                raise DraftsmithError(f"{name} {v!r} is not a finite number > 0")
            setattr(self, name, int(v) if _whole(v) else float(v))
        self._check_fields()

    def _check_fields(self) -> None:
        """Flags, texts and objects of their kind: a flag "false" (truthy) built a drafter of
        other numerics without a word, a string rope_scaling was an AttributeError."""
        for name in NORM_FLAGS:
            if not isinstance(v := getattr(self, name), bool):
                raise DraftsmithError(f"{name} {v!r} is not true or false")
        for name in ("aux_convention", "target_fingerprint", "target_source"):
            if not isinstance(v := getattr(self, name), str):
                raise DraftsmithError(f"{name} {v!r} is not a text")
        if self.aux_convention != CANONICAL_WORDS:
            raise DraftsmithError(f"aux_convention {self.aux_convention!r} is not draftsmith's "
                                  f"({CANONICAL_WORDS!r}), so its aux_layer_ids mean other "
                                  "layers; `draftsmith import` converts an engine's ids")
        archs = self.target_architectures
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise DraftsmithError(f"target_architectures {archs!r} is not a list of texts")
        for name in ("rope_scaling", "extra"):
            v = getattr(self, name)
            if not isinstance(v, dict) and not (v is None and name == "rope_scaling"):
                raise DraftsmithError(f"{name} {v!r} is not an object")

    def layer_config(self) -> ModelConfig:
        return ModelConfig(
            arch="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        if not isinstance(d, dict):
            raise DraftsmithError(f"drafter config is a {type(d).__name__}, not an object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise DraftsmithError(f"drafter config has unknown keys {unknown} (a newer "
                                  "draftsmith's drafter, or a hand edit): upgrade draftsmith, "
                                  "or remove them")
        required = [f.name for f in fields(cls) if f.default is MISSING
                    and f.default_factory is MISSING]
        if missing := [k for k in required if k not in d]:
            raise DraftsmithError(f"drafter config lacks the keys {missing}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:  # a value of the wrong kind (a hand edit)
            raise DraftsmithError(f"drafter config: a malformed value ({e})") from None

    @classmethod
    def for_target(
        cls, target: ModelConfig, draft_vocab_size: int, aux_layer_ids: list[int], **over: Any
    ) -> Eagle3Config:
        """A drafter shaped like one layer of the target (the usual choice)."""
        base: dict[str, Any] = dict(
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim, target_hidden_size=target.hidden_size,
            vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids), rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            target_num_layers=target.num_layers,
        )
        base.update(over)
        return cls(**base)


class Eagle3Layer(nn.Module):
    def __init__(self, lc: ModelConfig, first: bool, norm_before_residual: bool, tp: TP) -> None:
        super().__init__()
        h = lc.hidden_size
        self.first = first
        self.norm_before_residual = norm_before_residual
        if first:
            self.hidden_norm = RMSNorm(h, lc.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, lc.rms_norm_eps)
        self.self_attn = Attention(lc, tp, in_dim=2 * h if first else h)
        self.post_attention_layernorm = RMSNorm(h, lc.rms_norm_eps)
        self.mlp = MLP(lc, tp)

    def attn_input(self, emb: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(attention input, residual) for this layer."""
        if not self.first:
            return self.input_layernorm(h), h
        hn = self.hidden_norm(h)
        x = torch.cat([self.input_layernorm(emb), hn], dim=-1)
        return x, hn if self.norm_before_residual else h

    def forward(self, emb, h, cos, sin, cache, slots, mask) -> torch.Tensor:
        x, residual = self.attn_input(emb, h)
        attn = self.self_attn(x, cos, sin, cache, slots, mask)
        if llama.fuses_norms(attn):  # DRAFTSMITH_NORM_LINEAR_ROWS: the add, norm, gate_up, silu
            norm = self.post_attention_layernorm
            act, h = triton_norm_linear.norm_linear(residual, attn, norm.weight, norm.eps,
                                                    self.mlp.gate_up.weight, self.mlp.inter)
            return h + self.mlp.down(act)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    # whether the logits are exactly `lm_head(norm(h))`, so that an engine may apply the head
    # itself (forward(logits=False)); False for a subclass that overrides forward or head,
    # unless it says otherwise (a plain class attribute: compiled code reads it as a constant)
    plain_head: bool = True

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if "plain_head" not in cls.__dict__:
            cls.plain_head = (cls.plain_head and "forward" not in cls.__dict__
                              and "head" not in cls.__dict__)

    def __init__(self, cfg: Eagle3Config, tp: TP = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        lc = cfg.layer_config()
        self.lc = lc
        n = len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(n * cfg.target_hidden_size, eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, eps) for _ in range(n))
            if cfg.fc_norm else None
        )
        self.fc = nn.Linear(n * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(lc, True, cfg.norm_before_residual, tp)
        self.extra_layers = nn.ModuleList(
            Eagle3Layer(lc, False, False, tp) for _ in range(cfg.num_layers - 1)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", torch.tensor(lc.inv_freq()), persistent=False)

    def _apply(self, fn, recurse: bool = True) -> Eagle3Drafter:
        """Casts (`.to(bf16)`, `.half()`) keep RoPE's frequencies in float32."""
        super()._apply(fn, recurse)
        llama.keep_rope_fp32(self, self.lc)
        return self

    @property
    def layers(self) -> list[Eagle3Layer]:
        return [self.midlayer, *self.extra_layers]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def init_weights(self, std: float = 0.02) -> None:
        """HF-style init of the trainable weights (norms to one); uses the global RNG."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "embed_tokens.weight":
                    continue
                if name.endswith("norm.weight") or ".fc_norm." in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n_aux, target_hidden] -> fc input -> [..., hidden]."""
        if self.fc_norm is not None:
            aux = torch.stack([nm(aux[..., i, :]) for i, nm in enumerate(self.fc_norm)], -2)
        x = aux.flatten(-2)
        if self.input_norm is not None:
            x = self.input_norm(x)
        return linear(x.to(self.fc.weight.dtype), self.fc.weight)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.unsqueeze(-1).float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        caches: list[KVCache] | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        at: torch.Tensor | None = None,
        logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [B, Q]; hidden: [B, Q, hidden] (fused or fed back).

        Returns (draft logits [B, Q, draft_vocab], the hidden to feed back [B, Q, hidden]: pre-norm,
        or after the final norm when `norm_output`); with `at` ([B], a prompt pass's last
        positions) only those: [B, 1, ...]. logits=False: the vocabulary head's input (after the
        final norm) in place of the logits, for a caller that applies the head itself.
        Masks and slots behave as in `Transformer.forward`.
        """
        if caches is not None:
            slots = positions if slots is None else slots
            if mask is None:
                mask = causal_mask(positions, caches[0].k.shape[2])
        if triton_draft_layer.takes(self, tokens, hidden, caches, mask):
            h = triton_draft_layer.forward(self, tokens, hidden, positions, caches[0], slots, mask)
        else:
            h = self.layers_forward(tokens, hidden, positions, caches, slots, mask)
        if at is not None:
            h = h[torch.arange(h.shape[0], device=h.device), at].unsqueeze(1)
        return self.head(h, logits)

    def layers_forward(self, tokens, hidden, positions, caches, slots, mask) -> torch.Tensor:
        """The decoder layers' output (pre-norm) for `forward`'s inputs, slots and mask set."""
        emb = self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = self.rope(positions, hidden.dtype)
        if caches is not None:
            groups = self.cfg.num_heads // self.cfg.num_kv_heads
            mask = mask.repeat(1, 1, groups, 1) if groups > 1 else mask
        h = hidden
        for i, layer in enumerate(self.layers):
            cache = caches[i] if caches is not None else None
            h = layer(emb, h, cos, sin, cache, slots, mask)
        return h

    def head(self, h: torch.Tensor, logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm layer output -> (draft logits, or the head's input when not `logits`; hidden
        fed to the next step)."""
        normed = self.norm(h)
        out = linear(normed, self.lm_head.weight) if logits else normed
        return out, normed if self.cfg.norm_output else h

    def head_input(self, fed: torch.Tensor) -> torch.Tensor:
        """The vocabulary head's input from a hidden `head` fed back (the final norm's output,
        which is the fed-back hidden itself under `norm_output`)."""
        return fed if self.cfg.norm_output else self.norm(fed)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def param_groups(self) -> dict[str, int]:
        """Parameter counts under the usual conventions (frozen embedding counted or not)."""
        total = sum(p.numel() for p in self.parameters())
        emb = self.embed_tokens.weight.numel()
        head = self.lm_head.weight.numel()
        return {
            "all": total,
            "trainable": sum(p.numel() for p in self.parameters() if p.requires_grad),
            "without_embedding": total - emb,
            "without_embedding_and_lm_head": total - emb - head,
        }


# Fused draftsmith module names inside a layer -> the unfused names every engine reads.
_FUSED = {
    "self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
}
_RENAMED = {"self_attn.o": "self_attn.o_proj", "mlp.down": "mlp.down_proj"}
FORMAT = "draftsmith-drafter"
FORMAT_VERSION = 1
CONFIG_FILE = "draftsmith.json"
WEIGHTS_FILE = "model.safetensors"


def _layer_prefix(module_name: str) -> tuple[str, str] | None:
    if module_name.startswith("midlayer."):
        return "midlayer.", "midlayer."
    if module_name.startswith("extra_layers."):
        i, _, _ = module_name[len("extra_layers."):].partition(".")
        return f"extra_layers.{i}.", f"layers.{int(i) + 1}."
    return None


def hf_state_dict(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """Unfused names: `fc.weight`, `midlayer.self_attn.q_proj.weight`, ..., extra layers as
    `layers.{i}.*` (i >= 1), `norm.weight`, `lm_head.weight`, `embed_tokens.weight`, d2t, t2d."""
    return {k: v.contiguous() for k, v in _unfused(drafter, drafter.state_dict()).items()}


def hf_shapes(drafter: Eagle3Drafter) -> dict[str, tuple[int, ...]]:
    """`hf_state_dict`'s names and shapes, nothing copied."""
    meta = {k: torch.empty(v.shape, device="meta") for k, v in drafter.state_dict().items()}
    return {k: tuple(v.shape) for k, v in _unfused(drafter, meta).items()}


def _unfused(drafter: Eagle3Drafter, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        names = engine_names(name)
        if len(names) == 1:
            out[names[0]] = t
            continue
        parts = _fused_parts(drafter, name.rpartition(".")[0])
        out.update(zip(names, t.split(parts, dim=0), strict=True))
    return out


def engine_names(name: str) -> list[str]:
    """The unfused engine names one of this module's state-dict entries is saved as."""
    if (pre := _layer_prefix(name)) is None:
        return [name]
    ours, theirs = pre
    mod, _, kind = name[len(ours):].rpartition(".")
    return [f"{theirs}{p}.{kind}" for p in _FUSED.get(mod, (_RENAMED.get(mod, mod),))]


def _fused_parts(drafter: Eagle3Drafter, module_name: str) -> list[int]:
    return list(drafter.get_submodule(module_name).parts)


def fuse_hf_state(hf: dict[str, torch.Tensor], where: str = "drafter weights",
                  ) -> dict[str, torch.Tensor]:
    """The inverse of `hf_state_dict`: unfused engine names -> this module's state-dict names."""
    inverse = {v: k for k, v in _RENAMED.items()}
    piece_of = {p: f for f, parts in _FUSED.items() for p in parts}
    out: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        ours = _hf_layer_to_ours(name)
        if ours is None:
            out[name] = t
            continue
        prefix, mod, kind = ours
        if mod in piece_of:
            pending.setdefault((prefix, piece_of[mod], kind), {})[mod] = t
        else:
            out[f"{prefix}{inverse.get(mod, mod)}.{kind}"] = t
    for (prefix, fused, kind), pieces in pending.items():
        missing = [n for n in _FUSED[fused] if n not in pieces]
        if missing:
            raise DraftsmithError(f"{where}: {prefix}* lacks {missing}")
        out[f"{prefix}{fused}.{kind}"] = torch.cat([pieces[n] for n in _FUSED[fused]])
    return out


def _hf_layer_to_ours(name: str) -> tuple[str, str, str] | None:
    if name.startswith("midlayer."):
        prefix, rest = "midlayer.", name[len("midlayer."):]
    elif name.startswith("layers.") and name.split(".")[1].isdigit():
        i, _, rest = name[len("layers."):].partition(".")
        prefix = "midlayer." if int(i) == 0 else f"extra_layers.{int(i) - 1}."
    else:
        return None
    mod, _, kind = rest.rpartition(".")
    return prefix, mod, kind


def load_hf_state_dict(
    drafter: Eagle3Drafter, hf: dict[str, torch.Tensor], where: str = "weights"
) -> None:
    """Load unfused engine names into `drafter` (strict: every tensor present, shapes equal)."""
    check_tensors(drafter, {k: tuple(v.shape) for k, v in hf.items()}, where)
    state = fuse_hf_state(hf, where)
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    _check_d2t(state["d2t"], drafter.cfg.vocab_size, where)
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.inv_freq = torch.tensor(drafter.lc.inv_freq(), device=drafter.fc.weight.device)


def check_tensors(drafter: Eagle3Drafter, got: dict[str, tuple[int, ...]], where: str) -> None:
    """The shapes `got` by name (engine names, speculators' `layers.0.*` for `midlayer.*`, or
    this module's own fused ones) every tensor of `drafter`, at its shape, and no other; each
    named as the file names it, so a q_proj of another width is neither a torch.cat error nor
    draftsmith's fused `qkv` of a summed shape."""
    engine = hf_shapes(drafter)
    ours = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    keys = {name: _midlayer(name) for name in got}
    wants = {name: engine.get(k, ours.get(k)) for name, k in keys.items()}
    covered = {c for name, k in keys.items() if wants[name] is not None for c in engine_names(k)}
    extra = sorted(name for name, w in wants.items() if w is None)
    if (missing := sorted(set(engine) - covered)) or extra:
        raise DraftsmithError(f"{where}: missing tensors {missing}, unexpected tensors {extra}")
    for name, want in wants.items():
        if tuple(got[name]) != want:
            raise DraftsmithError(f"{where}: {name} has shape {tuple(got[name])}, the config "
                                  f"implies {want}")


def _midlayer(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def _check_d2t(d2t: torch.Tensor, vocab: int, where: str) -> None:
    """Every draft id's target id (id + d2t[id]) inside the config's target vocabulary: one
    outside it drafts ids the target cannot verify (an IndexError, on a GPU a device assert).
    Two draft ids of one target token: a warning (greedy decoding stays exact with them)."""
    from draftsmith.data.vocab import map_problem

    if d2t.is_meta:
        return
    used, problem = map_problem(d2t.cpu(), None, vocab)
    if problem is not None and problem[0] == "outside":
        raise DraftsmithError(f"{where}: d2t: {problem[1]}: another target's mapping (or a "
                              "damaged file); use the drafter made for this target")
    if (pair := shared_target(used)) is not None:
        a, b = pair
        warnings.warn(f"{where}: d2t maps draft ids {a} and {b} to one target id {int(used[a])}: "
                      "greedy decoding with it is exact, but sampled tree or drawn-draft "
                      "decoding refuse it (an engine serving its export samples with the "
                      "same bias); rebuild the draft vocabulary",
                      stacklevel=3)


def shared_target(used: torch.Tensor) -> tuple[int, int] | None:
    """The first two draft ids (lowest target id first) that `used` (each draft id's target
    id) maps to one target id, the lower draft id first; None where every target id is one."""
    ids, order = used.sort(stable=True)
    twice = (ids[1:] == ids[:-1]).nonzero()
    if not twice.numel():
        return None
    i = int(twice[0, 0])
    a, b = int(order[i]), int(order[i + 1])
    return min(a, b), max(a, b)


def build_empty(cfg: Eagle3Config) -> Eagle3Drafter:
    """A drafter on the meta device, to be filled by `load_hf_state_dict` (assign=True)."""
    with torch.device("meta"):
        return Eagle3Drafter(cfg)


def save_drafter(drafter: Eagle3Drafter, folder: str | Path, **summary: Any) -> Path:
    """Write the draftsmith layout: `model.safetensors` and `draftsmith.json`, both staged whole
    under tmp names in the folder and fsynced before either is moved in (`_move_in`), so a write
    that fails (a full disk, ctrl-C) leaves the drafter there before as it was and no tmp file;
    the folder's other files (a training log, checkpoints/) stay."""
    from safetensors.torch import save_file

    from draftsmith.data.atomic import fsync_file
    from draftsmith.options import check_folder

    folder = Path(folder)
    check_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION,
            "config": drafter.cfg.to_dict(), **summary}
    state = {k: v.detach().cpu() for k, v in hf_state_dict(drafter).items()}
    staged = {name: folder / f".{name}.{os.getpid()}.tmp" for name in (WEIGHTS_FILE, CONFIG_FILE)}
    with _removed_on_failure(*staged.values()):
        save_file(state, str(staged[WEIGHTS_FILE]), metadata={"format": "pt"})
        staged[CONFIG_FILE].write_text(json.dumps(meta, indent=1, default=str) + "\n")
        for tmp in staged.values():
            fsync_file(tmp)
        _move_in(staged, folder)
    return folder


def _move_in(staged: dict[str, Path], folder: Path) -> None:
    """The staged files renamed over their namesakes, the weights first; the old config goes
    before them, so no moment (a host crash between two renames) shows new weights beside an
    old config: a folder without one is refused as no drafter, never loaded as a mix. Each
    change fsynced in the folder (a folder's fsync that the file system refuses is skipped)."""
    from draftsmith.data.atomic import fsync_dir

    (folder / CONFIG_FILE).unlink(missing_ok=True)
    fsync_dir(folder)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        os.replace(staged[name], folder / name)
        fsync_dir(folder)


@contextmanager
def _removed_on_failure(*tmps: Path) -> Iterator[None]:
    """A write that fails (a full disk) leaves no tmp file behind; its error goes on."""
    try:
        yield
    except BaseException:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        raise


def read_drafter_meta(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftsmithError(f"{folder}: no such folder (a draftsmith drafter folder)")
    if not (folder / CONFIG_FILE).exists() and (folder / "config.json").is_file():
        raise DraftsmithError(f"{folder}: no {CONFIG_FILE} but a config.json: an engine's layout "
                              "(SGLang/SpecForge/EAGLE or speculators), not a draftsmith drafter; "
                              f"`draftsmith import {folder} --out DIR` converts it")
    meta = read_versioned(folder / CONFIG_FILE, "not a draftsmith drafter folder", FORMAT,
                          FORMAT_VERSION)
    if not isinstance(meta.get("config"), dict):
        raise DraftsmithError(f"{folder / CONFIG_FILE}: no drafter config object")
    _portable_target(meta["config"])
    return meta


def _portable_target(cfg: dict[str, Any]) -> None:
    """A drafter trained before targets were recorded portably names the embedded default by
    its conversion's cache folder (this machine's, gone with the cache): read as "default", so
    export, doctor and training load and record the default anywhere."""
    from draftsmith.targets import DEFAULT_NAME, is_default

    src = cfg.get("target_source")
    if isinstance(src, str) and src not in ("", "default", DEFAULT_NAME) and is_default(src):
        cfg["target_source"] = "default"


def read_drafter_config(folder: str | Path) -> Eagle3Config:
    """The folder's drafter config, checked as far as building the drafter needs (its RoPE
    too); a value refused is named with the file, as compare or --init-from read two. A
    command that checks its --drafter before the target's minutes can call it."""
    folder = Path(folder)
    meta = read_drafter_meta(folder)
    try:
        cfg = Eagle3Config.from_dict(meta["config"])
        cfg.layer_config().inv_freq()
    except DraftsmithError as e:
        raise DraftsmithError(f"{folder / CONFIG_FILE}: {e}") from None
    return cfg


def check_drafter(folder: str | Path) -> Eagle3Config:
    """A drafter folder checked as far as loading it needs, before a target's minutes: its
    config (`read_drafter_config`) and its weights file, present and whole (its header read,
    not its tensors); each refusal one line naming the file (generate, bench, serve, tune,
    compare and doctor)."""
    cfg = read_drafter_config(folder)
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise DraftsmithError(f"{folder}: no {WEIGHTS_FILE} beside its {CONFIG_FILE} (a "
                              "drafter folder copied without its weights?)")
    check_weights_header(path)
    return cfg


def check_weights_header(path: Path) -> None:
    """A safetensors file whose header reads (its tensors are not read), else one line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise DraftsmithError(f"{path}: cannot read its weights (safetensors file: {e}); a "
                              "file cut short, or a Git LFS pointer?") from None


def load_drafter(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    embed: torch.Tensor | None = None,
) -> Eagle3Drafter:
    """Read a draftsmith drafter folder; `embed` supplies the target's embedding if not stored."""
    folder = Path(folder)
    cfg = read_drafter_config(folder)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise DraftsmithError(f"{folder}: no {WEIGHTS_FILE}")
    state = read_weights_file(path, device)
    if dtype is None:
        dtype = _one_dtype(state, path)
    if "embed_tokens.weight" not in state:
        if embed is None:
            raise DraftsmithError(f"{path}: no embed_tokens.weight; pass the target's embedding")
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise DraftsmithError(
                f"{folder / CONFIG_FILE}: made for a target of vocab {cfg.vocab_size} and hidden "
                f"size {cfg.hidden_size}, but the target's embedding is {tuple(embed.shape)}: "
                "another target's drafter (pass the target it was made for)")
        state["embed_tokens.weight"] = embed.to(device)
    if dtype is not None:  # d2t and t2d are ids and a mask, whatever type a file stores them in
        state = {k: v.to(dtype) if v.is_floating_point() and k not in ("d2t", "t2d") else v
                 for k, v in state.items()}
    drafter = build_empty(cfg)
    load_hf_state_dict(drafter, state, str(path))
    return drafter


def _one_dtype(state: dict[str, torch.Tensor], path: Path) -> torch.dtype | None:
    """The dtype most of a file's float weights have, where they have several (None where one):
    a file of fp16 fc and fp32 rest (an imported engine folder keeps its own) loaded, then
    failed its first forward in a matmul. Said once, as the weights are cast to it."""
    kinds: dict[torch.dtype, list[str]] = {}
    for k, v in state.items():
        if v.is_floating_point() and k not in ("d2t", "t2d"):
            kinds.setdefault(v.dtype, []).append(k)
    if len(kinds) < 2:
        return None
    most = max(kinds, key=lambda t: len(kinds[t]))
    odd = [f"{k} {str(t).removeprefix('torch.')}" for t in kinds if t != most for k in kinds[t]]
    warnings.warn(f"{path}: float tensors in several dtypes ({', '.join(odd[:3])}"
                  f"{', ...' if len(odd) > 3 else ''}); loaded as the rest, "
                  f"{str(most).removeprefix('torch.')}", stacklevel=3)
    return most
