"""The EAGLE-3 drafter against a forward written out by hand; state names and checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    hf_state_dict,
    load_drafter,
    load_hf_state_dict,
    save_drafter,
)
from draftsmith.models.llama import KVCache


def tiny_cfg(**over) -> Eagle3Config:
    base = dict(hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                target_hidden_size=24, vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 2, 4],
                rms_norm_eps=1e-6, rope_theta=1000.0, target_num_layers=6)
    base.update(over)
    return Eagle3Config(**base)


def random_drafter(cfg: Eagle3Config, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.2) + (p.dim() == 1))
    used = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    d.set_vocab(used - torch.arange(cfg.draft_vocab_size), t2d)
    return d.eval()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, d] rotated by position, the two halves of each head as the pair."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference(sd: dict, c: Eagle3Config, tokens, hidden_in, pos, fused: bool):
    """EAGLE-3 step over T tokens, causal, written from the SGLang layer description; layers
    past the first (speculators' `layers.{i}`) plain Llama decoder layers on the hidden."""
    w = {k: v.double() for k, v in sd.items() if v.is_floating_point()}
    eps = c.rms_norm_eps
    g = hidden_in.double()
    if not fused:
        g = g.reshape(len(tokens), -1) @ w["fc.weight"].T
    emb = w["embed_tokens.weight"][tokens]
    x = torch.cat([rms(emb, w["midlayer.input_layernorm.weight"], eps),
                   rms(g, w["midlayer.hidden_norm.weight"], eps)], -1)
    h = decoder_layer(w, "midlayer.", c, x, g, pos)
    for i in range(1, c.num_layers):
        h = decoder_layer(w, f"layers.{i}.", c, rms(h, w[f"layers.{i}.input_layernorm.weight"],
                                                    eps), h, pos)
    return rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T, h


def decoder_layer(w: dict, pre: str, c: Eagle3Config, x, residual, pos):
    """Attention on the normed input x, its residual add, then the MLP's."""
    t, nh, nkv, d = len(x), c.num_heads, c.num_kv_heads, c.head_dim
    q = rope((x @ w[pre + "self_attn.q_proj.weight"].T).view(t, nh, d), pos, c.rope_theta)
    k = rope((x @ w[pre + "self_attn.k_proj.weight"].T).view(t, nkv, d), pos, c.rope_theta)
    v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(t, nkv, d)
    heads = []
    for h in range(nh):
        kh, vh = k[:, h // (nh // nkv)], v[:, h // (nh // nkv)]
        scores = q[:, h] @ kh.T / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ vh)
    h1 = residual + torch.cat(heads, -1) @ w[pre + "self_attn.o_proj.weight"].T
    m = rms(h1, w[pre + "post_attention_layernorm.weight"], c.rms_norm_eps)
    gate, up = m @ w[pre + "mlp.gate_proj.weight"].T, m @ w[pre + "mlp.up_proj.weight"].T
    return h1 + (torch.nn.functional.silu(gate) * up) @ w[pre + "mlp.down_proj.weight"].T


@pytest.mark.parametrize("layers", [1, 2])
def test_forward_matches_hand_reference(layers):
    c = tiny_cfg(num_layers=layers)
    d = random_drafter(c)
    torch.manual_seed(1)
    t = 9
    tokens = torch.randint(0, c.vocab_size, (t,))
    aux = torch.randn(t, 3, c.target_hidden_size)
    pos = torch.arange(3, 3 + t)
    with torch.no_grad():
        logits, h = d(tokens[None], d.fuse(aux[None]), pos[None])
        ref_logits, ref_h = reference(hf_state_dict(d), c, tokens, aux, pos, fused=False)
        assert torch.allclose(logits[0].double(), ref_logits, atol=1e-4)
        assert torch.allclose(h[0].double(), ref_h, atol=1e-5)  # pre-norm hidden is fed back
        logits2, _ = d(tokens[None], h, pos[None] + 1)  # a second step on the fed-back hidden
        ref2, _ = reference(hf_state_dict(d), c, tokens, h[0], pos + 1, fused=True)
        assert torch.allclose(logits2[0].double(), ref2, atol=1e-4)
    assert torch.equal(d.to_target(torch.arange(c.draft_vocab_size)), torch.nonzero(d.t2d)[:, 0])


def test_norm_variants_follow_their_definitions():
    c = tiny_cfg(norm_before_fc=True, norm_output=True, norm_before_residual=True,
                 target_hidden_size=32)
    d = random_drafter(c)
    aux = torch.randn(1, 5, 3, 32)
    sd = d.state_dict()
    flat = aux.flatten(-2)
    want = rms(flat, sd["input_norm.weight"], c.rms_norm_eps) @ sd["fc.weight"].T
    with torch.no_grad():
        assert torch.allclose(d.fuse(aux), want, atol=1e-5)
        h, tok, pos = torch.randn(1, 5, 32), torch.zeros(1, 5, dtype=torch.long), torch.arange(5)
        logits, fed = d(tok, h, pos[None])
        _, residual = d.midlayer.attn_input(d.embed_tokens(tok), h)
        assert torch.allclose(residual, d.midlayer.hidden_norm(h))
        plain = Eagle3Drafter(tiny_cfg(norm_before_fc=True, norm_before_residual=True,
                                       target_hidden_size=32))
        plain.load_state_dict(sd)
        _, pre = plain(tok, h, pos[None])
        assert torch.allclose(fed, rms(pre, sd["norm.weight"], c.rms_norm_eps), atol=1e-5)
        assert torch.allclose(logits, d.lm_head(fed), atol=1e-5)
    c2 = tiny_cfg(fc_norm=True)
    d2 = random_drafter(c2)
    sd2 = d2.state_dict()
    aux = torch.randn(1, 5, 3, 24)
    parts = [rms(aux[..., i, :], sd2[f"fc_norm.{i}.weight"], c2.rms_norm_eps) for i in range(3)]
    with torch.no_grad():
        assert torch.allclose(d2.fuse(aux), torch.cat(parts, -1) @ sd2["fc.weight"].T, atol=1e-5)
    with pytest.raises(DraftsmithError, match="mutually exclusive"):
        tiny_cfg(fc_norm=True, norm_before_fc=True)


def test_init_weights_sets_every_norm_to_one_and_leaves_the_embedding():
    d = Eagle3Drafter(tiny_cfg(num_layers=2, norm_before_fc=True))
    emb = d.embed_tokens.weight.clone()
    torch.manual_seed(0)
    d.init_weights(0.02)
    norms = [n for n, _ in d.named_parameters() if n.endswith("norm.weight")]
    assert {"norm.weight", "input_norm.weight", "midlayer.hidden_norm.weight",
            "extra_layers.0.input_layernorm.weight"} <= set(norms)
    for name, p in d.named_parameters():
        if name in norms:
            assert torch.all(p == 1), name
        elif name != "embed_tokens.weight":
            assert 0.01 < float(p.detach().std()) < 0.03, name
    assert torch.equal(d.embed_tokens.weight, emb)


def test_cached_decode_matches_full_forward():
    c = tiny_cfg()
    d = random_drafter(c)
    tokens, hidden = torch.randint(0, 50, (2, 10)), torch.randn(2, 10, 32)
    pos = torch.arange(10).expand(2, 10)
    caches = [KVCache(torch.zeros(2, 2, 16, 8), torch.zeros(2, 2, 16, 8))]
    with torch.no_grad():
        full, _ = d(tokens, hidden, pos)
        a, _ = d(tokens[:, :6], hidden[:, :6], pos[:, :6], caches)
        b, _ = d(tokens[:, 6:], hidden[:, 6:], pos[:, 6:], caches)
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)


def test_state_names_and_checkpoint_round_trip(tmp_path):
    c = tiny_cfg(num_layers=2)
    d = random_drafter(c)
    names = set(hf_state_dict(d))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight",
            "midlayer.hidden_norm.weight", "layers.1.self_attn.k_proj.weight",
            "layers.1.input_layernorm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "embed_tokens.weight"} <= names
    save_drafter(d, tmp_path / "ck", training={"steps": 3})
    back = load_drafter(tmp_path / "ck")
    assert back.cfg == d.cfg
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    bad = hf_state_dict(d)
    bad["fc.weight"] = bad["fc.weight"][:, :5]
    with pytest.raises(DraftsmithError, match="fc.weight has shape"):
        load_hf_state_dict(Eagle3Drafter(c), bad)
    del bad["midlayer.self_attn.v_proj.weight"]
    with pytest.raises(DraftsmithError, match="v_proj"):
        load_hf_state_dict(Eagle3Drafter(c), bad)


def test_a_missing_or_foreign_drafter_folder_is_named(tmp_path):
    from draftsmith.models.eagle3 import read_drafter_meta

    with pytest.raises(DraftsmithError, match="no such folder"):
        read_drafter_meta(tmp_path / "missing")
    with pytest.raises(DraftsmithError, match="not a draftsmith drafter folder"):
        read_drafter_meta(tmp_path)
    save_drafter(random_drafter(tiny_cfg()), tmp_path / "cut")
    weights = next((tmp_path / "cut").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # a kill or a full disk mid-write
    with pytest.raises(DraftsmithError, match="cannot read its weights"):
        load_drafter(tmp_path / "cut")


def test_saving_into_a_file_is_refused_and_the_file_kept(tmp_path):
    d = random_drafter(tiny_cfg())
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    with pytest.raises(DraftsmithError, match="keep.txt: is a file, not a folder"):
        save_drafter(d, keep)
    with pytest.raises(DraftsmithError, match="lies under the file"):
        save_drafter(d, keep / "sub")
    assert keep.read_text() == "mine"


def test_a_failed_save_leaves_no_tmp_file_and_the_old_drafter_whole(tmp_path, monkeypatch):
    """A full disk in the middle of `save_drafter` (export, import, training's last write) left
    its `.model.safetensors.PID.tmp` in the folder; the drafter saved before stays loadable."""
    import safetensors.torch

    d = random_drafter(tiny_cfg())
    save_drafter(d, tmp_path / "d")
    before = sorted(p.name for p in (tmp_path / "d").iterdir())

    def full(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match="No space"):
        save_drafter(random_drafter(tiny_cfg()), tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == before
    assert all(torch.equal(a, b) for a, b in zip(load_drafter(tmp_path / "d").state_dict().values(),
                                                 d.state_dict().values(), strict=True))
