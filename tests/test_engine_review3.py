"""Engine review 3: runtime sizes that are not counts, greedy speculative decoding against plain
greedy on random targets and drafters (chains and trees, mixed prompt lengths, EOS mid-row,
max_new mid-cycle, tight caches), and the sampled acceptance rules under top-k / top-p against
exact distributions (first and second token)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_speculative import Steered, greedy_seq, make_drafter, tiny_target
from test_speculative_sampling import chi_square_p, seven_node_tree

from draftsmith.engine import verify
from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams, draw, probs
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError


def small(vocab: int, seed: int):
    return tiny_target(vocab, seed=seed, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=16)


@pytest.mark.parametrize(("sizes", "what"), [
    ((2, 64.0), "max_seq 64.0"), ((2.0, 64), "max_batch 2.0"), ((0, 64), "max_batch 0"),
    ((2, -5), "max_seq -5"), ((True, 64), "max_batch True"), (("2", 64), "max_batch '2'"),
])
def test_runtime_sizes_that_are_not_counts_are_refused(sizes, what):
    """Runtime(model, b, 64.0) was a TypeError from torch.zeros, a negative size a RuntimeError,
    and max_batch True a one-row runtime; the drafter's runtime alike."""
    target = small(16, 0)
    drafter = make_drafter(target, 8)
    for make, name in ((lambda: Runtime(target, *sizes), "Runtime"),
                       (lambda: DrafterRuntime(drafter, *sizes), "DrafterRuntime")):
        with pytest.raises(DraftsmithError, match=f"^{name}: max_batch and max_seq must be whole "
                           f"numbers >= 1, got {what}$"):
            make()
    rt = Runtime(target, np.int64(2), np.int32(32))  # numpy ints are counts
    assert (rt.max_batch, rt.max_seq) == (2, 32)


def fuzz_case(seed: int) -> None:
    r = random.Random(seed)
    vocab = r.choice([12, 24, 48])
    target = small(vocab, seed)
    b = r.choice([1, 2, 3, 5])
    prompts = [[r.randrange(vocab) for _ in range(r.randint(1, 9))] for _ in range(b)]
    new = r.randint(1, 25)
    eos = [r.randrange(vocab)] if r.random() < 0.6 else []
    topk, steps = r.choice([1, 1, 2, 3, 4]), r.randint(1, 5)
    n = None if topk == 1 else r.randint(2, min(1 + topk + (steps - 1) * topk**2, 20))
    dv = r.randint(max(topk, 4), vocab)
    ref = generate(Runtime(target, b, 96), prompts, new, eos_ids=eos)
    if r.random() < 0.5:  # follows the target: high acceptance
        seq = greedy_seq(Runtime(target, b, 96), prompts, new + 12)
        drafter = make_drafter(target, dv, Steered, seed=seed).steer(seq, r.choice([0.5, 1.0]))
    else:
        drafter = make_drafter(target, dv, seed=seed, std=r.choice([0.1, 0.6]))
    margin = (steps + 1 if topk == 1 else n) * (topk > 1) + 2 * steps + 2
    max_seq = max(map(len, prompts)) + new + margin + r.choice([0, 1, 5])
    res = SpecDecoder(Runtime(target, b, max_seq), drafter, steps, topk, n).generate(
        prompts, new, eos_ids=eos)
    assert res.tokens == ref, (seed, steps, topk, n)


def test_greedy_speculation_equals_plain_greedy_on_random_settings():
    """Random targets, drafters (random or following the target), chains and trees, batches of
    mixed prompt lengths, EOS ending rows mid-run and caches just long enough."""
    for seed in range(8):
        fuzz_case(seed)


V, VD = 8, 7
HOT = torch.tensor([0, 1, 2, 3, 5, 6, 7])  # target id 4 is outside the draft vocabulary


def conditional_p(first: torch.Tensor, second: torch.Tensor, table: torch.Tensor) -> float:
    """Sum of per-condition chi-squares of second | first = x against table[x] (conditions of
    at least 200 draws; cells expecting < 5 left out)."""
    stat, df = torch.zeros((), dtype=torch.float64), 0
    for x in range(table.shape[0]):
        sel = second[first == x]
        if len(sel) < 200:
            continue
        c, e = torch.bincount(sel, minlength=V).double(), table[x].double() * len(sel)
        big = e >= 5
        stat += ((c[big] - e[big]) ** 2 / e[big]).sum()
        df += int(big.sum()) - 1
    assert df >= 3
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def tables():
    g = torch.Generator().manual_seed(11)
    lp0, lp1, lp2 = (torch.randn(*s, generator=g) * 1.5 for s in ((V,), (V, V), (V, V, V)))
    lq0, lq1 = (torch.randn(*s, generator=g) * 1.5 for s in ((VD,), (V, VD)))
    return lp0, lp1, lp2, lq0, lq1


FILTERS = [SamplingParams(0.7, top_k=4), SamplingParams(1.2, top_p=0.8),
           SamplingParams(1.0, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("params", FILTERS)
def test_chain_rejection_under_top_k_and_top_p_keeps_the_filtered_target(tables, params):
    """Drafts drawn from the drafter's filtered q; the first and second tokens follow the
    target's filtered p (not the unfiltered one)."""
    lp0, lp1, lp2, lq0, lq1 = tables
    torch.manual_seed(0)
    b = 100_000
    q0, q1 = probs(lq0, params), probs(lq1, params)
    d1 = draw(q0.expand(b, VD))
    d2 = draw(q1[HOT[d1]])
    t1, t2 = HOT[d1], HOT[d2]
    logits = torch.stack([lp0.expand(b, V), lp1[t1], lp2[t1, t2]], 1)
    tok = torch.stack([torch.zeros_like(t1), t1, t2], 1)
    n, bonus = verify.chain_sampled(logits, tok, torch.stack([d1, d2], 1),
                                    torch.stack([q0.expand(b, VD), q1[t1]], 1), HOT, params)
    p0, p1 = probs(lp0, params), probs(lp1, params)
    e0 = torch.where(n >= 1, t1, bonus)
    e1 = torch.where(n >= 2, t2, bonus)
    assert chi_square_p(torch.bincount(e0, minlength=V), p0) > 1e-3
    on = n >= 1  # a second token from this cycle: after an accepted first draft
    assert (p0[e0] > 0).all() and (p1[e0[on], e1[on]] > 0).all()  # none the filters dropped
    assert conditional_p(e0[on], e1[on], p1) > 1e-3
    assert chi_square_p(torch.bincount(e0, minlength=V), probs(lp0, SamplingParams(1.0))) < 1e-6


@pytest.mark.parametrize("params", FILTERS)
def test_tree_rejection_under_top_k_and_top_p_keeps_the_filtered_target(tables, params):
    """Root with three i.i.d. children (duplicates included), the first with two children and
    the second with one; SpecInfer's multi-round rule with the residual norm(max(0, r - q))."""
    lp0, lp1, lp2, lq0, lq1 = tables
    torch.manual_seed(1)
    b = 100_000
    q0, q1 = probs(lq0, params), probs(lq1, params)
    kids, t_first, t_best, n, bonus = seven_node_tree(lp0, lp1, lp2, q0, q1, HOT, b, params)
    assert (kids[:, 0] == kids[:, 1]).float().mean() > 0.05  # siblings repeat
    e0 = torch.where(n >= 1, t_first, bonus)
    e1 = torch.where(n >= 2, t_best, bonus)
    p0, p1 = probs(lp0, params), probs(lp1, params)
    assert chi_square_p(torch.bincount(e0, minlength=V), p0) > 1e-3
    on = n >= 1
    assert conditional_p(e0[on], e1[on], p1) > 1e-3
    assert (n >= 1).float().mean() > 0.3  # the drafts were accepted often enough to matter


def test_residual_is_the_normalised_excess_of_p_over_q():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.4, 0.1, 0.3], [0.25, 0.25, 0.25, 0.25]])
    r = verify.residual(p, q)
    assert torch.allclose(r[0], torch.tensor([0.75, 0.0, 0.25, 0.0]))
    assert torch.equal(r[1], p[1])  # nothing left: p itself (that rejection has probability 0)


def test_graphs_asked_for_on_a_cpu_model_are_a_clear_error():
    """Runtime(cpu model, graphs=True) failed at the first forward with torch's "torch.cuda.Stream
    requires CUDA support", deep in a capture."""
    target = small(16, 0)
    rt = Runtime(target, 2, 64, graphs=True)
    for run in (lambda: generate(rt, [[1, 2]], 3),
                lambda: SpecDecoder(rt, make_drafter(target, 8), 2).generate([[1, 2]], 3)):
        with pytest.raises(DraftsmithError, match="^CUDA graphs need a CUDA device, not cpu: "
                           "make the runtime with graphs=False"):
            run()
