"""The drafter's vocabulary head in int8 (models/triton_head.py `quantize_head`, one fp32 scale
a row) in the Triton head-and-top-k pass, and DRAFTSMITH_DRAFT_HEAD=triton-int8 in greedy trees:
on CPU in Triton's interpreter (fp32 x), the kernel's for sm_90 compiled without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from draftsmith.errors import DraftsmithError

pytest.importorskip("triton")
from test_speculative import (  # noqa: E402 (after the skip: it needs no Triton, the tests do)
    NEW,
    PROMPTS,
    assert_same_trees_each_cycle,
    make_drafter,
    setup,  # noqa: F401 (the fixture)
)
from test_triton_head import COMPILE_FOR_HOPPER  # noqa: E402

from draftsmith.engine import tree  # noqa: E402
from draftsmith.engine.speculative import SpecDecoder  # noqa: E402
from draftsmith.models import triton_head  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def head(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    w *= torch.rand(vocab, 1, generator=g) * 4  # rows of unlike ranges: unlike scales
    w[3] = 0.0
    return w


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ (q * scale).T rounded to x's dtype, then the tree's top-k of its log-softmax."""
    logits = (x @ (q.float() * scale[:, None]).to(x.dtype).T).float()
    v, i = tree.top_k_by_max(logits, k)
    return v - logits.logsumexp(-1, keepdim=True), i


def test_quantize_head_keeps_each_row_within_half_its_step():
    w = head(300, 64, 0)
    q, scale = triton_head.quantize_head(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (300,)
    half = 0.5 + 1e-5  # half a step, past fp32's rounding of w / scale and q * scale
    assert (w - q.float() * scale[:, None]).abs().le(scale[:, None] * half).all()
    assert q.abs().max() == 127 and (q.abs().amax(1)[w.abs().amax(1) > 0] == 127).all()
    assert scale[3] == 1 and not q[3].any()  # a row of zeros: scale 1, not 0 or NaN
    q16, s16 = triton_head.quantize_head(w.bfloat16())  # the drafter's dtype on a GPU
    assert (q16.float() * s16[:, None] - w.bfloat16().float()).abs().le(s16[:, None] * half).all()


@pytest.mark.parametrize("rows,vocab,hidden,k,join", [
    (4, 1000, 96, 4, "torch"), (1, 300, 64, 1, "torch"), (20, 517, 32, 8, "torch"),
    (4, 1000, 96, 4, "kernel"), (33, 300, 64, 4, "kernel")])
def test_int8_head_top_k_equals_the_dequantized_head_then_top_k(rows, vocab, hidden, k, join):
    """Both joins (tensor ops, or the kernel's last program of a row block, twice on one
    counter): the ids and log-probabilities of the dequantized head's top-k."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(DEVICE)
    q, scale = (t.to(DEVICE) for t in triton_head.quantize_head(head(vocab, hidden, rows)))
    rv, ri = reference(x, q, scale, k)
    counts = triton_head.counter(DEVICE) if join == "kernel" else None
    for _ in range(2 if counts is not None else 1):
        v, i = triton_head.head_top_k(x, q, k, counts, scale=scale)
        assert v.shape == (rows, k) and i.dtype == torch.int64
        assert torch.equal(i, ri)
        assert torch.allclose(v, rv, atol=1e-5)
        assert counts is None or not counts.any()


def test_int8_calls_that_do_not_fit_are_refused():
    x = torch.randn(2, 32).to(DEVICE)
    q, scale = (t.to(DEVICE) for t in triton_head.quantize_head(torch.randn(40, 32)))
    bad = [((x, q, 2), {}, "needs scale="), ((x, q.float(), 2), {"scale": scale}, "int8 head"),
           ((x, q, 2), {"scale": scale[:39]}, r"float32 \[40\]"),
           ((x, q, 2), {"scale": scale.double()}, r"float32 \[40\]"),
           ((x, q, 2), {"scale": scale[None]}, r"float32 \[40\]"),
           ((x, q[:, :16], 2), {"scale": scale}, "head_top_k: top-2"),
           ((x, q, 17), {"scale": scale}, "k must be 1-16")]
    for args, kw, msg in bad:
        with pytest.raises(DraftsmithError, match=msg):
            triton_head.head_top_k(*args, **kw)
    for w in (q, torch.randn(40)):
        with pytest.raises(DraftsmithError, match="quantize_head"):
            triton_head.quantize_head(w)


# test_triton_head's script with the int8 entry: its weights int8 and its scales fp32
COMPILE_INT8_FOR_HOPPER = COMPILE_FOR_HOPPER.replace(
    "th._kernel()", "th._kernel(scaled=True)").replace(
    'types = ["*bf16", "*bf16",', 'types = ["*bf16", "*i8", "*fp32",')
assert COMPILE_INT8_FOR_HOPPER.count("scaled=True") == COMPILE_INT8_FOR_HOPPER.count('"*i8"') == 1


def test_the_int8_kernel_compiles_for_a_hopper_gpu():
    """The real compiler for sm_90 (no GPU needed): bf16 x, int8 weights converted to bf16,
    fp32 scales, with and without the kernel's join."""
    from conftest import compile_for_hopper

    compile_for_hopper(COMPILE_INT8_FOR_HOPPER)


def test_the_int8_head_is_made_once_per_weight_and_again_after_a_change(monkeypatch):
    drafter = torch.nn.Module()
    drafter.lm_head = torch.nn.Linear(32, 40, bias=False)
    made = []
    quantize = triton_head.quantize_head
    monkeypatch.setattr(triton_head, "quantize_head", lambda w: made.append(1) or quantize(w))
    monkeypatch.setattr(tree, "DRAFT_HEAD", "triton")
    assert tree.draft_head(drafter) is drafter.lm_head.weight and not made
    monkeypatch.setattr(tree, "DRAFT_HEAD", "triton-int8")
    q, scale = tree.draft_head(drafter)
    again = tree.draft_head(drafter)
    assert again[0] is q and again[1] is scale and len(made) == 1
    assert torch.equal(q, quantize(drafter.lm_head.weight)[0])
    before = scale.clone()
    with torch.no_grad():
        drafter.lm_head.weight.mul_(2)  # in place: a new version, made again in place
    q2, scale2 = tree.draft_head(drafter)
    assert len(made) == 2 and q2 is q and scale2 is scale and torch.equal(scale2, before * 2)
    assert torch.equal(q2, quantize(drafter.lm_head.weight)[0])
    fresh = torch.nn.Linear(32, 40, bias=False).weight
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(DraftsmithError, match="before this CUDA graph capture"):
        tree.int8_head(fresh)
    assert tree.int8_head(drafter.lm_head.weight)[0] is q2  # made already: no refusal


def test_a_compiled_draft_makes_the_int8_head_once_then_reads_it(monkeypatch):
    """Under torch.compile (fullgraph, as the fused draft phase): the first trace finds no int8
    head and makes it in its graph, kept on the weight as a side effect; the next call's guard
    sees it and traces once more, reading the kept tensors; no call after that compiles."""
    monkeypatch.setattr(tree, "DRAFT_HEAD", "triton-int8")
    drafter = torch.nn.Module()
    drafter.lm_head = torch.nn.Linear(32, 40, bias=False)
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm.code)
        return gm.forward

    def f(d, x):
        q, scale = tree.draft_head(d)
        return (x @ q.float().T) * scale

    torch._dynamo.reset()
    fn = torch.compile(f, backend=backend, fullgraph=True)
    x = torch.randn(3, 32)
    with torch.no_grad():
        outs = [fn(drafter, x) for _ in range(4)]
    kept = getattr(drafter.lm_head.weight, tree.INT8_HEAD)
    q, scale = triton_head.quantize_head(drafter.lm_head.weight)
    assert len(graphs) == 2 and "round" in graphs[0] and "round" not in graphs[1]
    assert torch.equal(kept[1], q) and torch.equal(kept[2], scale)
    assert all(torch.allclose(o, (x @ q.float().T) * scale) for o in outs)
    torch._dynamo.reset()


@pytest.mark.parametrize("steps,topk,n,join", [(3, 2, 6, "torch"),
                                               pytest.param(4, 4, 10, "kernel",
                                                            marks=pytest.mark.slow)])
def test_the_int8_draft_head_builds_the_dequantized_heads_trees(setup, steps, topk, n, join,  # noqa: F811
                                                                monkeypatch):
    """DRAFTSMITH_DRAFT_HEAD=triton-int8 (the Triton pass over the int8 head, 32-entry blocks:
    three over the 96-token draft vocab; the root's children too) builds, cycle by cycle, the
    trees of a drafter whose head is the dequantized one under the cuBLAS head, batch 4, and
    gives plain greedy output; the int8 head is made once."""
    monkeypatch.setattr(triton_head, "BLOCK_V", 32)
    monkeypatch.setattr(triton_head, "JOIN", join)
    target, rt, ref, _ = setup
    drafter = make_drafter(target, 96)
    dequantized = copy.deepcopy(drafter)
    q, scale = triton_head.quantize_head(drafter.lm_head.weight)
    with torch.no_grad():
        dequantized.lm_head.weight.copy_(q.float() * scale[:, None])
    a_dec, b_dec = SpecDecoder(rt, dequantized, steps, topk, n), SpecDecoder(rt, drafter, steps,
                                                                             topk, n)
    calls, made = [], []
    real, quantize = triton_head.head_top_k, triton_head.quantize_head
    monkeypatch.setattr(triton_head, "head_top_k",
                        lambda *a, **kw: calls.append(kw.get("scale") is not None)
                        or real(*a, **kw))
    monkeypatch.setattr(triton_head, "quantize_head", lambda w: made.append(1) or quantize(w))

    def before(i: int) -> None:
        monkeypatch.setattr(tree, "DRAFT_HEAD", ("cublas", "triton-int8")[i])

    def after() -> None:
        assert calls == [True] * steps  # the root and every depth past it, all int8
        calls.clear()

    assert_same_trees_each_cycle(a_dec, b_dec, before, after)
    assert made == [1]
    res = b_dec.generate(PROMPTS, NEW, eos_ids=[])
    assert res.tokens == ref and made == [1]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the interpreter's bf16 dot is wrong)")
def test_int8_head_top_k_in_bf16_at_the_default_drafters_shape():
    """Draft vocabulary 24,576 x hidden 576, 4 rows, bf16 x: the int8 tiles converted to bf16 on
    the GPU, the scaled sums rounded to bf16. Against fp32 sums of the dequantized head rounded
    to bf16: each pick within a bf16 step of the reference's k best (the sums' order differs,
    so a near-tie may fall the other way), values to rounding; both joins alike."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 576, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(24_576, 576, generator=g) / 24).to(DEVICE, torch.bfloat16)
    q, scale = triton_head.quantize_head(w)
    v, i = triton_head.head_top_k(x, q, 4, scale=scale)
    logits = ((x.float() @ q.float().T) * scale).bfloat16().float()
    lse = logits.logsumexp(-1, keepdim=True)
    best = logits.topk(4, dim=-1).values
    step = best.abs() * 2**-7
    assert (logits.gather(1, i) >= best - step).all()
    assert torch.allclose(v, logits.gather(1, i) - lse, atol=2e-2)
    assert (i == logits.topk(4, dim=-1).indices).float().mean() > 0.9
    counts = triton_head.counter(DEVICE)
    for _ in range(3):
        jv, ji = triton_head.head_top_k(x, q, 4, counts, scale=scale)
        assert torch.equal(ji, i) and torch.allclose(jv, v, atol=1e-6) and not counts.any()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("whole,join", [(True, "torch"), (False, "torch"), (True, "kernel")])
def test_the_int8_draft_head_in_the_compiled_graphed_engine(setup, monkeypatch, whole, join):  # noqa: F811
    """DRAFTSMITH_DRAFT_HEAD=triton-int8 in the compiled, graphed engine (tree 4/4/10, the draft
    phase compiled whole or in parts): the int8 head is made in the warm-up, before any capture
    (the fused draft's first trace makes it; the next traces read it), the int8 kernel runs
    inside the graphs, the trees are those of the dequantized head under cuBLAS, cycle by
    cycle, and the output is plain greedy's; no phase falls back to parts."""
    from conftest import count_compiled_calls

    from draftsmith.engine import speculative
    from draftsmith.engine.generate import generate
    from draftsmith.engine.runtime import Runtime

    monkeypatch.setattr(triton_head, "BLOCK_V", 32)
    monkeypatch.setattr(triton_head, "JOIN", join)
    monkeypatch.setattr(speculative, "FUSED_PHASES", speculative.fused_phases(
        "all" if whole else "0"))
    from test_speculative_gpu import cast

    target = cast(copy.deepcopy(setup[0]), torch.float32)
    eager = Runtime(target, 4, 160, graphs=False)
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    drafter = cast(make_drafter(setup[0], 96), torch.float32)
    heads = count_compiled_calls(monkeypatch, triton_head, "head_top_k",
                                 lambda *a, **kw: kw.get("scale") is not None)
    decs = {}
    monkeypatch.setattr(tree, "DRAFT_HEAD", "triton-int8")
    decs["int8"] = SpecDecoder(Runtime(target, 4, 160, graphs=True, compile=True), drafter, 4,
                               4, 10)
    decs["int8"].capture([4, 1])
    # made by the warm-up (whole: in the draft's first trace, whose division may round apart
    # from eager's at a half step)
    _, kq, kscale = getattr(drafter.lm_head.weight, tree.INT8_HEAD)
    q, scale = triton_head.quantize_head(drafter.lm_head.weight)
    assert (kq.int() - q.int()).abs().max() <= 1 and torch.allclose(kscale, scale)
    dequantized = copy.deepcopy(drafter)
    with torch.no_grad():
        dequantized.lm_head.weight.copy_(kq.float() * kscale[:, None])
    monkeypatch.setattr(tree, "DRAFT_HEAD", "cublas")
    decs["cublas"] = SpecDecoder(Runtime(target, 4, 160, graphs=True, compile=True), dequantized,
                                 4, 4, 10)
    decs["cublas"].capture([4, 1])
    assert_same_trees_each_cycle(
        decs["cublas"], decs["int8"],
        lambda i: monkeypatch.setattr(tree, "DRAFT_HEAD", ("cublas", "triton-int8")[i]))
    assert heads.item() > 0
    assert decs["int8"].generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    assert not any(st.unfused for st in decs["int8"].states.values())
