"""Training-time test (TTT): k unrolled drafter steps over whole packed rows at once.

Step j at index t reads token x_{t+j+1} and, for j = 0, the fused aux state g_t, else the
hidden the drafter itself produced at index t in step j-1; its rope position is pos(t) + j.
Its queries see step-0 keys at indices s <= t of the same document and the keys of steps
1..j at index t only: what a chain drafted from position t sees at inference. K/V of all steps
are concatenated and masked explicitly (no in-place cache writes under autograd).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from draftsmith.models.eagle3 import Eagle3Drafter, Eagle3Layer
from draftsmith.models.llama import apply_rope

KV = tuple[list[torch.Tensor], list[torch.Tensor]]


def shift_left(x: torch.Tensor, n: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x[:, t + n] at index t along dim 1, `fill` past the end."""
    if n == 0:
        return x
    n = min(n, x.shape[1])  # a row narrower than the shift is all fill (a short batch)
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def doc_causal_mask(doc: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[B, 1, T, T] bool: causal within each document; doc [B, T] ids, -1 = padding. With a
    sliding window (the target's), a token sees only the `window` latest of its document."""
    t = doc.shape[1]
    idx = torch.arange(t, device=doc.device)
    causal = (idx.view(1, 1, t) <= idx.view(1, t, 1)) & (doc.unsqueeze(2) == doc.unsqueeze(1))
    if window:  # a document's tokens are contiguous: index gaps are position gaps
        causal &= idx.view(1, 1, t) > idx.view(1, t, 1) - window
    return (causal | torch.eye(t, dtype=torch.bool, device=doc.device)).unsqueeze(1)


def ttt_mask(doc: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, 1, T, steps*T] bool: block 0 causal within a document, blocks 1.. the diagonal."""
    b, t = doc.shape
    eye = torch.eye(t, dtype=torch.bool, device=doc.device).expand(b, 1, t, t)
    return torch.cat([doc_causal_mask(doc), *[eye] * (steps - 1)], dim=3)


def layer_step(
    layer: Eagle3Layer,
    emb: torch.Tensor,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: KV,
    mask: torch.Tensor,
) -> torch.Tensor:
    """One drafter layer for one TTT step; appends this step's K/V to `kv`."""
    x, residual = layer.attn_input(emb, h)
    attn = layer.self_attn
    b, t, _ = x.shape
    sizes = [attn.heads * attn.d, attn.kv_heads * attn.d, attn.kv_heads * attn.d]
    q, k, v = attn.qkv(x).split(sizes, dim=-1)
    q = q.view(b, t, attn.heads, attn.d)
    k = k.view(b, t, attn.kv_heads, attn.d)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv[0].append(k.transpose(1, 2))
    kv[1].append(v.view(b, t, attn.kv_heads, attn.d).transpose(1, 2))
    keys, values = torch.cat(kv[0], dim=2), torch.cat(kv[1], dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
    )
    h = residual + attn.o(out.transpose(1, 2).reshape(b, t, attn.heads * attn.d))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def unroll(
    drafter: Eagle3Drafter,
    tokens: torch.Tensor,
    fused: torch.Tensor,
    positions: torch.Tensor,
    doc: torch.Tensor,
    steps: int,
) -> Iterator[torch.Tensor]:
    """Yield the draft-vocab logits [B, T, DV] of steps 0..steps-1.

    tokens: [B, T] the row's token ids x_t; fused: [B, T, hidden] = drafter.fuse(aux);
    positions: [B, T] position of index t in its document; doc: [B, T] document ids.
    """
    full_mask = ttt_mask(doc, steps)
    t = tokens.shape[1]
    kvs: list[KV] = [([], []) for _ in drafter.layers]
    h = fused
    for j in range(steps):
        emb = drafter.embed_tokens(shift_left(tokens, j + 1)).to(h.dtype)
        cos, sin = drafter.rope(positions + j, h.dtype)
        mask = full_mask[..., : (j + 1) * t]
        for layer, kv in zip(drafter.layers, kvs, strict=True):
            h = layer_step(layer, emb, h, cos, sin, kv, mask)
        logits, h = drafter.head(h)
        yield logits
