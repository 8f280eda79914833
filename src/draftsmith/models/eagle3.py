"""The EAGLE-3 drafter: fc over three aux hidden states, one decoder layer that reads
concat(norm(embedding), norm(hidden)), a final norm and an lm_head over the draft vocabulary.

Inference contract (used by the speculative engine):
- `fuse(aux)`: [B, T, n_aux, target_hidden] -> [B, T, hidden].
- `forward(tokens, hidden, positions, caches, ...)`: the pair (token x_{t+1}, hidden h_t) sits at
  position t; returns draft-vocab logits and the pre-norm hidden to feed to the next step.
- `to_target(draft_ids)`: draft id -> target id through d2t.
Parameter names follow SGLang's layout (`fc`, `midlayer`, `norm`, `lm_head`, `d2t`, `t2d`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.layers import CANONICAL_WORDS
from draftsmith.models.config import ModelConfig
from draftsmith.models.llama import MLP, Attention, KVCache, RMSNorm, causal_mask
from draftsmith.models.parallel import SINGLE, TP


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
    norm_before_fc: bool = False  # RMSNorm each aux state before fc
    aux_convention: str = CANONICAL_WORDS
    target_fingerprint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) < 1:
            raise DraftsmithError("an EAGLE-3 drafter needs at least one aux layer id")
        if self.draft_vocab_size > self.vocab_size:
            raise DraftsmithError(
                f"draft_vocab_size {self.draft_vocab_size} > target vocab {self.vocab_size}"
            )

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
        return cls(**d)

    @classmethod
    def for_target(
        cls, target: ModelConfig, draft_vocab_size: int, aux_layer_ids: list[int], **over: Any
    ) -> Eagle3Config:
        """A drafter shaped like one layer of the target (the usual choice)."""
        base = dict(
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim, target_hidden_size=target.hidden_size,
            vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids), rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
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
        h = residual + self.self_attn(x, cos, sin, cache, slots, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config, tp: TP = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        lc = cfg.layer_config()
        self.lc = lc
        n = len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.aux_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(n))
            if cfg.norm_before_fc else None
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

    @property
    def layers(self) -> list[Eagle3Layer]:
        return [self.midlayer, *self.extra_layers]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        if self.aux_norm is not None:
            aux = torch.stack([nm(aux[..., i, :]) for i, nm in enumerate(self.aux_norm)], -2)
        return self.fc(aux.flatten(-2).to(self.fc.weight.dtype))

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [B, Q]; hidden: [B, Q, hidden] (fused or fed back).

        Returns (draft logits [B, Q, draft_vocab], pre-norm hidden [B, Q, hidden]).
        Masks and slots behave as in `Transformer.forward`.
        """
        emb = self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = self.rope(positions, hidden.dtype)
        if caches is not None:
            slots = positions if slots is None else slots
            if mask is None:
                mask = causal_mask(positions, caches[0].k.shape[2])
            groups = self.cfg.num_heads // self.cfg.num_kv_heads
            mask = mask.repeat(1, 1, groups, 1) if groups > 1 else mask
        h = hidden
        for i, layer in enumerate(self.layers):
            cache = caches[i] if caches is not None else None
            h = layer(emb, h, cos, sin, cache, slots, mask)
        return self.lm_head(self.norm(h)), h

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
