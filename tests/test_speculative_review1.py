"""Review checks of the sampled accept rules (`verify.chain_sampled`, `verify.tree_sampled`):
the first three emitted tokens, completed by exact draws from the target where a cycle emits
fewer, follow the target's exact joint under temperature, top-k and top-p, with drafts the target
filters out, drafter distributions with zeros where the target has mass, sibling drafts of one
token, a drafter equal to the target (an all-zero residual) and the bonus after a whole path."""

from __future__ import annotations

import pytest
import torch
from test_speculative_sampling import HOT, VD, V, seven_node_tree
from test_speculative_sampling import chi_square_p as sampling_chi_square_p

from draftsmith.engine import verify
from draftsmith.engine.sampling import SamplingParams, draw

# 24 cases of 0.5-1.3 s, 120,000 draws each: CI's slow run (the rules are exact on every path
# the default suite's chi-square tests take)
pytestmark = pytest.mark.slow

B = 120_000  # V, VD, HOT: test_speculative_sampling's (target id 3 has no draft id)


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Plain sampling's distribution written out by hand: temperature, top-k (ties kept), then
    the smallest top set whose mass reaches top_p (the top token always kept)."""
    x = logits.double() / p.temperature
    if p.top_k:
        kth = x.sort(-1, descending=True).values[..., p.top_k - 1 : p.top_k]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sx, idx = x.sort(-1, descending=True)
        sp = sx.softmax(-1)
        drop = sp.cumsum(-1) - sp >= p.top_p
        drop[..., 0] = False
        x = x.scatter(-1, idx, sx.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """test_speculative_sampling's p-value, a count in a cell of probability 0 failing outright."""
    zero = expected.flatten() == 0
    assert not (counts.flatten()[zero] > 0).any(), "a token of probability 0 was emitted"
    return sampling_chi_square_p(counts, expected)


def tables(params: SamplingParams, drafter: str, seed: int):
    """Target logits by context (L0 [V], L1 [V, V], L2 [V, V, V]) and the drafter's q by
    context (q0 [VD], q1 [V, VD]). drafter: "wide" (every draft id, with zeros where the target
    has mass), "dupes" (most mass on one id: siblings repeat), "equal" (the target's own
    filtered distribution, so residuals are all zero)."""
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(*(V,) * d, V, generator=g) * 1.5 for d in range(3)]
    if drafter == "equal":  # no mass at id 3, which the drafter cannot draft
        for lg in logits:
            lg[..., 3] = float("-inf")
        p0, p1 = (verify.probs(lg, params) for lg in logits[:2])
        return logits, p0[HOT], p1[:, HOT]
    q = torch.rand(1 + V, VD, generator=g) ** 2
    if drafter == "dupes":
        q[:, 1] += 8.0
    else:
        q[:, 0] = 0.0  # the target's id 0 never drafted
        q[2::2, 2] = 0.0
    q = q / q.sum(-1, keepdim=True)
    return logits, q[0], q[1:]


def completed(e0: torch.Tensor, e1: torch.Tensor, n: torch.Tensor, bonus: torch.Tensor,
              p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2) a row: what the cycle emitted, the rest drawn from the exact target."""
    x0 = torch.where(n >= 1, e0, bonus)
    x1 = torch.where(n >= 2, e1, torch.where(n == 1, bonus, draw(p1[x0].float())))
    x2 = torch.where(n >= 2, bonus, draw(p2[x0, x1].float()))
    return x0 * V * V + x1 * V + x2


PARAMS = [SamplingParams(1.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.7),
          SamplingParams(0.9, top_k=4, top_p=0.8)]


@pytest.mark.parametrize("drafter", ["wide", "dupes", "equal"])
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_chain_accept_keeps_the_targets_joint(params, drafter):
    (l0, l1, l2), q0, q1 = tables(params, drafter, 1)
    torch.manual_seed(2)
    d1 = draw(q0.expand(B, VD))
    t1 = HOT[d1]
    d2 = draw(q1[t1])
    t2 = HOT[d2]
    logits = torch.stack([l0.expand(B, V), l1[t1], l2[t1, t2]], 1)
    tok = torch.stack([torch.zeros_like(t1), t1, t2], 1)
    n, bonus = verify.chain_sampled(logits, tok, torch.stack([d1, d2], 1),
                                    torch.stack([q0.expand(B, VD), q1[t1]], 1), HOT, params)
    p0, p1, p2 = (reference(x, params) for x in (l0, l1, l2))
    x = completed(t1, t2, n, bonus, p1, p2)
    assert (n == 2).float().mean() > 0.01  # the bonus after a whole chain is tested too
    joint = p0[:, None, None] * p1[:, :, None] * p2
    assert chi_square_p(torch.bincount(x, minlength=V**3), joint) > 1e-3


@pytest.mark.parametrize("drafter", ["wide", "dupes", "equal"])
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_tree_accept_keeps_the_targets_joint(params, drafter):
    """Root with three children drawn i.i.d. from q0 (with replacement: they repeat), the first
    with two children, the second with one, drawn from q1 of their parent's token."""
    (l0, l1, l2), q0, q1 = tables(params, drafter, 3)
    torch.manual_seed(4)
    kids, t_first, t_best, n, bonus = seven_node_tree(l0, l1, l2, q0, q1, HOT, B, params)
    p0, p1, p2 = (reference(x, params) for x in (l0, l1, l2))
    x = completed(t_first, t_best, n, bonus, p1, p2)
    assert (n == 2).float().mean() > 0.01
    if drafter == "dupes":
        assert (kids[:, 0] == kids[:, 1]).float().mean() > 0.3
    joint = p0[:, None, None] * p1[:, :, None] * p2
    assert chi_square_p(torch.bincount(x, minlength=V**3), joint) > 1e-3
