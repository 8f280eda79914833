"""Speculative sampling keeps the target distribution: chi-square tests against exact
distributions, on the acceptance rules alone (many draws) and end to end (tiny vocabulary)."""

from __future__ import annotations

import pytest
import torch
from test_speculative import Steered, greedy_seq, make_drafter, tiny_target

from draftsmith.engine import speculative, verify
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams, draw, probs
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.engine.tree import draw_k

V, VD = 6, 5
HOT = torch.tensor([0, 1, 2, 4, 5])  # target id 3 is outside the draft vocabulary
PROMPTS = [[1, 5, 9, 30, 44], [1, 60, 61], [1, 7, 8, 9, 10], [1, 20]]  # the engine tests' rows


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of counts against probabilities; cells expecting < 5 are pooled."""
    c, e = counts.flatten().double(), expected_probs.flatten().double() * counts.sum().double()
    big = e >= 5
    stat = ((c[big] - e[big]) ** 2 / e[big]).sum()
    df = int(big.sum()) - 1
    if (~big).any() and e[~big].sum() > 0:
        stat = stat + (c[~big].sum() - e[~big].sum()) ** 2 / e[~big].sum()
        df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def conditional_p(first: torch.Tensor, second: torch.Tensor, table: torch.Tensor) -> float:
    """Sum of per-condition chi-squares: second | first = x against table[x]."""
    stat, df = torch.zeros((), dtype=torch.float64), 0
    for x in range(table.shape[0]):
        sel = second[first == x]
        if len(sel) < 200:
            continue
        c = torch.bincount(sel, minlength=V).double()
        e = table[x].double() * len(sel)
        big = e >= 5
        stat += ((c[big] - e[big]) ** 2 / e[big]).sum()
        df += int(big.sum()) - 1
    assert df > 10
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def tables():
    g = torch.Generator().manual_seed(3)
    p0 = torch.rand(V, generator=g) ** 2
    p1 = torch.rand(V, V, generator=g) ** 2
    p2 = torch.rand(V, V, V, generator=g) ** 2
    q0 = torch.rand(VD, generator=g) ** 2
    q1 = torch.rand(V, VD, generator=g) ** 2
    norm = lambda t: t / t.sum(-1, keepdim=True)  # noqa: E731
    return norm(p0), norm(p1), norm(p2), norm(q0), norm(q1)


def test_chain_rejection_sampling_is_exact(tables):
    p0, p1, p2, q0, q1 = tables
    torch.manual_seed(0)
    b = 200_000
    d1 = draw(q0.expand(b, VD))
    d2 = draw(q1[HOT[d1]])
    t1, t2 = HOT[d1], HOT[d2]
    logits = torch.stack([p0.log().expand(b, V), p1[t1].log(), p2[t1, t2].log()], 1)
    tok = torch.stack([torch.zeros_like(t1), t1, t2], 1)
    qbank = torch.stack([q0.expand(b, VD), q1[t1]], 1)
    n, bonus = verify.chain_sampled(logits, tok, torch.stack([d1, d2], 1), qbank, HOT,
                                    SamplingParams(1.0))
    e0 = torch.where(n >= 1, t1, bonus)
    assert chi_square_p(torch.bincount(e0, minlength=V), p0) > 1e-3
    assert chi_square_p(torch.bincount(t1, minlength=V), p0) < 1e-6  # the drafts alone differ
    on = n >= 1
    e1 = torch.where(n >= 2, t2, bonus)
    assert conditional_p(e0[on], e1[on], p1) > 1e-3
    full = n == 2  # both drafts accepted: the bonus comes from the target alone, p2
    assert conditional_p(e0[full] * V + e1[full], bonus[full], p2.view(V * V, V)) > 1e-3


def test_tree_multi_round_rejection_is_exact(tables):
    """Root with three children drawn i.i.d. from q0; the first has two children, the second one,
    drawn from q1 of their parent's token."""
    p0, p1, p2, q0, q1 = tables
    torch.manual_seed(1)
    _, t_first, t_best, n, bonus = seven_node_tree(p0.log(), p1.log(), p2.log(), q0, q1, HOT,
                                                   200_000, SamplingParams(1.0))
    e0 = torch.where(n >= 1, t_first, bonus)
    assert chi_square_p(torch.bincount(e0, minlength=V), p0) > 1e-3
    on = n >= 1
    e1 = torch.where(n >= 2, t_best, bonus)
    assert conditional_p(e0[on], e1[on], p1) > 1e-3

def seven_node_tree(l0, l1, l2, q0, q1, hot, b: int, params: SamplingParams):
    """The reviews' sampled tree, verified by `verify.tree_sampled`: root, three children drawn
    i.i.d. from q0 (with replacement: they repeat), the first with two children and the second
    with one, drawn from q1 of their parent's token; logits l0 [V], l1 [V, V], l2 [V, V, V] by
    the tokens before. Returns the root's drawn children [b, 3], each row's first and second
    emitted draft tokens (where accepted), the accepted count and the bonus token."""
    kids = draw_k(q0.expand(b, q0.shape[-1]), 3)
    d4, d6 = draw_k(q1[hot[kids[:, 0]]], 2), draw_k(q1[hot[kids[:, 1]]], 1)
    draft = torch.cat([torch.zeros_like(kids[:, :1]), kids, d4, d6], 1)
    tok = hot[draft]
    parent = torch.tensor([0, 0, 0, 0, 1, 1, 2]).expand(b, 7)
    depth = torch.tensor([0, 1, 1, 1, 2, 2, 2]).expand(b, 7)
    qsrc = torch.tensor([0, 0, 0, 0, 1, 1, 2]).expand(b, 7)
    qbank = torch.stack([q0.expand(b, q0.shape[-1]), q1[tok[:, 1]], q1[tok[:, 2]]], 1)
    logits = torch.cat([l0.expand(b, 1, l0.shape[-1]), l1[tok[:, 1:4]],
                        l2[tok[:, parent[0, 4:]], tok[:, 4:]]], 1)
    best, n, bonus = verify.tree_sampled(logits, tok, draft, parent, qsrc, depth, qbank, hot,
                                         params)
    first = torch.where(n == 2, parent.gather(1, best[:, None])[:, 0], best)
    return kids, tok.gather(1, first[:, None])[:, 0], tok.gather(1, best[:, None])[:, 0], n, bonus


def exact_joint(model, prompt: list[int], params: SamplingParams, vocab: int) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) by enumerating every x1, x2."""
    p = len(prompt)
    with torch.no_grad():
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
        seqs = torch.cat([torch.tensor(prompt).expand(vocab * vocab, p), pairs], 1)
        lg = model(seqs, torch.arange(p + 2).expand(vocab * vocab, -1)).logits
    p1 = probs(lg[0, p - 1], params)
    p2 = probs(lg[::vocab, p], params)
    p3 = probs(lg[:, p + 1], params).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("drafts", ["topk", "topk-fused", "drawn"])
@pytest.mark.parametrize("steps,topk,n,temp,top_k", [(2, 1, None, 1.0, 0), (2, 3, 5, 0.8, 6)])
def test_end_to_end_sampling_matches_the_target(steps, topk, n, temp, top_k, drafts,
                                                monkeypatch):
    """4096 draws of (x1, x2, x3); x2 and x3 come from the first speculative cycle. With these
    sizes an acceptance test skewed by a factor 1.25 fails (p < 0.003). Both rules for sampled
    drafts: greedy's drafts matched against the target's draws (topk; -fused: top-k off, so the
    draws are made inside the accept's one compiled function, as a compiled engine makes them),
    and drafts drawn from the drafter, rejection-sampled (drawn)."""
    drafts, fused = drafts.removesuffix("-fused"), drafts.endswith("-fused")
    top_k = 0 if fused else top_k
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    vocab, b, runs = 8, 1024, 4
    target = tiny_target(vocab, seed=5, hidden_size=16, intermediate_size=32, num_layers=3,
                         num_heads=2, num_kv_heads=1, head_dim=8)
    prompt = [3, 1, 4]
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    if drafts == "drawn":
        drafter = make_drafter(target, 6, seed=6, std=0.6)
        with torch.no_grad():
            drafter.lm_head.weight.mul_(0.1)  # a q close enough to p to be accepted often
    else:  # greedy's drafts: the target's greedy continuation, often the target's draw too
        seq = greedy_seq(Runtime(target, 1, 24), [prompt], 4).expand(b, -1).contiguous()
        drafter = make_drafter(target, 6, Steered, seed=6, std=0.6).steer(seq, 1.0)
    params = SamplingParams(temp, top_k=top_k)
    dec = SpecDecoder(Runtime(target, b, 24), drafter, steps, topk, n, params)
    assert dec.drawn == (drafts == "drawn") and (dec.fusable() >= {"accept"}) != dec.drawn
    if fused:
        dec.compile_bookkeeping(fuse={"accept"})
        assert dec.fused == {"accept"} and dec.accept_draws
    torch.manual_seed(7)
    counts = torch.zeros(vocab, vocab, vocab)
    for _ in range(runs):
        res = dec.generate([prompt] * b, 3, eos_ids=[])
        for t in res.tokens:
            counts[t[0], t[1], t[2]] += 1
    assert res.mean_accept_length > 1.3
    assert not any(st.unfused for st in dec.states.values())  # no fallback from the fused accept
    joint = exact_joint(target, prompt, params, vocab)
    assert chi_square_p(counts, joint) > 1e-3
    assert chi_square_p(counts.sum(2), joint.sum(2)) > 1e-3


MIXED = {
    "temperature": (SamplingParams(0.6), SamplingParams(1.4)),
    "filtered": (SamplingParams(0.8, top_k=4), SamplingParams(1.2, top_p=0.85)),
}


def small_target():
    target = tiny_target(8, seed=5, hidden_size=16, intermediate_size=32, num_layers=3,
                         num_heads=2, num_kv_heads=1, head_dim=8)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    return target


def assert_halves_match(counts: torch.Tensor, target, prompt: list[int], kind: str) -> None:
    """counts[i] of (x1, x2, x3) drawn by the rows at MIXED[kind][i]: each half matches its own
    setting's exact joint, and the first is told apart from the second's."""
    joints = [exact_joint(target, prompt, p, 8) for p in MIXED[kind]]
    assert chi_square_p(counts[0], joints[0]) > 1e-3 and chi_square_p(counts[1], joints[1]) > 1e-3
    assert chi_square_p(counts[0], joints[1]) < 1e-6


@pytest.mark.parametrize("path", ["static", "refill"])
@pytest.mark.parametrize("kind", ["temperature", "filtered"])
@torch.no_grad()
def test_baseline_rows_of_one_batch_each_sample_their_own_setting(kind, path):
    """Plain decoding, static (`decoder`) and refilled (`RefillState`), half the rows at one
    setting and half at another: each half's 2048 draws of (x1, x2, x3) match its own setting."""
    from draftsmith.engine.generate import run_generation
    from draftsmith.engine.refill import _refiller

    target, prompt, b = small_target(), [3, 1, 4], 1024
    rt, rows = Runtime(target, b, 24), list(MIXED[kind]) * (b // 2)
    torch.manual_seed(7)
    counts = torch.zeros(2, 8, 8, 8)
    for _ in range(4):
        if path == "static":
            tokens = run_generation(rt, [prompt] * b, 3, rows, eos_ids=[]).tokens
        else:
            state, step = _refiller(rt, b, 3, [], rows[0])
            state.start(list(range(b)), [prompt] * b, rows)
            step()
            step()
            tokens = state.out.tolist()
        for i, t in enumerate(tokens):
            counts[i % 2, t[0], t[1], t[2]] += 1
    assert_halves_match(counts, target, prompt, kind)


@pytest.mark.parametrize("steps,topk,n", [(2, 1, None), (2, 3, 5)])
@pytest.mark.parametrize("kind", ["temperature", "filtered"])
def test_rows_of_one_batch_each_sample_their_own_setting(kind, steps, topk, n, monkeypatch):
    """A server's batch holds requests of one kind of sampling at different settings: half the
    rows at one setting, half at another, in one chain or tree decoder (the temperature kind's
    draws made inside the compiled accept). Each half's 2048 draws of (x1, x2, x3) match the
    exact joint of its own setting, and not the other's."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    target, prompt, b = small_target(), [3, 1, 4], 1024
    seq = greedy_seq(Runtime(target, 1, 24), [prompt], 4).expand(b, -1).contiguous()
    drafter = make_drafter(target, 6, Steered, seed=6, std=0.6).steer(seq, 1.0)
    rows = list(MIXED[kind]) * (b // 2)
    dec = SpecDecoder(Runtime(target, b, 24), drafter, steps, topk, n, rows[0])
    dec.compile_bookkeeping(fuse={"accept"})
    assert dec.accept_draws == (kind == "temperature")
    res, counts = alternating_counts(dec, prompt, b, rows)
    assert not any(st.unfused for st in dec.states.values())
    assert res.mean_accept_length > 1.3
    assert_halves_match(counts, target, prompt, kind)


def filtered_by_hand(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k (ties with the k-th kept), then top-p over what top-k kept: one
    row at a time, from torch.topk and a Python walk down the sorted probabilities."""
    out = []
    for row in logits.float().view(-1, logits.shape[-1]) / p.temperature:
        if p.top_k:
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        keep, mass = torch.zeros_like(row, dtype=torch.bool), 0.0
        for j in torch.argsort(row, descending=True).tolist():
            keep[j] = mass < p.top_p or p.top_p == 1
            mass += float(row.softmax(-1)[j])
        out.append(row.masked_fill(~keep, float("-inf")).softmax(-1))
    return torch.stack(out).view(logits.shape)


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 3, 8)])
@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_greedy_rows_among_sampled_ones_decode_as_greedy(steps, topk, n, monkeypatch):
    """A decoder of temperature sampling, its accept compiled with the draws inside: the rows at
    temperature 0 decode exactly as plain greedy beside rows drawing at T 1.3, and accept what
    greedy accepts; the sampled rows part from greedy."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    target = tiny_target()
    rt = Runtime(target, 4, 128)
    drafter = make_drafter(target, 96)
    greedy = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS, 20, eos_ids=[])
    rows = [SamplingParams(), SamplingParams(1.3), SamplingParams(), SamplingParams(0.8)]
    dec = SpecDecoder(rt, drafter, steps, topk, n, rows[1])
    dec.compile_bookkeeping(fuse={"accept"})
    assert dec.accept_draws
    torch.manual_seed(3)
    res = dec.generate(PROMPTS, 20, eos_ids=[], params=rows)
    assert res.tokens[0] == greedy.tokens[0] and res.tokens[2] == greedy.tokens[2]
    assert res.tokens[1] != greedy.tokens[1] and res.tokens[3] != greedy.tokens[3]
    assert not any(st.unfused for st in dec.states.values())


def test_row_settings_give_each_row_its_own_distribution():
    """Each row's distribution under `RowSampling` is what `probs` gives that row's setting alone;
    a state takes only settings of its own kind, one a row."""
    from draftsmith.engine.sampling import RowSampling
    from draftsmith.errors import DraftsmithError

    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0)) * 3
    settings = [SamplingParams(0.5, top_k=3), SamplingParams(1.0, top_p=0.6),
                SamplingParams(2.0, top_k=10, top_p=0.9)]
    rs = RowSampling(3, "cpu", settings[0])
    rs.set(torch.arange(3), settings)
    got = rs.probs(logits)
    for i, p in enumerate(settings):
        assert torch.allclose(got[i], probs(logits[i], p), atol=1e-6)
        assert torch.allclose(got[i], filtered_by_hand(logits[i], p), atol=1e-6)
        assert torch.allclose(rs.probs(logits[i : i + 1], torch.tensor([i]))[0], got[i])
    temps = RowSampling(2, "cpu", SamplingParams(0.7))
    temps.set(torch.tensor([1]), [SamplingParams(1.5)])
    want = [probs(logits[i], SamplingParams(t)) for i, t in enumerate((0.7, 1.5))]
    assert all(torch.allclose(temps.probs(logits[:2])[i], want[i], atol=1e-6) for i in range(2))
    with pytest.raises(DraftsmithError, match="cannot take"):
        temps.set(torch.tensor([0]), [SamplingParams(0.7, top_p=0.5)])
    with pytest.raises(DraftsmithError, match="2 sampling settings for 1 rows"):
        temps.set(torch.tensor([0]), [SamplingParams(0.7)] * 2)
    temps.set(torch.tensor([0]), [SamplingParams()])  # a greedy row among sampled ones
    draws = torch.stack([temps.sample(logits[:2]) for _ in range(50)])
    assert (draws[:, 0] == logits[0].argmax(-1)).all() and len(draws[:, 1].unique()) > 1
    with pytest.raises(DraftsmithError, match="cannot take"):
        RowSampling(1, "cpu", SamplingParams()).set(torch.tensor([0]), [SamplingParams(0.7)])


def test_a_walk_over_the_targets_draws_is_exact_for_fixed_drafts(tables):
    """The topk rule on the acceptance alone: fixed drafts (a root with three children, the
    first with two), the target's token drawn at every node, the drafts matching those draws
    walked as the greedy walk does. The emitted pair follows the target's own p0 and p1, though
    the drafts never change."""
    p0, p1, p2, _, _ = tables
    torch.manual_seed(2)
    b = 200_000
    tok = torch.tensor([0, 4, 1, 2, 5, 0]).expand(b, 6)
    parent = torch.tensor([0, 0, 0, 0, 1, 1]).expand(b, 6)
    depth = torch.tensor([0, 1, 1, 1, 2, 2]).expand(b, 6)
    logits = torch.cat([p0.log().expand(b, 1, V), p1[tok[:, 1:4]].log(),
                        p2[tok[:, parent[0, 4:]], tok[:, 4:]].log()], 1)
    picks = draw(probs(logits, SamplingParams(1.0)))
    best, n, bonus = verify.tree_greedy(picks, tok, parent, depth, 2)
    for a, g in zip(verify.tree_greedy(logits, tok, parent, depth, 2),
                    verify.tree_greedy(logits.argmax(-1), tok, parent, depth, 2), strict=True):
        assert torch.equal(a, g)  # logits walk their argmax, as picks of their own
    first = torch.where(n == 2, parent.gather(1, best[:, None])[:, 0], best)
    e0 = torch.where(n >= 1, tok.gather(1, first[:, None])[:, 0], bonus)
    assert chi_square_p(torch.bincount(e0, minlength=V), p0) > 1e-3
    assert (n == 2).float().mean() > 0.02  # the walk went two deep often enough to test
    on = n >= 1
    e1 = torch.where(n >= 2, tok.gather(1, best[:, None])[:, 0], bonus)
    assert conditional_p(e0[on], e1[on], p1) > 1e-3


@pytest.mark.parametrize("drafts", ["topk", "drawn"])
@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 3, 8)])
def test_sampling_that_keeps_one_token_decodes_as_greedy(steps, topk, n, drafts, monkeypatch):
    """top_k 1 leaves the sampler one token: both sampled-draft rules emit plain greedy's tokens,
    and under topk the drafts are greedy's too, so each cycle accepts what greedy accepts."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    target = tiny_target()
    rt = Runtime(target, 4, 128)
    ref = greedy_seq(rt, PROMPTS, 20)
    drafter = make_drafter(target, 96)
    greedy = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS, 20, eos_ids=[])
    dec = SpecDecoder(rt, drafter, steps, topk, n, SamplingParams(0.9, top_k=1))
    torch.manual_seed(3)
    res = dec.generate(PROMPTS, 20, eos_ids=[])
    assert res.tokens == greedy.tokens
    assert [p + t for p, t in zip(PROMPTS, res.tokens, strict=True)] == [
        r[: len(p) + 20].tolist() for p, r in zip(PROMPTS, ref, strict=True)]
    if drafts == "topk":
        assert res.accept_hist == greedy.accept_hist


@pytest.mark.slow  # compiles the fused phases on CPU (~12-29 s)
def test_greedys_fused_phases_serve_sampled_trees(monkeypatch):
    """Under topk, a sampled tree runs greedy's fused draft, accept and extend (compiled here on
    CPU, as a compiled engine runs them): at top_k 1 they decode and accept as greedy's do, and
    at T 0.9 rows of one prompt draw apart and a second run draws afresh."""
    from draftsmith.engine.speculative import PHASES_FUSABLE

    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    target = tiny_target()
    rt = Runtime(target, 4, 128)
    drafter = make_drafter(target, 96)
    greedy = SpecDecoder(rt, drafter, 3, 3, 8).generate(PROMPTS, 20, eos_ids=[])
    one, warm = (SpecDecoder(rt, drafter, 3, 3, 8, SamplingParams(0.9, top_k=k)) for k in (1, 0))
    for dec in (one, warm):
        dec.compile_bookkeeping(fuse=set(PHASES_FUSABLE))
        assert dec.fused == frozenset(PHASES_FUSABLE)
    res = one.generate(PROMPTS, 20, eos_ids=[])
    assert res.tokens == greedy.tokens and res.accept_hist == greedy.accept_hist
    same = [PROMPTS[0]] * 4
    first, again = warm.generate(same, 20, eos_ids=[]), warm.generate(same, 20, eos_ids=[])
    assert len({tuple(t) for t in first.tokens}) > 1 and first.tokens != again.tokens
    assert left_greedy(rt, same, first.tokens)  # draws past the prefill's, not the argmax


@pytest.mark.slow  # compiles the fused phases on CPU (~12-29 s)
def test_every_temperature_shares_one_compiled_accept(monkeypatch):
    """The fused accept draws at a temperature held as a tensor: a second temperature (a server's
    next request) reuses the compiled accept instead of compiling another."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    target = tiny_target()
    rt, drafter = Runtime(target, 4, 128), make_drafter(target, 96)
    graphs = []
    for temp in (0.7, 1.3):
        dec = SpecDecoder(rt, drafter, 3, 3, 8, SamplingParams(temp))
        dec.compile_bookkeeping(fuse={"accept"})
        dec.generate(PROMPTS, 8, eos_ids=[])
        assert not any(st.unfused for st in dec.states.values())
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0]  # the counter counts, and held still


def left_greedy(rt: Runtime, prompts: list[list[int]], tokens: list[list[int]]) -> bool:
    """Whether some row's tokens after its first leave the greedy continuation of that first
    token: the prefill draws the first token eagerly, so only later ones show the accept's."""
    from draftsmith.engine.generate import generate

    conts = generate(rt, [p + t[:1] for p, t in zip(prompts, tokens, strict=True)],
                     len(tokens[0]) - 1, eos_ids=[])
    return any(t[1:] != c for t, c in zip(tokens, conts, strict=True))


def test_top_p_keeps_the_smallest_prefix_and_stays_eager_under_compile():
    """top_p keeps the fewest top tokens whose mass reaches top_p; a compiled caller gets the same
    distribution (the filter runs eagerly: inductor's split cumsum failed on the H200)."""
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.1, 0.2, 0.3, 0.4]]))
    p = SamplingParams(temperature=1.0, top_p=0.75)
    want = torch.tensor([[0.5 / 0.8, 0, 0.3 / 0.8, 0], [0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]])
    assert torch.allclose(probs(logits, p), want, atol=1e-6)
    compiled = torch.compile(lambda x: probs(x, p))
    assert torch.allclose(compiled(logits), want, atol=1e-6)
    assert torch._dynamo.explain(lambda x: probs(x, p))(logits).graph_break_count >= 1


@pytest.mark.slow
@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 3, 8)])
def test_sampling_with_a_fused_extend_draws_what_it_draws_in_parts(steps, topk, n, monkeypatch):
    """A compiled engine with drawn drafts fuses its extend phase alone (it draws nothing): the
    same seed gives the same tokens as the extend in parts, chain and tree. (Under topk the
    phases are greedy's: `test_greedys_fused_phases_serve_sampled_trees`.)"""
    from draftsmith.engine.speculative import compiled_phase

    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "drawn")

    target = tiny_target()
    drafter = make_drafter(target, 96)
    rt = Runtime(target, 4, 128)
    params = SamplingParams(0.9, top_k=20)
    out = []
    for fused in (False, True):
        dec = SpecDecoder(rt, drafter, steps, topk, n, params)
        if fused:  # what a compiled engine sets up, without compiling the target
            dec.fused, dec.phase_fns = frozenset({"extend"}), {"extend": compiled_phase("extend")}
        torch.manual_seed(11)
        out.append(dec.generate(PROMPTS, 24, eos_ids=[]))
    assert out[0].tokens == out[1].tokens and out[0].accept_hist == out[1].accept_hist
    assert out[0].mean_accept_length > 1


def test_the_sliced_argmax_picks_what_argmax_picks():
    """The two-stage argmax over vocabulary-long rows (slices' maxes, then the first slice with
    the largest) picks torch's index, ties to the first and NaN as the largest, eager and
    compiled, over whole slices or padded ones (Llama 3's 128,256 tokens are not whole), and
    keeps torch's own where the row is short."""
    from draftsmith.engine import sampling

    g = torch.Generator().manual_seed(0)
    w = sampling.ARGMAX_SLICE
    for shape in [(3, 4 * w), (2, 5, 3 * w), (1, 48 * w), (2, w), (2, 2 * w + 7), (1, 3 * w - 1)]:
        x = torch.randint(-3, 3, shape, generator=g).float()  # equal values everywhere
        x[..., -1] = 3.0  # a largest value in the last slice, after earlier ones that tie lower
        x.view(-1, shape[-1])[0, shape[-1] // 2] = 3.0  # a tie for the largest: the earlier wins
        assert torch.equal(sampling.argmax(x), x.argmax(-1)), shape
    x = torch.randn(2, 4 * w, generator=g)
    x[0, 3 * w + 1], x[0, 2 * w] = float("nan"), float("nan")
    x[1, :] = float("-inf")
    assert sampling.argmax(x).tolist() == x.argmax(-1).tolist() == [2 * w, 0]
    assert torch.equal(torch.compile(sampling.argmax)(x), x.argmax(-1))
    x = torch.full((2, 3 * w - 5), float("-inf"))  # every value the pad's: the first wins
    ints = torch.randint(-5, 5, (3, 2 * w + 3), generator=g)
    ints[1] = torch.iinfo(torch.int64).min
    assert sampling.argmax(x).tolist() == [0, 0]
    assert torch.equal(sampling.argmax(ints), ints.argmax(-1))


def alternating_counts(dec, prompt: list[int], b: int, rows: list) -> tuple:
    """Four seeded runs of `b` copies of `prompt`, rows alternating between two settings
    (`rows`): the last result and each setting's counts of its 3-token continuations [2, 8^3]."""
    torch.manual_seed(7)
    counts = torch.zeros(2, 8, 8, 8)
    for _ in range(4):
        res = dec.generate([prompt] * b, 3, eos_ids=[], params=rows)
        for i, t in enumerate(res.tokens):
            counts[i % 2, t[0], t[1], t[2]] += 1
    return res, counts
