"""The drafter's layer in one Triton kernel against `Eagle3Drafter`'s module path: the same
output and the same cache writes (CPU: Triton's interpreter, stage by stage, fp32), the kernel
compiled for an sm_90 GPU with and without its grid barriers, and on a GPU the fused launch
against the module path in bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draftsmith.layers import default_aux_layers
from draftsmith.models import triton_draft_layer as tdl
from draftsmith.models.config import ModelConfig
from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.models.llama import KVCache

pytestmark = pytest.mark.skipif(not tdl.AVAILABLE, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def drafter(dtype: torch.dtype, norm_before_residual: bool = False, **shape) -> Eagle3Drafter:
    dims = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                head_dim=32)
    dims.update(shape)
    cfg = ModelConfig(arch="llama", vocab_size=96, num_layers=4, **dims)
    dcfg = Eagle3Config.for_target(cfg, 48, default_aux_layers(4),
                                   norm_before_residual=norm_before_residual)
    torch.manual_seed(3)
    d = Eagle3Drafter(dcfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) * 0.2)
        d.embed_tokens.weight.mul_(5)
    return d.eval().to(DEVICE, dtype)


def inputs(d: Eagle3Drafter, b: int, q: int, slots: int, dtype: torch.dtype):
    """Tokens, hidden, positions, slots, a tree-like mask [B, 1, Q, S] and a filled cache."""
    g = torch.Generator().manual_seed(b * 100 + q)
    cfg = d.cfg
    tokens = torch.randint(0, cfg.vocab_size, (b, q), generator=g)
    hidden = torch.randn(b, q, cfg.hidden_size, generator=g) * 2
    length = torch.randint(slots // 3, slots - q - 2, (b,), generator=g)
    positions = length[:, None] + torch.randint(0, 3, (b, q), generator=g)
    slot = length[:, None] + 1 + torch.arange(q)
    mask = torch.arange(slots)[None, None, None, :] < length[:, None, None, None]
    mask = mask.expand(b, 1, q, slots).clone()
    mask[torch.arange(b)[:, None], 0, torch.arange(q)[None, :], slot] = True
    mask |= (torch.rand(b, 1, q, slots, generator=g) < 0.1) & (
        torch.arange(slots) < slots - q - 1)
    shape = (b, cfg.num_kv_heads, slots, cfg.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    dev = {"device": DEVICE}
    return (tokens.to(**dev), hidden.to(DEVICE, dtype), positions.to(**dev), slot.to(**dev),
            mask.to(**dev), KVCache(k.to(DEVICE, dtype), v.to(DEVICE, dtype)))


def run(d, mode, monkeypatch, tokens, hidden, positions, slot, mask, cache):
    """The drafter's (head input, fed-back hidden) and its cache after one call in `mode`."""
    monkeypatch.setattr(tdl, "MODE", mode)
    cache = KVCache(cache.k.clone(), cache.v.clone())
    with torch.no_grad():
        out = d(tokens, hidden, positions, [cache], slot, mask, logits=False)
    return out, cache


@pytest.mark.parametrize(("b", "q", "slots", "normed"),
                         [(1, 4, 80, False), (2, 3, 150, True), (3, 1, 40, False),
                          (1, 8, 300, False)])
def test_the_kernel_equals_the_module(monkeypatch, b, q, slots, normed):
    if DEVICE == "cuda":
        pytest.skip("the interpreter's stage-by-stage path (CPU)")
    d = drafter(torch.float32, normed)
    args = inputs(d, b, q, slots, torch.float32)
    (ref_x, ref_h), ref_cache = run(d, "off", monkeypatch, *args)
    (x, h), cache = run(d, "staged", monkeypatch, *args)
    with torch.no_grad():
        assert tdl.takes(d, args[0], args[1], [args[5]], args[4])
    torch.testing.assert_close(h, ref_h, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(x, ref_x, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cache.k, ref_cache.k, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cache.v, ref_cache.v, atol=2e-5, rtol=2e-5)
    assert not torch.equal(cache.k, args[5].k)  # the new rows were written


def test_what_the_kernel_does_not_take(monkeypatch):
    d = drafter(torch.float32)
    tokens, hidden, _, _, mask, cache = inputs(d, 1, 4, 80, torch.float32)
    monkeypatch.setattr(tdl, "MODE", "staged")
    with torch.no_grad():
        assert tdl.takes(d, tokens, hidden, [cache], mask)
        assert not tdl.takes(d, tokens, hidden, None, mask)  # no cache: training's path
        big = tokens.expand(tdl.MAX_ROWS + 1, 4)
        assert not tdl.takes(d, big, hidden.expand(tdl.MAX_ROWS + 1, 4, -1), [cache], mask)
        two = dataclasses.replace(d.cfg, num_layers=2)
        assert not tdl.takes(Eagle3Drafter(two), tokens, hidden, [cache], mask)
    assert not tdl.takes(d, tokens, hidden, [cache], mask)  # autograd on
    monkeypatch.setattr(tdl, "MODE", "off")
    with torch.no_grad():
        assert not tdl.takes(d, tokens, hidden, [cache], mask)


@pytest.mark.parametrize(("steps", "topk", "n"), [
    (2, 2, 4), pytest.param(3, 1, None, marks=pytest.mark.slow),
    pytest.param(3, 4, 10, marks=pytest.mark.slow)])
def test_speculative_decoding_drafts_the_same_through_the_kernel(monkeypatch, steps, topk, n):
    """The engine on CPU drafting through the kernel (every drafter call with a cache and at
    most MAX_ROWS rows: extend, depths; the prompt pass is longer): plain greedy output, and the
    very drafts the module path makes (the same acceptance at every position; the drafter is
    steered to the target's tokens at some positions, so that acceptance goes deep)."""
    from test_speculative import PROMPTS, Steered, greedy_seq, make_drafter, tiny_target

    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder

    if DEVICE == "cuda":
        pytest.skip("the interpreter's stage-by-stage path (CPU)")
    prompts = PROMPTS[:2]
    target = tiny_target(head_dim=32)  # the kernel's least: 16 rotary pairs
    rt = Runtime(target, 4, 128)
    drafter = make_drafter(target, 96, Steered).steer(greedy_seq(rt, prompts, 20), 0.6)
    ref = generate(rt, prompts, 12, eos_ids=[])
    calls = []
    kernel_forward = tdl.forward
    monkeypatch.setattr(tdl, "forward", lambda *a: calls.append(1) or kernel_forward(*a))
    res = {}
    for mode in ("off", "staged"):
        monkeypatch.setattr(tdl, "MODE", mode)
        res[mode] = SpecDecoder(rt, drafter, steps, topk, n).generate(prompts, 12, eos_ids=[])
        assert res[mode].tokens == ref
        assert bool(calls) == (mode == "staged")
    assert res["off"].mean_accept_length > 1.1
    assert res["staged"].accept_hist == res["off"].accept_hist
    assert res["staged"].accepted == res["off"].accepted


COMPILE_FOR_HOPPER = """
from draftsmith.models import draft_layer_kernel as k

kern = k.draft_layer
pointers = dict.fromkeys(kern.arg_names[:23], "*bf16")
pointers.update(TOK="*i64", POS="*i64", SLOT="*i64", FREQ="*fp32", MASK="*i1", MP="*fp32",
                LP="*fp32", AP="*fp32", SYNC="*i32")
ints = dict.fromkeys(kern.arg_names[23:36], "i32")
ints.update(eps="fp32", scale="fp32")
for barrier, first, last in ((True, 1, 6), (False, 1, 1), (False, 2, 2), (False, 6, 6)):
    const = dict(H=576, D=64, NH=9, KVH=3, INTER=1536, BM=4, BK=64, BR=16, BN=64, SPLITS=8,
                 NB_QKV=8, NB_O=8, NB_GU=16, NB_D=8, RESID_NORMED=False, IEEE=False,
                 FIRST=first, LAST=last, BARRIER=barrier)
    sig = {**pointers, **ints, **dict.fromkeys(const, "constexpr")}
    src = ASTSource(fn=kern, signature=sig,
                    constexprs={(kern.arg_names.index(n),): v for n, v in const.items()})
    triton.compile(src, target=hopper, options={"num_warps": 4})
print("compiled")
"""


def test_the_kernel_compiles_for_a_hopper_gpu():
    """The real compiler for sm_90, fused (barriers) and stage by stage: the interpreter runs
    Python and misses what only the compiler checks (types of loop-carried values, constexpr
    globals)."""
    from conftest import compile_for_hopper

    compile_for_hopper(COMPILE_FOR_HOPPER)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fused", "staged"])
def test_the_fused_kernel_on_a_gpu_equals_the_module(monkeypatch, mode):
    """bf16 at the default drafter's shapes with a trained drafter's scales (weights std 0.02,
    so no score is sharp enough for bf16 rounding to pick another key), compiled and graphed
    as the engine runs it, against the module path compiled alike."""
    d = drafter(torch.bfloat16, hidden_size=576, intermediate_size=1536, num_heads=9,
                num_kv_heads=3, head_dim=64)
    with torch.no_grad():
        d.init_weights()
    tokens, hidden, positions, slot, mask, cache0 = inputs(d, 1, 4, 400, torch.bfloat16)
    got = {}
    for way in ("off", mode):
        torch._dynamo.reset()
        monkeypatch.setattr(tdl, "MODE", way)
        cache = KVCache(cache0.k.clone(), cache0.v.clone())
        step = torch.compile(lambda *a: d(*a, logits=False), fullgraph=True)
        with torch.no_grad():
            got[way] = (*step(tokens, hidden, positions, [cache], slot, mask), cache)
    (ref_x, ref_h, ref_cache), (x, h, cache) = got["off"], got[mode]
    torch.testing.assert_close(h.float(), ref_h.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(x.float(), ref_x.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(cache.k.float(), ref_cache.k.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(cache.v.float(), ref_cache.v.float(), atol=0.05, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize(("steps", "topk", "n"), [(3, 2, 6), (4, 4, 10)])
def test_the_fused_kernel_builds_the_same_trees_in_the_graphed_engine(monkeypatch, steps, topk,
                                                                       n):
    """DRAFTSMITH_DRAFT_LAYER=fused in the compiled, graphed engine (fp32): the same drafts
    cycle by cycle as the module path, the kernel inside the graphs, plain greedy output."""
    from conftest import count_compiled_calls
    from test_speculative import PROMPTS, assert_same_trees_each_cycle, make_drafter, tiny_target
    from test_speculative_gpu import NEW, cast

    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime
    from draftsmith.engine.speculative import SpecDecoder

    target = cast(tiny_target(head_dim=32), torch.float32)
    drafter = cast(make_drafter(target, 96, std=0.3), torch.float32)
    ref = generate(Runtime(target, 4, 160, graphs=False), PROMPTS, NEW, eos_ids=[])
    calls = count_compiled_calls(monkeypatch, tdl, "forward", lambda *a: True)
    decs = {}
    for mode in ("off", "fused"):
        monkeypatch.setattr(tdl, "MODE", mode)
        decs[mode] = SpecDecoder(Runtime(target, 4, 160, graphs=True, compile=True), drafter,
                                 steps, topk, n)
        decs[mode].capture([4, 1])
    assert calls.item() > 0
    assert_same_trees_each_cycle(
        decs["off"], decs["fused"],
        lambda i: monkeypatch.setattr(tdl, "MODE", ("off", "fused")[i]))
    assert decs["fused"].generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    assert not any(st.unfused for st in decs["fused"].states.values())
