"""One config-driven decoder for the Llama family (Llama, Qwen2, Qwen3, Mistral).

The KV cache is addressed by slot: `slots[b, q]` is where token q of sequence b writes its
K/V; by default slot == position. Attention reads the whole static cache under a boolean mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models import triton_attention, triton_norm_linear
from draftsmith.models.config import ModelConfig
from draftsmith.models.parallel import (
    SINGLE,
    TP,
    ColumnLinear,
    RowLinear,
    VocabEmbedding,
    VocabHead,
)
from draftsmith.switches import env_choice, env_count


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF's LlamaRMSNorm: the normed rows rounded to x's dtype before the weight
        # multiplies them (two roundings in bf16; one moved hidden states by an ulp from HF's).
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return (self.weight * normed).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, Q, H, D]; cos/sin: [B, Q, 1, D]
    return x * cos + rotate_half(x) * sin


class KVCache(NamedTuple):
    k: torch.Tensor  # [B, Hkv, S, D]
    v: torch.Tensor


# Graphed one-token steps of at most this many rows attend with plain reductions when compiled:
# inductor fuses them into a few short kernels, where an SDPA kernel costs ~10 us a layer at
# decode shapes (H200 profile, benchmarks/decode_kernels.md). Verify shapes (2-16 tokens a row)
# were slower that way (a verify of 8 tokens 2.8 ms against 1.5 ms for 2, speculative_default.md;
# H200 run 16: a 25-token tree verify 2.66 ms against 1.15 the matmul way).
SMALL_ATTENTION_ROWS = env_count("DRAFTSMITH_SMALL_ATTENTION_ROWS", "16")
# Graphed multi-token steps (verify: 2-64 tokens a row) attend as two batched GEMMs around one
# fused masked softmax ("matmul"), or with SDPA ("sdpa": cuDNN on the H200, ~12.5 us a layer
# with its prep kernels). H200 run 5, same process A/B/A: verify 1.46 -> 1.13 ms at batch 1,
# decode-only speedup 1.20x -> 1.53x (tree 3/4/8), batch 8 0.98x -> 1.25x
# (benchmarks/speculative_default.md).
# FlexAttention (the tree mask as a score mod over 128-key blocks) lost at these shapes: H200
# run 17, fresh caches, batch 1, tree 7/4/24: verify 1.79 ms against 1.16, 16.3 kernels a layer
# against 14.3 (its template, two reductions and pointwise prep), and the fused draft phase
# failed to compile around it.
# "triton" (the default where Triton is): `triton_attention.cache_attention`, the query heads
# read in the projection's layout, the cache split over programs in 64-key chunks and joined by
# a second kernel, the output written as the o projection reads it. H200 run 20, same call,
# fresh caches, tree 7/4/24, batch 1, chat: verify 0.958 against 1.151 ms the matmul way, draft
# 0.468 against 0.495, decode-only speedup 2.22x against 1.89x. Unsplit (one program taking the
# whole cache) it gained nothing there (verify 1.156 against 1.155 ms).
VERIFY_ATTENTION = env_choice("DRAFTSMITH_VERIFY_ATTENTION",
                              "triton" if triton_attention.AVAILABLE else "matmul",
                              ("matmul", "sdpa", "triton"))
# The most tokens a row that attend the "matmul" way. Run 9 verified 40-token trees through
# SDPA, past the old limit of 32: 1.54 ms against 1.17 ms for 32 tokens the matmul way.
MATMUL_ATTENTION_TOKENS = env_count("DRAFTSMITH_MATMUL_ATTENTION_TOKENS", "64")
# Graphed one-token steps (every baseline decode step): "small" (three reductions, each
# autotuned by inductor at run time) or "matmul" (the two products as cuBLAS GEMVs, only the
# softmax autotuned). H200 run 10's baseline ran 13 % slower than runs 4-9 with unchanged code;
# "matmul" is the A/B for it.
# "triton" (the default where Triton is): the verify's Triton kernel at one token, split over
# the cache: 4.13 us a layer against small's 6.77 alone (H200 run 21, 400 slots). H200 run 22,
# one call, fresh caches, batch 1, chat: baseline decode 1,264 against 1,158 tok/s (0.791
# against 0.864 ms a token), the speculative decode unchanged (2,584 against 2,590).
DECODE_ATTENTION = env_choice("DRAFTSMITH_DECODE_ATTENTION",
                              "triton" if triton_attention.AVAILABLE else "small",
                              ("small", "matmul", "triton"))


if "triton" in (VERIFY_ATTENTION, DECODE_ATTENTION) and not triton_attention.AVAILABLE:
    raise DraftsmithError("DRAFTSMITH_VERIFY_ATTENTION or DRAFTSMITH_DECODE_ATTENTION=triton "
                          "needs the triton package (and torch >= 2.6)")


def uses_triton(q_len: int) -> bool:
    """Whether a graphed step of q_len tokens a row attends through the Triton kernel."""
    if q_len == 1:
        return DECODE_ATTENTION == "triton"
    return VERIFY_ATTENTION == "triton" and q_len <= MATMUL_ATTENTION_TOKENS


def small_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) | mask) v in float32, written as reductions (no matmul).
    q: [B, H, Q, D]; k, v: [B, H, S, D]; mask: [B, 1 or H, Q, S] bool."""
    s = (q.float().unsqueeze(-2) * k.float().unsqueeze(-3)).sum(-1) * q.shape[-1] ** -0.5
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p.unsqueeze(-1) * v.float().unsqueeze(-3)).sum(-2).to(q.dtype)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) | mask) v as two matmuls in the inputs' dtype around a float32
    softmax. q: [B, H, Q, D]; k, v: [B, H, S, D]; mask: [B, 1 or H, Q, S] bool."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(p.to(v.dtype), v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP = SINGLE, in_dim: int | None = None) -> None:
        super().__init__()
        d = cfg.head_dim
        self.heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")
        self.d = d
        qkv = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
        self.qkv = ColumnLinear(in_dim or cfg.hidden_size, qkv, cfg.attention_bias, tp)
        o_bias = cfg.attention_bias and cfg.arch != "qwen2"  # Qwen2 biases q, k and v alone
        self.o = RowLinear(cfg.num_heads * d, cfg.hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        slots: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.attend(self.qkv(x), cos, sin, cache, slots, mask)

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        slots: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention from the qkv projection's output on: RoPE, cache writes, o."""
        b, q_len, _ = qkv.shape
        q, k, v = qkv.split(
            [self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], dim=-1
        )
        q = q.view(b, q_len, self.heads, self.d)
        k = k.view(b, q_len, self.kv_heads, self.d)
        v = v.view(b, q_len, self.kv_heads, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
        else:
            rows = torch.arange(b, device=qkv.device).unsqueeze(1).expand(b, q_len)
            cache.k[rows, :, slots] = k
            cache.v[rows, :, slots] = v
            graphed = qkv.is_cuda and torch.compiler.is_compiling()
            if graphed and uses_triton(q_len) and triton_attention.fits(q, cache.k, mask):
                return self.o(triton_attention.cache_attention(q, cache.k, cache.v, mask))
            # Query heads sharing a KV head become extra query rows: no K/V copy, any kernel.
            g = self.heads // self.kv_heads
            qg = q.transpose(1, 2).reshape(b, self.kv_heads, g * q_len, self.d)
            one = q_len == 1 and b <= SMALL_ATTENTION_ROWS
            if graphed and one and DECODE_ATTENTION != "matmul":  # triton's fallback too
                out = small_attention(qg, cache.k, cache.v, mask)
            elif graphed and (one or VERIFY_ATTENTION in ("matmul", "triton") and 1 < q_len
                              <= MATMUL_ATTENTION_TOKENS):
                out = matmul_attention(qg, cache.k, cache.v, mask)
            else:
                out = F.scaled_dot_product_attention(qg, cache.k, cache.v, attn_mask=mask)
            out = out.reshape(b, self.heads, q_len, self.d)
        return self.o(out.transpose(1, 2).reshape(b, q_len, self.heads * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP = SINGLE) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.inter = tp.split(inter, "intermediate_size")
        self.gate_up = ColumnLinear(cfg.hidden_size, [inter, inter], False, tp)
        self.down = RowLinear(inter, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP = SINGLE) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, tp)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, h, cos, sin, cache, slots, mask) -> torch.Tensor:
        h, delta = self.split(h, None, cos, sin, cache, slots, mask)
        return h + delta

    def split(self, h, delta, cos, sin, cache, slots, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with its last residual add left to the caller: h + delta enters, and the
        stream leaving is the sum of the pair returned. The next layer (or the final norm) does
        that add in the kernel of its own norm, one launch less a layer when compiled."""
        if self.fused(h):  # DRAFTSMITH_NORM_LINEAR_ROWS: each norm inside its linear
            fuse, norm1, norm2 = triton_norm_linear.norm_linear, self.input_norm, self.post_norm
            qkv, h = fuse(h, delta, norm1.weight, norm1.eps, self.attn.qkv.weight)
            attn = self.attn.attend(qkv, cos, sin, cache, slots, mask)
            act, h = fuse(h, attn, norm2.weight, norm2.eps, self.mlp.gate_up.weight,
                          self.mlp.inter)
            return h, self.mlp.down(act)
        if delta is not None:
            h = h + delta
        h = h + self.attn(self.input_norm(h), cos, sin, cache, slots, mask)
        return h, self.mlp(self.post_norm(h))

    def fused(self, h: torch.Tensor) -> bool:
        """Whether this step's norms run inside the linears after them (`fuses_norms`; a qkv
        bias keeps them apart)."""
        return self.attn.qkv.bias is None and fuses_norms(h)


def fuses_norms(h: torch.Tensor) -> bool:
    """Whether a step's norms run inside the linears after them: compiled CUDA code (graphed
    steps) of the rows `triton_norm_linear.fits` takes, without autograd (the kernel has no
    backward; training keeps the plain layer)."""
    return (h.is_cuda and torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and triton_norm_linear.fits(h.shape[0] * h.shape[1]))


class ForwardOut(NamedTuple):
    logits: torch.Tensor | None  # [B, Q or 1, V]
    aux: torch.Tensor | None  # [B, Q, n_aux, H]: residual stream at the canonical aux ids
    hidden: torch.Tensor  # [B, Q, H]: final hidden state after the final norm


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = VocabHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq()), persistent=False)
        self.compiled: dict = {}  # torch.compile'd parts, used only where `compiled=True`

    def _apply(self, fn, recurse: bool = True) -> Transformer:
        """Casts (`.to(bf16)`, `.half()`) keep RoPE's frequencies in float32."""
        super()._apply(fn, recurse)
        keep_rope_fp32(self, self.cfg)
        return self

    def prologue(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        num_slots: int,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """Embedding, RoPE tables and the attention masks (grouped for GQA) for one forward:
        the mask, and where the sliding window applies to some layers only, the windowed
        layers' own (None otherwise: every layer attends under the mask)."""
        h = self.embed(tokens)
        cos, sin = self.rope(positions, h.dtype)
        window = self.cfg.sliding_window
        some = self.cfg.window_layers is not None
        windowed = None
        if num_slots:
            if mask is None:
                mask = causal_mask(positions, num_slots, None if some else window)
                windowed = causal_mask(positions, num_slots, window) if some else None
            groups = self.cfg.num_heads // self.cfg.num_kv_heads
            if groups > 1:
                mask = mask.repeat(1, 1, groups, 1)
                windowed = None if windowed is None else windowed.repeat(1, 1, groups, 1)
        elif mask is None and window:  # causal over the Q tokens, as is_causal would be
            q = tokens.shape[1]
            banded = causal_mask(torch.arange(q, device=tokens.device).view(1, q), q, window)
            mask, windowed = (None, banded) if some else (banded, None)
        return h, cos, sin, mask, windowed

    def parts(self, compiled: bool, rows: int, step: bool = False) -> dict:
        """The prologue, layer splits and finish a forward of `rows` token rows runs (step: one
        token a row): eager, or the compiled ones (`compiled_for`)."""
        if compiled and self.compiled:
            return self.compiled_for(rows, step)
        return {"prologue": self.prologue, "layers": [layer.split for layer in self.layers],
                "finish": self.finish, "aux": self.stack_aux}

    def compiled_for(self, rows: int, step: bool = False) -> dict:
        """The compiled parts for a forward of `rows` token rows: past the runtime's pin limit
        (`compiled["over"]`: (limit, parts)) a second set compiled unpinned, or, for a one-token
        step, its batch size's own set (`compiled["step"]`: (make, {rows: parts}))."""
        over = self.compiled.get("over")
        if not over or rows <= over[0]:
            return self.compiled
        if step and "step" in self.compiled:
            make, sets = self.compiled["step"]
            if rows not in sets:
                sets[rows] = make()
            return sets[rows]
        return over[1]

    def check_mask(self, tokens: torch.Tensor, caches: list[KVCache] | None,
                   mask: torch.Tensor | None) -> None:
        """A caller's mask over the tokens alone serves every layer: where the window applies to
        some layers only, it cannot serve both kinds once the tokens outrun the window."""
        window = self.cfg.sliding_window
        if (caches is None and mask is not None and self.cfg.window_layers is not None
                and tokens.shape[1] > window):
            raise DraftsmithError(
                f"the target windows {len(self.cfg.window_layers)} of its {self.cfg.num_layers} "
                f"layers over {window} tokens: a masked forward of {tokens.shape[1]} tokens "
                "would window them all; keep sequences within the window")

    def finish(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The last layer's residual add and the final norm (one kernel when compiled)."""
        return self.norm(h if delta is None else h + delta)

    def stack_aux(self, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        """[B, Q, n_aux, H] from each aux layer's residual stream as (h, pending add or None):
        one kernel when compiled, where eager adds and a stack took four in a verify."""
        return torch.stack([h if d is None else h + d for h, d in pairs], dim=2)

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.unsqueeze(-1).float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        caches: list[KVCache] | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        aux_ids: tuple[int, ...] = (),
        logits_at: torch.Tensor | None = None,
        want_logits: bool = True,
        compiled: bool = False,
    ) -> ForwardOut:
        """tokens, positions: [B, Q]. Without caches, attention is causal over Q alone.

        mask: [B, 1, Q, S] bool (True = attend). With caches and no mask, token q of row b
        attends to slots <= positions[b, q]. Without caches, a mask is [B, 1, Q, Q].
        logits_at: [B] index of the one position per row whose logits are wanted (prefill);
        None gives all positions. compiled: run the torch.compile'd parts (for shapes that are
        captured into CUDA graphs).
        """
        parts = self.parts(compiled, tokens.numel(), tokens.shape[1] == 1)
        num_slots = caches[0].k.shape[2] if caches is not None else 0
        self.check_mask(tokens, caches, mask)
        h, cos, sin, mask, windowed = parts["prologue"](tokens, positions, num_slots, mask)
        if caches is not None and slots is None:
            slots = positions
        want: dict[int, list[int]] = {}  # a layer's places: an imported drafter may repeat one
        for i, j in enumerate(aux_ids):
            want.setdefault(j, []).append(i)
        aux: list = [None] * len(aux_ids)  # (stream, its pending add) per aux id
        for i in want.get(-1, ()):
            aux[i] = (h, None)
        delta = None
        pairs = parts["aux"] != self.stack_aux  # compiled: the adds in the stack's kernel
        for j, layer in enumerate(parts["layers"]):
            cache = caches[j] if caches is not None else None
            m = windowed if windowed is not None and self.cfg.windowed(j) else mask
            h, delta = layer(h, delta, cos, sin, cache, slots, m)
            if j in want:  # eager: added at once, one tensor kept a layer (doctor asks for all)
                pair = (h, delta) if pairs else (h + delta, None)
                for i in want[j]:
                    aux[i] = pair
        hidden = parts["finish"](h, delta)
        logits = None
        if want_logits:
            x = hidden
            if logits_at is not None:
                x = hidden[torch.arange(hidden.shape[0], device=h.device), logits_at].unsqueeze(1)
            logits = self.lm_head(x)
        stacked = parts["aux"](aux) if aux_ids else None
        return ForwardOut(logits, stacked, hidden)


def keep_rope_fp32(module: nn.Module, cfg: ModelConfig) -> None:
    """A module's `inv_freq` back in float32 after a cast: in bf16 each frequency was rounded by
    up to 0.4 %, a rotation a radian off by position 500 (a drafter loaded `.to(device, bf16)`
    by doctor and compare)."""
    inv = module.inv_freq
    if inv.dtype != torch.float32:
        module.inv_freq = torch.tensor(cfg.inv_freq(), device=inv.device)


def causal_mask(positions: torch.Tensor, num_slots: int, window: int | None = None,
                ) -> torch.Tensor:
    """[B, 1, Q, S]: slot s (holding position s) seen from each position; with a sliding window,
    only the `window` latest (HF's `kv > q - window`)."""
    slots = torch.arange(num_slots, device=positions.device).view(1, 1, -1)
    pos = positions.unsqueeze(-1)
    seen = slots <= pos
    if window:
        seen = seen & (slots > pos - window)
    return seen.unsqueeze(1)
