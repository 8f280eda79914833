"""Training internals, review 5: the TTT loss against a plain reimplementation of EAGLE-3's
reference (SafeAILab/EAGLE eagle/traineagle3/cnets.py `Model.forward`, main.py's 0.8^i sum),
and the loss under bf16 autocast against float32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_drafter import random_drafter, tiny_cfg

from draftsmith.models.eagle3 import Eagle3Drafter, hf_state_dict
from draftsmith.train.loop import TTTModel
from draftsmith.train.objective import chain_counts, make_targets, summarize

STEPS, DECAY = 4, 0.8


def _pad(x: torch.Tensor) -> torch.Tensor:
    """cnets.py's `padding(x, left=False)`: x[:, t + 1] at t, zero at the end."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, -1:])], dim=1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, H, T, D] at positions pos [T]; halves rotated as LlamaRotaryEmbedding does."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[:, None].float() * inv] * 2, -1)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * emb.cos() + half * emb.sin()


def _midlayer(w, cfg, emb, hidden, idx, cache, causal):
    """LlamaDecoderLayeremb + LlamaAttention with cache_hidden: step idx's queries against
    step 0's keys (causal) and each later step's key at the query's own index."""
    b, t, _ = hidden.shape
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    m = "midlayer."
    x = torch.cat([_rms(emb, w[m + "input_layernorm.weight"], eps),
                   _rms(hidden, w[m + "hidden_norm.weight"], eps)], -1)

    def proj(name: str, heads: int) -> torch.Tensor:
        y = x @ w[f"{m}self_attn.{name}_proj.weight"].T
        return y.view(b, t, heads, hd).transpose(1, 2)

    pos = torch.arange(t) + idx
    q, k = _rope(proj("q", nh), pos, cfg.rope_theta), _rope(proj("k", nkv), pos, cfg.rope_theta)
    rep = nh // nkv
    cache[0].append(k.repeat_interleave(rep, 1))
    cache[1].append(proj("v", nkv).repeat_interleave(rep, 1))
    scores = [q @ cache[0][0].transpose(2, 3) / math.sqrt(hd) + causal]
    scores += [((q * ki).sum(-1) / math.sqrt(hd))[..., None] for ki in cache[0][1:]]
    p = torch.softmax(torch.cat(scores, -1), -1)
    out = p[..., :t] @ cache[1][0]
    for i, vi in enumerate(cache[1][1:], 1):
        out = out + p[..., t + i - 1, None] * vi
    h = hidden + out.transpose(1, 2).reshape(b, t, nh * hd) @ w[m + "self_attn.o_proj.weight"].T
    y = _rms(h, w[m + "post_attention_layernorm.weight"], eps)
    act = F.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)
    return h + act @ w[m + "mlp.down_proj.weight"].T


def reference_ttt(w, cfg, input_ids, aux, target_logits, loss_mask, steps):
    """cnets.py's `Model.forward` after `dataprepare`, on unfused weights `w`. Returns per step
    (sum of position_mask * soft CE, position_mask.sum(), acc as the reference logs it)."""
    b, t = input_ids.shape
    hidden = aux.flatten(-2) @ w["fc.weight"].T
    input_ids, target = _pad(input_ids), _pad(target_logits)
    mask = loss_mask[..., None].float()
    causal = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
    t2d, cache, out = w["t2d"], ([], []), []
    for idx in range(steps):
        emb = w["embed_tokens.weight"][input_ids]
        hidden = _midlayer(w, cfg, emb, hidden, idx, cache, causal)
        logits = _rms(hidden, w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].T
        position_mask = t2d[target.argmax(-1)][..., None].float() * mask
        target_p = torch.softmax(target[..., t2d].float(), 2)
        plogp = target_p * torch.log_softmax(logits.float(), 2)
        hits = (logits.argmax(-1) == target_p.argmax(-1)) * position_mask.squeeze(-1)
        out.append((-(position_mask * plogp).sum(), position_mask.sum(),
                    (hits.sum() / mask.sum()).item()))
        input_ids, target, mask = _pad(input_ids), _pad(target), _pad(mask)
    return out


def _case(seed: int = 11):
    """Two one-document rows; loss_mask[t] marks answer tokens (prompt first, then answer)."""
    d = random_drafter(tiny_cfg(), seed=0)
    cfg = d.cfg
    g = torch.Generator().manual_seed(seed)
    b, t, ht = 2, 14, 16
    x = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, 3, cfg.target_hidden_size, generator=g)
    head, hidden = torch.randn(cfg.vocab_size, ht, generator=g), torch.randn(b, t, ht, generator=g)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    loss_mask[0, 4:], loss_mask[1, 2:11] = True, True
    return d, x, aux, head, hidden, loss_mask


def _ours(d: Eagle3Drafter, x, aux, head, hidden, loss_mask, steps=STEPS):
    b, t = x.shape
    used = d.t2d.nonzero().flatten()
    doc, positions = torch.zeros(b, t, dtype=torch.long), torch.arange(t).expand(b, t)
    tg = make_targets(hidden, head, used, loss_mask, doc)
    model = TTTModel(d, steps, DECAY)
    return model(x, aux, positions, doc, tg.prob, tg.label, tg.ok)


def test_ttt_loss_accuracy_and_gradients_equal_eagle3s_reference():
    """Each step's soft cross-entropy (per counted position), the 0.8^j total, the logged acc
    and every trainable weight's gradient equal the reference's. The reference weighs
    position t of step j by loss_mask[t + j] (its data's mask sits two tokens ahead of the
    predicted token's); draftsmith by whether the predicted token x[t + j + 2] is an answer
    token, so the reference is given the mask shifted by two."""
    d, x, aux, head, hidden, loss_mask = _case()
    d.train()
    total, losses, correct, valid = _ours(d, x, aux, head, hidden, loss_mask)
    total.backward()

    w = {k: v.detach().clone().requires_grad_(v.is_floating_point() and k != "embed_tokens.weight")
         for k, v in hf_state_dict(d).items()}
    ref_mask = _pad(_pad(loss_mask.float())).bool()
    ref = reference_ttt(w, d.cfg, x, aux, hidden @ head.T, ref_mask, STEPS)
    assert all(n > 0 for _, n, _ in ref)  # every step scores something
    per_step = torch.stack([s / n for s, n, _ in ref])
    assert torch.allclose(losses, per_step.detach(), rtol=1e-5, atol=1e-6)
    ref_total = sum(DECAY**j * v for j, v in enumerate(per_step))
    assert torch.allclose(total.detach(), ref_total.detach(), rtol=1e-5)
    acc = summarize(chain_counts(correct, valid))["acc"]
    assert acc == pytest.approx([a for _, _, a in ref], abs=1e-6)

    ref_total.backward()
    grads = {n: p.grad for n, p in d.named_parameters() if p.requires_grad}
    at = "midlayer.self_attn."
    pairs = {
        "fc.weight": w["fc.weight"].grad,
        "lm_head.weight": w["lm_head.weight"].grad,
        "norm.weight": w["norm.weight"].grad,
        at + "qkv.weight": torch.cat([w[f"{at}{n}_proj.weight"].grad for n in "qkv"]),
        at + "o.weight": w[at + "o_proj.weight"].grad,
        "midlayer.mlp.gate_up.weight": torch.cat(
            [w[f"midlayer.mlp.{n}_proj.weight"].grad for n in ("gate", "up")]),
        "midlayer.mlp.down.weight": w["midlayer.mlp.down_proj.weight"].grad,
        "midlayer.hidden_norm.weight": w["midlayer.hidden_norm.weight"].grad,
    }
    for name, want in pairs.items():
        assert torch.allclose(grads[name], want, rtol=1e-4, atol=1e-6), name
    assert "embed_tokens.weight" not in grads  # frozen, as the reference's


def test_ttt_loss_under_bf16_autocast_is_the_float32_loss_within_bf16_rounding():
    """--bf16 trains under autocast, its targets from the bf16 head and the bf16 states shards
    hold: each step's loss within a few bf16 ulps of float32's, the statistics on the same
    positions."""
    d, x, aux, head, hidden, loss_mask = _case(seed=12)
    with torch.no_grad():
        want = _ours(d, x, aux, head, hidden, loss_mask)
        with torch.autocast("cpu", torch.bfloat16):
            got = _ours(d, x, aux, head.bfloat16(), hidden.bfloat16(), loss_mask)
    assert got[0].dtype == torch.float32 and torch.isfinite(got[1]).all()
    assert torch.allclose(got[1], want[1], rtol=0.01)
    assert torch.equal(got[3], want[3])
    agree = (got[2] == want[2]).float().mean()
    assert agree > 0.9
