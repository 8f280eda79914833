"""The fused norm and linear (DRAFTSMITH_NORM_LINEAR_ROWS) give the unfused layer's values: on
CPU in Triton's interpreter (fp32; conftest turns it on), on a GPU compiled (bf16 too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def unfused(x, delta, gamma, eps, w, up):
    s = x if delta is None else x + delta
    normed = F.rms_norm(s.float(), (s.shape[-1],), None, eps).to(x.dtype)
    y = F.linear((gamma * normed).to(x.dtype), w)
    if up:
        gate, u = y.split(up, dim=-1)
        y = (F.silu(gate.float()) * u.float()).to(x.dtype)
    return y, s


def fused_weights(monkeypatch) -> list:
    """Record the weight of each call of the fused kernel (the layers call it through the
    module), and let it run."""
    from draftsmith.models import triton_norm_linear

    weights, plain = [], triton_norm_linear.norm_linear
    monkeypatch.setattr(triton_norm_linear, "norm_linear",
                        lambda *a, **kw: weights.append(a[4]) or plain(*a, **kw))
    return weights


@pytest.mark.parametrize("rows,k,n,up,delta", [(25, 576, 960, 0, True), (4, 100, 70, 0, False),
                                               (3, 64, 0, 48, True), (70, 96, 40, 0, True),
                                               (17, 130, 0, 33, False)])
def test_norm_linear_equals_the_unfused_layer(rows, k, n, up, delta):
    """Verify and drafter-depth rows, more rows than one program takes (70), inputs and outputs
    that are not whole blocks, a gate_up with silu*mul, with and without the residual pair; x as
    a strided view (a slice of a wider row), leading dims kept."""
    from draftsmith.models.triton_norm_linear import norm_linear

    g = torch.Generator().manual_seed(rows + k)
    wide = torch.randn(1, rows, k + 8, generator=g).to(DEVICE)
    x = wide[..., 4 : 4 + k]
    d = torch.randn(1, rows, k, generator=g).to(DEVICE) if delta else None
    gamma = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE)
    w = (torch.randn(2 * up or n, k, generator=g) / k**0.5).to(DEVICE)
    y, s = norm_linear(x, d, gamma, 1e-5, w, up)
    ref_y, ref_s = unfused(x, d, gamma, 1e-5, w, up)
    assert y.shape == ref_y.shape == (1, rows, up or n) and s.shape == (1, rows, k)
    assert torch.equal(s, ref_s)
    assert torch.allclose(y, ref_y, atol=1e-4)


def test_fits_needs_the_switch_and_rows_past_the_reductions(monkeypatch):
    from draftsmith.models import parallel, triton_norm_linear

    monkeypatch.setattr(triton_norm_linear, "NORM_LINEAR_ROWS", 64)
    monkeypatch.setattr(parallel, "SMALL_LINEAR_ROWS", 2)
    assert triton_norm_linear.fits(25) and triton_norm_linear.fits(64)
    assert not triton_norm_linear.fits(2)  # one-token steps: reductions already
    assert not triton_norm_linear.fits(65)
    monkeypatch.setattr(triton_norm_linear, "NORM_LINEAR_ROWS", 0)
    assert not triton_norm_linear.fits(25)


def test_a_gate_up_of_the_wrong_height_is_refused():
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.triton_norm_linear import norm_linear

    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(DraftsmithError, match="needs 96 weight rows, not 80"):
        norm_linear(x, None, torch.ones(32, device=DEVICE), 1e-5, torch.randn(80, 32), 48)


def test_a_layer_with_fused_norms_equals_the_plain_layer(monkeypatch):
    """DecoderLayer.split through the fused kernels (forced on, as a graphed CUDA step of these
    rows takes them) against the plain layer: the same residual stream and MLP output, up to
    the linears' summation order."""
    from draftsmith.models import llama
    from draftsmith.models.config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=96, intermediate_size=160,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=24, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    layer = llama.DecoderLayer(cfg).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.1 * torch.randn_like(p) + (p.dim() == 1))
    b, q = 2, 5
    h, delta = torch.randn(b, q, 96, device=DEVICE), torch.randn(b, q, 96, device=DEVICE)
    pos = torch.arange(q, device=DEVICE).expand(b, q)
    inv = torch.tensor(cfg.inv_freq(), device=DEVICE)
    ang = pos[..., None].float() * inv
    cos, sin = (torch.cat([f(ang)] * 2, -1)[:, :, None] for f in (torch.cos, torch.sin))
    plain = layer.split(h, delta, cos, sin, None, None, None)
    calls = fused_weights(monkeypatch)
    monkeypatch.setattr(llama.DecoderLayer, "fused", lambda self, x: True)
    fused = layer.split(h, delta, cos, sin, None, None, None)
    assert len(calls) == 2  # the qkv's and the gate_up's
    assert all(torch.allclose(f, p, atol=1e-4) for f, p in zip(fused, plain, strict=True))
    first = layer.split(h, None, cos, sin, None, None, None)  # the first layer: no pair
    monkeypatch.setattr(llama.DecoderLayer, "fused", lambda self, x: False)
    ref = layer.split(h, None, cos, sin, None, None, None)
    assert all(torch.allclose(f, r, atol=1e-4) for f, r in zip(first, ref, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 dot is wrong)")
def test_norm_linear_in_bf16_at_the_default_targets_shapes():
    from draftsmith.models.triton_norm_linear import norm_linear

    g = torch.Generator("cuda").manual_seed(0)
    for rows, n, up in [(25, 960, 0), (25, 0, 1536), (4, 960, 0), (4, 0, 6144)]:
        x = torch.randn(rows, 576, device="cuda", generator=g).bfloat16()
        d = torch.randn(rows, 576, device="cuda", generator=g).bfloat16()
        gamma = torch.rand(576, device="cuda", generator=g).bfloat16() + 0.5
        w = (torch.randn(2 * up or n, 576, device="cuda", generator=g) / 24).bfloat16()
        y, s = norm_linear(x, d, gamma, 1e-5, w, up)
        ref_y, ref_s = unfused(x, d, gamma, 1e-5, w, up)
        assert torch.equal(s, ref_s)
        assert torch.allclose(y.float(), ref_y.float(), atol=3e-2, rtol=2e-2)


def test_a_drafter_layer_with_its_fused_norm_equals_the_plain_one(monkeypatch):
    """Eagle3Layer's post-attention norm, gate_up and silu*mul through the fused kernel (forced
    on) against the plain layer: the drafter's hidden state feeds its later depths."""
    from test_speculative import make_drafter, tiny_target

    from draftsmith.models import llama

    drafter = make_drafter(tiny_target(), 96).to(DEVICE)
    layer = drafter.midlayer
    b, q, h = 2, 5, drafter.cfg.hidden_size
    emb, hid = torch.randn(b, q, h, device=DEVICE), torch.randn(b, q, h, device=DEVICE)
    pos = torch.arange(q, device=DEVICE).expand(b, q)
    cos, sin = drafter.rope(pos, hid.dtype)
    plain = layer(emb, hid, cos, sin, None, None, None)
    calls = fused_weights(monkeypatch)
    monkeypatch.setattr(llama, "fuses_norms", lambda x: True)
    fused = layer(emb, hid, cos, sin, None, None, None)
    assert len(calls) == 1
    assert torch.allclose(fused, plain, atol=1e-4)


@pytest.mark.slow  # ~30 s of interpreted kernels, for a kernel that is off (H200 run 24: slower)
def test_speculative_greedy_with_fused_norms_equals_plain_greedy(monkeypatch):
    """The target's and the drafter's steps of 3-64 token rows (verify, drafter depths, prompt
    passes) through the fused kernels: chain and tree decoders still give plain greedy. CPU
    tensors in the interpreter (on a GPU: `test_norm_linears_equal_plain_greedy`)."""
    if DEVICE == "cuda":
        pytest.skip("the interpreter is off where CUDA is")
    from test_speculative import NEW, PROMPTS, make_drafter, tiny_target

    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder
    from draftsmith.models import llama

    target = tiny_target()
    rt = Runtime(target, 4, 160, graphs=False)
    ref = generate(rt, PROMPTS, NEW // 2, eos_ids=[])
    drafter = make_drafter(target, 96)
    weights = fused_weights(monkeypatch)
    monkeypatch.setattr(llama, "fuses_norms", lambda h: 2 < h.shape[0] * h.shape[1] <= 64)
    for steps, topk, n in [(3, 1, None), (3, 3, 8)]:
        out = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS, NEW // 2, eos_ids=[])
        assert out.tokens == ref
    drafter_w = drafter.midlayer.mlp.gate_up.weight
    assert any(w is drafter_w for w in weights)  # drafter depths
    assert any(w is target.layers[0].attn.qkv.weight for w in weights)  # target steps
