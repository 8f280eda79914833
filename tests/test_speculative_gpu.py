"""GPU checks for the speculative engine (`pytest -m gpu` on the H200): CUDA graphs change
nothing, in fp32 and bf16, greedy and sampled, chain and tree, with the profiler on."""

from __future__ import annotations

import pytest
import torch
from conftest import count_compiled_calls
from test_speculative import (
    NEW,
    PROMPTS,
    Steered,
    assert_same_prefill,
    assert_same_trees_each_cycle,
    greedy_seq,
    make_drafter,
    tiny_target,
)

from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.speculative import SpecDecoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SETTINGS = [(1, 1, None), (3, 1, None), (5, 1, None), (3, 2, 6), (4, 4, 10), (6, 4, 24)]


def cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Move to CUDA in `dtype`, keeping RoPE frequencies in fp32."""
    inv = model.inv_freq.float().cuda()
    model.to("cuda", dtype)
    model.inv_freq = inv
    return model


@pytest.fixture(scope="module")
def pair():
    target = cast(tiny_target(), torch.float32)
    eager = Runtime(target, 4, 160, graphs=False)
    seq = greedy_seq(eager, PROMPTS, NEW + 8)
    drafter = cast(make_drafter(target, 96, Steered), torch.float32)
    return target, drafter.steer(seq, 0.7), eager


@pytest.mark.parametrize("steps,topk,n", SETTINGS)
def test_graphed_speculative_equals_eager_and_plain(pair, steps, topk, n):
    target, drafter, eager = pair
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    slow = SpecDecoder(eager, drafter, steps, topk, n).generate(PROMPTS, NEW, eos_ids=[])
    rt = Runtime(target, 4, 160, graphs=True)
    dec = SpecDecoder(rt, drafter, steps, topk, n, profile=True)
    dec.capture([4, 1])
    fast = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert fast.tokens == slow.tokens == ref
    assert fast.accept_hist == slow.accept_hist and fast.accepted == slow.accepted
    assert dec.generate(PROMPTS[1:2], NEW, eos_ids=[]).tokens == ref[1:2]
    ph = fast.phases
    assert ph is not None and all(ph.ms[k] > 0 for k in ("draft", "verify", "accept", "extend"))


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (4, 4, 10)])
def test_the_cycle_graph_equals_the_phase_graphs_and_plain(pair, steps, topk, n, monkeypatch):
    """DRAFTSMITH_CYCLE_GRAPH: a cycle replayed as one CUDA graph decodes what the four phase
    graphs (a profiled run) and plain greedy decode, with the same accept counts."""
    from draftsmith.engine import speculative

    target, drafter, eager = pair
    monkeypatch.setattr(speculative, "CYCLE_GRAPH", True)
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    rt = Runtime(target, 4, 160, graphs=True)
    dec = SpecDecoder(rt, drafter, steps, topk, n, profile=True)
    phased = dec.generate(PROMPTS, NEW, eos_ids=[])
    dec.profile = False
    whole = dec.generate(PROMPTS, NEW, eos_ids=[])
    assert (dec.gkey, 4, "cycle") in rt.graphs
    assert whole.tokens == phased.tokens == ref
    assert whole.accept_hist == phased.accept_hist and whole.cycles == phased.cycles


def test_graphed_drafter_prompt_pass_equals_the_eager_one(pair):
    """The drafter's prompt pass replayed from its (batch, bucket) graph leaves the same root
    logits and hidden, and the same drafter K/V up to each row's length, as the eager pass."""
    target, drafter, eager = pair
    assert_same_prefill(drafter, eager, Runtime(target, 4, 160, graphs=True), 1e-4)


def test_decoders_made_one_after_another_each_prefill_with_their_own_graphs(pair):
    """gpu_suite makes a decoder per setting on one runtime and drops the last one. Each new
    decoder's drafter prompt pass must run its own graph, never a dead decoder's that a reused
    id() named (H200 run 15's device-side assert): the root logits match the eager prefill of
    this decoder's prompts (rotated each time), and no dead decoder's graph is kept."""
    import gc

    target, drafter, eager = pair
    rt = Runtime(target, 4, 160, graphs=True)
    for i in range(6):
        prompts = PROMPTS[i % 4:] + PROMPTS[: i % 4]
        dec = SpecDecoder(rt, drafter, 3, 2, 6)
        got = dec.start(prompts, NEW, [])
        ref = SpecDecoder(eager, drafter, 3, 2, 6).start(prompts, NEW, [])
        assert torch.allclose(got.root_logits, ref.root_logits, atol=1e-4)
        assert torch.allclose(got.root_hidden, ref.root_hidden, atol=1e-4)
        owners = {k[0] for k in rt.graphs.graphs if isinstance(k[0], tuple)}
        assert owners == {dec.gkey, dec.drt.gkey}
        del dec, got
        gc.collect()


@pytest.mark.parametrize("steps,topk,n,method,whole", [
    (3, 1, None, "chunk", True), (4, 4, 10, "chunk", True), (4, 4, 10, "chunk", False),
    (4, 4, 10, "topk", True), (4, 4, 10, "max", True), (5, 8, 48, "chunk", True)])
def test_compiled_verify_equals_plain_greedy(pair, monkeypatch, steps, topk, n, method, whole):
    """The compiled, graphed engine keeps plain greedy output under each tree top-k method (chunk:
    16-wide slices of the tiny draft vocab), with a tree's draft phase compiled whole (the
    default: every phase fused, DRAFTSMITH_FUSED_PHASES; the draft never under max) or in parts,
    and a 48-token verify (the Triton attention's range goes to 64 tokens)."""
    from draftsmith.engine import speculative, tree
    from draftsmith.models import triton_attention

    monkeypatch.setattr(tree, "TREE_TOPK", method)
    monkeypatch.setattr(tree, "CHUNK", 16)
    monkeypatch.setattr(speculative, "FUSED_PHASES", speculative.fused_phases(
        "all" if whole else "0"))
    target, drafter, eager = pair
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    dec = SpecDecoder(Runtime(target, 4, 160, graphs=True, compile=True), drafter, steps, topk, n)
    assert ("draft" in dec.fused) == (whole and topk > 1 and method != "max")
    assert ({"accept", "extend"} <= dec.fused) == whole
    verifies = count_compiled_calls(monkeypatch, triton_attention, "cache_attention",
                                    lambda q, *a: q.shape[1] == (n or steps + 1))
    dec.capture([4, 1])
    assert dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    assert not any(st.unfused for st in dec.states.values())  # no phase fell back to parts
    assert verifies.item() > 0  # the verify, 48 tokens included, attends the Triton way


@pytest.mark.parametrize("whole,join", [(True, "torch"), (False, "torch"), (True, "kernel")])
def test_the_triton_draft_head_builds_the_same_trees_compiled(pair, monkeypatch, whole, join):
    """DRAFTSMITH_DRAFT_HEAD=triton in the compiled, graphed engine (tree 4/4/10, the draft phase
    compiled whole or in parts, 32-entry vocabulary blocks: three over the 96-token draft vocab):
    the same trees cycle by cycle as the cuBLAS head (fp32), the head kernel inside the graphs,
    and plain greedy output. (The pair's steered drafter bends its logits, which the Triton head
    never forms: a plain drafter here.) join=kernel: DRAFTSMITH_HEAD_JOIN=kernel, the kernel's
    counters mutated inside the compiled, graphed draft."""
    from draftsmith.engine import speculative, tree
    from draftsmith.models import triton_head

    monkeypatch.setattr(triton_head, "BLOCK_V", 32)
    monkeypatch.setattr(triton_head, "JOIN", join)
    monkeypatch.setattr(speculative, "FUSED_PHASES", speculative.fused_phases(
        "all" if whole else "0"))
    target, _, eager = pair
    drafter = cast(make_drafter(target, 96), torch.float32)
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    heads = count_compiled_calls(monkeypatch, triton_head, "head_top_k", lambda *a: True)
    decs = {}
    for head in ("cublas", "triton"):
        monkeypatch.setattr(tree, "DRAFT_HEAD", head)
        decs[head] = SpecDecoder(Runtime(target, 4, 160, graphs=True, compile=True), drafter,
                                 4, 4, 10)
        decs[head].capture([4, 1])
    assert_same_trees_each_cycle(
        decs["cublas"], decs["triton"],
        lambda i: monkeypatch.setattr(tree, "DRAFT_HEAD", ("cublas", "triton")[i]))
    assert heads.item() > 0
    assert decs["triton"].generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    assert not any(st.unfused for st in decs["triton"].states.values())
    counts = [st.tree.head_counts for st in decs["triton"].states.values()]
    assert all((c is not None and not c.any()) if join == "kernel" else c is None for c in counts)


def tie_free_logits(*shape: int, g: torch.Generator) -> torch.Tensor:
    """bf16 logits whose 8 best values per row are distinct (bf16 draws tie often, and the
    top-k methods break ties differently), at random positions."""
    x = torch.randn(*shape, device="cuda", generator=g)
    best = torch.rand(*shape, device="cuda", generator=g).topk(8, dim=-1).indices
    x.scatter_(-1, best, 10 + 0.25 * torch.arange(8.0, device="cuda").expand_as(best))
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("method", ["chunk", "topk", "max"])
def test_compiled_tree_picks_at_the_default_drafters_shapes(monkeypatch, method):
    """The compiled greedy picks at the shapes the default drafter runs (bf16 logits over its
    24,576-token draft vocab, batches 1 and 8): the tiny vocab of the engine tests fits one CTA,
    where inductor splits these reductions. The root's children (under chunk and topk; max
    leaves them eager) and a depth's k*k children with the next frontier pick what eager
    torch.topk picks, scores equal to rounding."""
    from draftsmith.engine import tree

    torch._dynamo.reset()  # static shapes, as a fresh engine process compiles them first
    monkeypatch.setattr(tree, "TREE_TOPK", method)
    root, grow, _ = tree.compiled_bookkeeping()
    g = torch.Generator("cuda").manual_seed(0)
    k, v, hid = 4, 24576, 576
    d2t = torch.randint(0, 8, (v,), device="cuda", generator=g)
    for b in (1, 8):
        x = tie_free_logits(b, v, g=g)
        want = x.float().topk(k, dim=-1).indices
        if method != "max":
            ids, inc, tok = root(x, d2t, k)
            assert torch.equal(ids, want) and torch.equal(tok, want + d2t[want])
            assert (inc < 0).all()
        h = torch.randn(b, k, hid, device="cuda", generator=g).to(torch.bfloat16)
        f_score = -torch.rand(b, k, device="cuda", generator=g, dtype=torch.float64)
        f_flat = torch.arange(1, k + 1, device="cuda").expand(b, k)
        f_anc = torch.zeros(b, k, 2 * k, dtype=torch.bool, device="cuda")
        own = torch.zeros(k, 2 * k, dtype=torch.bool, device="cuda")
        args = (tie_free_logits(b, k, v, g=g), h, f_score, f_flat, f_anc, own, d2t, k, False)
        got = grow(*args)
        monkeypatch.setattr(tree, "TREE_TOPK", "topk")
        exact = tree.grow_greedy(*args)
        monkeypatch.setattr(tree, "TREE_TOPK", method)
        for a, e in zip(got, exact, strict=True):
            assert torch.equal(a, e) if not a.is_floating_point() else torch.allclose(a, e)


@pytest.mark.parametrize("attention,decode,unsplit", [("sdpa", "small", 0), ("matmul", "small", 0),
                                                      ("triton", "triton", 0),
                                                      ("triton", "small", 1)])
@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (4, 4, 10)])
def test_other_verify_attention_equals_plain_greedy(pair, monkeypatch, steps, topk, n, attention,
                                                    decode, unsplit):
    """DRAFTSMITH_VERIFY_ATTENTION=sdpa or matmul (the non-default paths for compiled verify
    shapes), and the default, triton, with DRAFTSMITH_DECODE_ATTENTION=triton for one-token
    steps too, or with every call unsplit (DRAFTSMITH_ATTN_UNSPLIT_PROGRAMS=1): still plain
    greedy's output; the Triton kernel runs exactly where chosen."""
    from draftsmith.models import llama, triton_attention

    _, drafter, eager = pair
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    monkeypatch.setattr(llama, "VERIFY_ATTENTION", attention)
    monkeypatch.setattr(llama, "DECODE_ATTENTION", decode)
    monkeypatch.setattr(triton_attention, "UNSPLIT_PROGRAMS", unsplit)
    kernel = count_compiled_calls(monkeypatch, triton_attention, "cache_attention",
                                  lambda q, *a: q.shape[1] > 1)
    one_token = count_compiled_calls(monkeypatch, triton_attention, "cache_attention",
                                     lambda q, *a: q.shape[1] == 1)
    target = cast(tiny_target(), torch.float32)  # its own compiled layers, traced anew
    dec = SpecDecoder(Runtime(target, 4, 160, graphs=True, compile=True), drafter, steps, topk, n)
    dec.capture([4, 1])
    assert dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    assert (kernel.item() > 0) == (attention == "triton")
    if decode != "triton":
        assert one_token.item() == 0
    elif topk == 1:  # a chain's draft steps are one-token drafter forwards
        assert one_token.item() > 0


def assert_graphed_chain_and_tree_equal(drafter, ref: list[list[int]]) -> None:
    """A chain (3/1) and a tree (4/4/10) decoder on one compiled, graphed runtime of a fresh
    fp32 tiny target, batches 4 and 1 captured: both give `ref`, plain greedy's tokens."""
    rt = Runtime(cast(tiny_target(), torch.float32), 4, 160, graphs=True, compile=True)
    for steps, topk, n in [(3, 1, None), (4, 4, 10)]:
        dec = SpecDecoder(rt, drafter, steps, topk, n)
        dec.capture([4, 1])
        assert dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref


def test_split_linears_equal_plain_greedy(pair, monkeypatch):
    """DRAFTSMITH_SPLIT_LINEAR_ROWS=64 (verify and drafter-depth linears through the Triton split
    kernel, its partials summed in the consumers): chain and tree decoders keep plain greedy."""
    from draftsmith.models import triton_linear

    _, drafter, eager = pair
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    monkeypatch.setattr(triton_linear, "SPLIT_LINEAR_ROWS", 64)
    calls = count_compiled_calls(monkeypatch, triton_linear, "split_linear", lambda x, *a: True)
    assert_graphed_chain_and_tree_equal(drafter, ref)
    assert calls.item() > 0


def test_norm_linears_equal_plain_greedy(pair, monkeypatch):
    """DRAFTSMITH_NORM_LINEAR_ROWS=64 (the target's norms inside its qkv and gate_up linears at
    3-64 token rows, silu*mul inside the gate_up): chain and tree decoders keep plain greedy."""
    from draftsmith.models import triton_norm_linear

    _, drafter, eager = pair
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    monkeypatch.setattr(triton_norm_linear, "NORM_LINEAR_ROWS", 64)
    # the target's qkv calls alone (five arguments, no gate_up width): its verify fused
    calls = count_compiled_calls(monkeypatch, triton_norm_linear, "norm_linear",
                                 lambda *a, **kw: len(a) == 5)
    assert_graphed_chain_and_tree_equal(drafter, ref)
    assert calls.item() > 0


def test_static_shapes_equal_plain_greedy(pair, monkeypatch):
    """DRAFTSMITH_STATIC_SHAPES=1 (one compiled graph per shape): chain and tree decoders on one
    runtime, batches 4 and 1, still plain greedy."""
    from draftsmith.engine import runtime

    _, drafter, eager = pair
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    monkeypatch.setattr(runtime, "STATIC_SHAPES", True)
    assert_graphed_chain_and_tree_equal(drafter, ref)


@pytest.mark.parametrize("drafts", ["topk", "drawn"])
@pytest.mark.parametrize("steps,topk,n,compiled,plain", [
    (3, 1, None, False, False), (3, 3, 8, False, False), (3, 1, None, True, False),
    (3, 3, 8, True, False), (3, 1, None, True, True), (3, 3, 8, True, True)])
def test_graphed_sampling_runs_and_stops_at_eos(pair, steps, topk, n, compiled, plain, drafts,
                                                monkeypatch):
    """compiled: compiled layers and fused phases (drawn drafts: the extend alone; topk: greedy's
    fused phases, the target's draws made eagerly before the fused accept under top-k and top-p,
    or, plain: temperature alone, inside it). Rows of one prompt draw apart, and a second run
    draws afresh: the graphs replay new random numbers."""
    from draftsmith.engine import speculative

    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    from test_speculative_sampling import left_greedy

    target, drafter, eager = pair
    if compiled and topk > 1:  # a plain drafter: the Triton head forms its trees, root included
        drafter = cast(make_drafter(target, 96), torch.float32)
    rt = Runtime(target, 4, 160, graphs=True, compile=compiled)
    params = SamplingParams(0.8) if plain else SamplingParams(0.8, top_p=0.9, top_k=20)
    dec = SpecDecoder(rt, drafter, steps, topk, n, params)
    want = {"extend"} if drafts == "drawn" else {"extend", "accept"} | (
        {"draft"} if topk > 1 else set())
    assert dec.fused == (frozenset(want) if compiled else frozenset())
    assert dec.accept_draws == (plain and drafts == "topk")
    res = dec.generate(PROMPTS, NEW, eos_ids=[2, 7])
    assert not any(st.unfused for st in dec.states.values())  # no fallback from a fused phase
    assert all(len(t) <= NEW and 2 not in t and 7 not in t for t in res.tokens)
    assert res.mean_accept_length >= 1
    same = [PROMPTS[0]] * 4
    first, again = dec.generate(same, NEW, eos_ids=[]), dec.generate(same, NEW, eos_ids=[])
    assert len({tuple(t) for t in first.tokens}) > 1 and first.tokens != again.tokens
    assert left_greedy(eager, same, first.tokens)


# rows 0 and 2 decode as plain greedy, rows 1 and 3 draw apart from it
ROW_SETS = {
    # the greedy row and the row at top_k 1 beside rows drawing at T 1.5
    "own settings": [SamplingParams(), SamplingParams(1.5, top_p=0.99),
                     SamplingParams(0.6, top_k=1, top_p=0.5), SamplingParams(1.5, top_k=40)],
    # a sigma so small that only the largest logit stays, at T 1.5, beside a wide sigma and none
    "top_n_sigma": [SamplingParams(1.5, top_n_sigma=1e-6), SamplingParams(1.5, top_n_sigma=50.0),
                    SamplingParams(1.5, top_n_sigma=1e-6), SamplingParams(1.5)],
}


@pytest.mark.parametrize("rows", list(ROW_SETS))
@pytest.mark.parametrize("steps,topk,n,compiled", [
    (3, 1, None, False), (3, 3, 8, False), (3, 1, None, True), (3, 3, 8, True)])
def test_graphed_rows_of_one_batch_sample_their_own_settings(pair, steps, topk, n, compiled,
                                                             rows, monkeypatch):
    """Rows of one graphed (and compiled) decoder under four settings (top_n_sigma too): the
    greedy ones decode as plain greedy beside rows that draw apart; the decoder takes the
    settings moved to other rows without a new capture."""
    from draftsmith.engine import speculative

    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    target, drafter, eager = pair
    if compiled and topk > 1:
        drafter = cast(make_drafter(target, 96), torch.float32)
    rt = Runtime(target, 4, 160, graphs=True, compile=compiled)
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    params = ROW_SETS[rows]
    dec = SpecDecoder(rt, drafter, steps, topk, n, params[1])
    res = dec.generate(PROMPTS, NEW, eos_ids=[], params=params)
    graphs = len(rt.graphs.graphs)
    assert res.tokens[0] == ref[0] and res.tokens[2] == ref[2]
    assert res.tokens[1] != ref[1] and res.tokens[3] != ref[3]
    again = dec.generate(PROMPTS, NEW, eos_ids=[], params=params[1:] + params[:1])
    assert again.tokens[1] == ref[1] and again.tokens[3] == ref[3]
    assert len(rt.graphs.graphs) == graphs


@pytest.mark.parametrize("steps,topk,n,compiled", [
    (3, 1, None, False), (3, 3, 8, False), (3, 1, None, True), (3, 3, 8, True)])
def test_a_seeded_call_that_captures_draws_what_a_later_seeded_call_draws(pair, steps, topk, n,
                                                                         compiled):
    """The first seeded call at a batch size captures its graphs (and compiles): their warm-up
    steps must not draw from the caller's seed, or the first answer under a seed differs from
    every later one (a library user who seeds and calls once could not reproduce it)."""
    target, drafter, _ = pair
    if compiled and topk > 1:
        drafter = cast(make_drafter(target, 96), torch.float32)
    dec = SpecDecoder(Runtime(target, 4, 160, graphs=True, compile=compiled), drafter, steps,
                      topk, n, SamplingParams(0.9))
    same = [PROMPTS[0]] * 3
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(dec.generate(same, NEW, eos_ids=[]).tokens)
    assert len({tuple(t) for t in runs[0]}) > 1  # rows really drew
    assert runs[0] == runs[1]


def test_bf16_greedy_divergences_sit_at_near_ties():
    """bf16 speculative vs plain greedy: rows may diverge, but only where the two candidate
    logits are within numerical noise of each other."""
    from draftsmith.bench.run import agreement

    target = cast(tiny_target(), torch.bfloat16)
    rt = Runtime(target, 4, 160, graphs=True)
    ref = generate(rt, PROMPTS, NEW, eos_ids=[])
    drafter = cast(make_drafter(target, 96, Steered), torch.bfloat16)
    drafter.steer(greedy_seq(rt, PROMPTS, NEW + 8), 0.7)
    res = SpecDecoder(rt, drafter, 3, 2, 6).generate(PROMPTS, NEW, eos_ids=[])
    report = agreement(target, [PROMPTS], ref, res.tokens, [])
    print(report)
    assert res.mean_accept_length > 1.2
    assert all(d["relative_gap"] < 0.1 for d in report["divergences"])


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (4, 4, 10)])
def test_small_linears_as_reductions_equal_plain_greedy(pair, monkeypatch, steps, topk, n):
    """DRAFTSMITH_SMALL_LINEAR_ROWS=16: the compiled engine's linears over <= 16 rows (the
    target's decode and short verifies, every drafter depth) run as inductor reductions; output
    stays plain greedy, and no such linear is traced as a GEMM."""
    from types import SimpleNamespace

    from draftsmith.models import parallel

    monkeypatch.setattr(parallel, "SMALL_LINEAR_ROWS", 16)
    gemm = parallel.F.linear
    hits = count_compiled_calls(monkeypatch, parallel, "reduce_linear", lambda *a: True)

    def refused(x, w, b=None):
        if torch.compiler.is_compiling() and x.numel() // x.shape[-1] <= 16:
            raise AssertionError("a small linear traced as a GEMM")
        return gemm(x, w, b)

    fns = SimpleNamespace(linear=refused, embedding=parallel.F.embedding)
    monkeypatch.setattr(parallel, "F", fns)
    torch._dynamo.reset()
    target, drafter, eager = pair
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    dec = SpecDecoder(Runtime(target, 4, 160, graphs=True, compile=True), drafter, steps, topk, n)
    dec.capture([4, 1])
    assert dec.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    plain = Runtime(target, 4, 160, graphs=True, compile=True)
    plain.capture([4, 1], [1, 8, 16])
    assert generate(plain, PROMPTS, NEW, eos_ids=[]) == ref
    assert hits.item() > 0  # the compiled graphs ran reductions


@pytest.mark.parametrize("steps,topk,n,compiled", [
    (3, 1, None, False), (4, 4, 10, False), (3, 1, None, True), (4, 4, 10, True)])
def test_refilled_rows_equal_plain_greedy_alone(pair, steps, topk, n, compiled):
    """Speculative refill on the GPU, graphed (and compiled): eight prompts through three rows,
    rows ending at EOS at different lengths, each answer the one its prompt gets alone from plain
    greedy decoding; profiled, the refills are timed."""
    from test_refill import PROMPTS as MANY

    from draftsmith.engine.spec_refill import generate_refill, warm_refill

    target, drafter, eager = pair
    alone = [generate(eager, [p], NEW, eos_ids=[])[0] for p in MANY]
    eos = sorted({alone[0][3], alone[2][7]})
    want = [generate(eager, [p], NEW, eos_ids=eos)[0] for p in MANY]
    assert len({len(w) for w in want}) > 2
    rt = Runtime(target, 3, 160, graphs=True, compile=compiled)
    dec = SpecDecoder(rt, drafter, steps, topk, n, profile=True)
    warm_refill(dec, MANY, 3)
    res = generate_refill(dec, MANY, NEW, eos_ids=eos, rows=3, check_every=2)
    assert res.tokens == want
    assert res.phases is not None and res.phases.ms["refill"] > 0
    assert generate_refill(dec, MANY[::-1], NEW, eos_ids=eos, rows=3).tokens == want[::-1]


def test_graphs_dropped_during_a_capture_are_destroyed_after_it(pair, monkeypatch):
    """A dead decoder's graphs dropped while another graph is being captured (its finalizer,
    when the GC collects it then) must not be destroyed then: that invalidates the capture (the
    H200's CUBLAS_STATUS_EXECUTION_FAILED in a one-process sweep of `bench` runs). Here the drop
    happens right after a real capture begins; the new decoder still decodes plain greedy, and
    the cyclic GC was off inside every capture."""
    import gc

    target, drafter, eager = pair
    ref = generate(eager, PROMPTS, NEW, eos_ids=[])
    rt = Runtime(target, 4, 160, graphs=True)
    old = SpecDecoder(rt, drafter, 3, 2, 6)
    old.generate(PROMPTS, 8, eos_ids=[])
    assert any(isinstance(k, tuple) and k[0] == old.gkey for k in rt.graphs.graphs)
    begin, seen = torch.cuda.CUDAGraph.capture_begin, []

    def begin_then_drop(self, *a, **kw):
        begin(self, *a, **kw)
        seen.append(gc.isenabled())
        if len(seen) == 1:
            rt.graphs.forget(old.gkey)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_then_drop)
    new = SpecDecoder(rt, drafter, 4, 4, 10)
    assert new.generate(PROMPTS, NEW, eos_ids=[]).tokens == ref
    assert seen and not any(seen)
    assert not any(isinstance(k, tuple) and k[0] == old.gkey for k in rt.graphs.graphs)
