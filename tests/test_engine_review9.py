"""Engine review 9: sampled speculative decoding under top-nσ, where no test looked yet. The
target's top-nσ floor is taken over its whole vocabulary (not the drafter's smaller one) in the
rejection rules; rows that join a running batch (`spec_refill`) draw their own setting's
distribution, over rows that held another prompt at another setting; a drawn tree refilled."""

from __future__ import annotations

import pytest
import torch
from test_speculative import Steered, greedy_seq, make_drafter
from test_speculative_sampling import (
    HOT,
    V,
    chi_square_p,
    exact_joint,
    seven_node_tree,
    small_target,
)

from draftsmith.engine import spec_refill, speculative, verify
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams, draw, probs
from draftsmith.engine.speculative import SpecDecoder

# target id 3 lies outside the drafter's vocabulary (HOT) and far below the rest: over the whole
# vocabulary top-nσ keeps {0, 1, 2, 4, 5}, over the draft vocabulary's ids alone only {0, 1}
L0 = torch.tensor([2.0, 1.5, 0.3, -8.0, 1.0, -0.5])
SIGMA = SamplingParams(1.0, top_n_sigma=0.8)
PROMPT, OTHER = [3, 1, 4], [5, 2, 7, 1, 6, 3, 2]


def deeper_logits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depth 2 and 3 target logits, and the drafter's own logits over its vocabulary."""
    g = torch.Generator().manual_seed(4)
    l1, l2 = torch.randn(V, V, generator=g) * 2, torch.randn(V, V, V, generator=g) * 2
    return l1, l2, torch.randn(len(HOT), generator=g), torch.randn(V, len(HOT), generator=g)


def test_the_full_vocabularys_floor_is_the_one_that_differs():
    full, hot = probs(L0, SIGMA) > 0, probs(L0[HOT], SIGMA) > 0
    assert full.tolist() == [True, True, True, False, True, True]
    assert hot.tolist() == [True, True, False, False, False]


@torch.no_grad()
def test_a_drawn_tree_keeps_top_n_sigma_over_the_targets_whole_vocabulary():
    """Root with three children drawn i.i.d. (with replacement) from the drafter's own top-nσ q
    over its vocabulary, which puts mass where the target keeps none: the first emitted token
    follows the target's top-nσ over all its ids (not over the draft ids alone), and no emitted
    token ever lies outside its position's kept set."""
    l1, l2, ql0, ql1 = deeper_logits()
    q0, q1 = probs(ql0, SIGMA), probs(ql1, SIGMA)
    torch.manual_seed(1)
    b = 100_000
    _, t_first, t_best, n, bonus = seven_node_tree(L0, l1, l2, q0, q1, HOT, b, SIGMA)
    p0, p1 = probs(L0, SIGMA), probs(l1, SIGMA)
    e0 = torch.where(n >= 1, t_first, bonus)
    assert chi_square_p(torch.bincount(e0, minlength=V), p0) > 1e-3
    assert (p0[e0] > 0).all()
    on = n >= 1
    e1 = torch.where(n >= 2, t_best, bonus)[on]
    assert (p1[e0[on], e1] > 0).all()


@torch.no_grad()
def test_a_drawn_chain_keeps_top_n_sigma_over_the_targets_whole_vocabulary():
    """Chain rejection sampling (two drafts drawn from the drafter's top-nσ q) under the same
    target: its first token follows the whole vocabulary's top-nσ, its second the next
    position's, and nothing outside a kept set is emitted."""
    l1, l2, ql0, ql1 = deeper_logits()
    # mostly the drafter's own top-nσ over its vocabulary of the target's logits, so that both
    # drafts are often accepted, and some mass where the target keeps none
    q0 = 0.8 * probs(L0[HOT], SIGMA) + 0.2 * probs(ql0, SIGMA)
    q1 = 0.8 * probs(l1[:, HOT], SIGMA) + 0.2 * probs(ql1, SIGMA)
    torch.manual_seed(2)
    b = 100_000
    d1 = draw(q0.expand(b, -1))
    d2 = draw(q1[HOT[d1]])
    t1, t2 = HOT[d1], HOT[d2]
    logits = torch.stack([L0.expand(b, V), l1[t1], l2[t1, t2]], 1)
    tok = torch.stack([torch.zeros_like(t1), t1, t2], 1)
    qbank = torch.stack([q0.expand(b, -1), q1[t1]], 1)
    n, bonus = verify.chain_sampled(logits, tok, torch.stack([d1, d2], 1), qbank, HOT, SIGMA)
    p0, p1 = probs(L0, SIGMA), probs(l1, SIGMA)
    e0 = torch.where(n >= 1, t1, bonus)
    assert chi_square_p(torch.bincount(e0, minlength=V), p0) > 1e-3
    on = n >= 1  # a second token only past an accepted first draft
    e1 = torch.where(n >= 2, t2, bonus)[on]
    assert (p0[e0] > 0).all() and (p1[e0[on], e1] > 0).all()
    x = int(((p1 > 0).sum(1) * (p0 > 0)).argmax())  # the kept first token keeping most after it
    assert (p1[x] > 0).sum() >= 3
    assert chi_square_p(torch.bincount(e1[e0[on] == x], minlength=V), p1[x]) > 1e-3
    full = n == 2  # both drafts accepted: the bonus from the last position's kept set
    assert full.sum() > 1000 and (probs(l2, SIGMA)[t1[full], t2[full], bonus[full]] > 0).all()


def steered(target, b: int):
    seq = greedy_seq(Runtime(target, 1, 24), [PROMPT], 4).expand(b, -1).contiguous()
    return make_drafter(target, 6, Steered, seed=6, std=0.6).steer(seq, 1.0)


@pytest.mark.parametrize("steps,topk,n", [(2, 1, None), (2, 3, 5)])
@torch.no_grad()
def test_refilled_rows_draw_their_own_top_n_sigma_setting(steps, topk, n, monkeypatch):
    """Greedy drafts matched against the target's draws (the topk rule), chain and tree: every
    row of a running state first holds another prompt at the other row's setting for two
    cycles, then is refilled (`Prefiller.start`) with the prompt, the rows alternating top-nσ and
    top-k at another temperature. Each half's 2048 draws of (x1, x2, x3) match the exact joint
    of its own setting, and the top-nσ half is told apart from the other's."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    settings = (SIGMA, SamplingParams(1.3, top_k=5))
    target, b = small_target(), 512
    dec = SpecDecoder(Runtime(target, b, 32), steered(target, b), steps, topk, n, settings[0])
    st, pre = dec._state(b), spec_refill._prefiller(dec)
    torch.manual_seed(7)
    counts = torch.zeros(2, 8, 8, 8)
    for _ in range(4):
        spec_refill._reset(st, 12, [])
        pre.start(st, list(range(b)), [OTHER] * b, list(settings[::-1]) * (b // 2))
        for _ in range(2):
            dec.cycle(st)
        spec_refill._reset(st, 3, [])
        pre.start(st, list(range(b)), [PROMPT] * b, list(settings) * (b // 2))
        for _ in range(3):
            dec.cycle(st)
        for i, t in enumerate(st.out[:, :3].tolist()):
            counts[i % 2, t[0], t[1], t[2]] += 1
    joints = [exact_joint(target, PROMPT, p, 8) for p in settings]
    assert chi_square_p(counts[0], joints[0]) > 1e-3 and chi_square_p(counts[1], joints[1]) > 1e-3
    assert chi_square_p(counts[0], joints[1]) < 1e-6


@torch.no_grad()
def test_a_drawn_tree_refilled_keeps_the_top_n_sigma_target(monkeypatch):
    """Drafts drawn from the drafter in a tree, 2048 prompts through 512 rows that refill as
    they end (`generate_refill`): the draws of (x1, x2, x3) match top-nσ's exact joint and not
    plain temperature's."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "drawn")
    target, b = small_target(), 512
    drafter = make_drafter(target, 6, seed=6, std=0.6)
    drafter.lm_head.weight.mul_(0.1)
    dec = SpecDecoder(Runtime(target, b, 24), drafter, 2, 3, 5, SIGMA)
    assert dec.drawn
    torch.manual_seed(7)
    res = spec_refill.generate_refill(dec, [PROMPT] * 2048, 3, eos_ids=[], rows=b,
                                      check_every=1)
    counts = torch.zeros(8, 8, 8)
    for t in res.tokens:
        counts[t[0], t[1], t[2]] += 1
    assert counts.sum() == 2048
    assert chi_square_p(counts, exact_joint(target, PROMPT, SIGMA, 8)) > 1e-3
    assert chi_square_p(counts, exact_joint(target, PROMPT, SamplingParams(1.0), 8)) < 1e-6
