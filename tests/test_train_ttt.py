"""Training-time test: what each unrolled step sees, its targets and masks, acceptance stats."""

from __future__ import annotations

import pytest
import torch
from test_drafter import random_drafter, tiny_cfg

from draftsmith.models.llama import KVCache
from draftsmith.train.objective import (
    Targets,
    accept_length,
    chain_counts,
    make_targets,
    step_loss,
    summarize,
)
from draftsmith.train.ttt import unroll

STEPS = 4


def run_ttt(d, tokens, aux, doc=None, positions=None):
    t = tokens.shape[-1]
    doc = torch.zeros(1, t, dtype=torch.long) if doc is None else doc
    positions = torch.arange(t)[None] if positions is None else positions
    with torch.no_grad():
        return torch.stack(list(unroll(d, tokens, d.fuse(aux), positions, doc, STEPS)))[:, 0]


def test_ttt_equals_chain_drafting_with_a_kv_cache():
    d = random_drafter(tiny_cfg())
    torch.manual_seed(2)
    t = 10
    x, aux = torch.randint(0, 50, (1, t)), torch.randn(1, t, 3, 24)
    ttt = run_ttt(d, x, aux)
    with torch.no_grad():
        fused = d.fuse(aux)
        for start in range(t - 1):
            caches = [KVCache(torch.zeros(1, 2, 32, 8), torch.zeros(1, 2, 32, 8))]
            pos = torch.arange(start + 1)[None]
            logits, h = d(x[:, 1 : start + 2], fused[:, : start + 1], pos, caches)
            assert torch.allclose(logits[0, -1], ttt[0, start], atol=1e-5)
            h = h[:, -1:]
            for j in range(1, STEPS):
                if start + j + 1 >= t:
                    break
                tok = x[:, start + j + 1 : start + j + 2]
                logits, h = d(tok, h, torch.tensor([[start + j]]), caches)
                assert torch.allclose(logits[0, 0], ttt[j, start], atol=1e-5), (start, j)


def changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs().amax(-1) > 1e-6  # [steps, T]


def test_each_step_sees_exactly_its_positions():
    d = random_drafter(tiny_cfg())
    torch.manual_seed(3)
    t = 12
    x, aux = torch.randint(0, 50, (1, t)), torch.randn(1, t, 3, 24)
    base = run_ttt(d, x, aux)
    j = torch.arange(STEPS)[:, None]
    idx = torch.arange(t)[None]
    for m in (3, 7, 11):
        x2 = x.clone()
        x2[0, m] = (x2[0, m] + 1) % 50
        # step j at index t reads x_{s+1} for s <= t (step-0 keys) and x_{t+1..t+j+1} (its chain)
        assert torch.equal(changed(run_ttt(d, x2, aux), base), idx >= m - 1 - j), m
        aux2 = aux.clone()
        aux2[0, m] += 1.0
        assert torch.equal(changed(run_ttt(d, x, aux2), base), (idx >= m).expand(STEPS, t)), m


def test_packed_documents_do_not_see_each_other():
    d = random_drafter(tiny_cfg())
    torch.manual_seed(4)
    a, b = 6, 7
    x, aux = torch.randint(0, 50, (1, a + b)), torch.randn(1, a + b, 3, 24)
    doc = torch.tensor([[0] * a + [1] * b])
    pos = torch.cat([torch.arange(a), torch.arange(b)])[None]
    packed = run_ttt(d, x, aux, doc, pos)
    alone_b = run_ttt(d, x[:, a:], aux[:, a:])
    alone_a = run_ttt(d, x[:, :a], aux[:, :a])
    assert torch.allclose(packed[:, a:], alone_b, atol=1e-5)
    for j in range(STEPS):  # doc A's chains that stay inside doc A
        n = a - j - 1
        assert torch.allclose(packed[j, :n], alone_a[j, :n], atol=1e-5)


def test_targets_are_the_renormalised_target_distribution_with_masks():
    torch.manual_seed(5)
    v, t, dv = 30, 9, 12
    head, hidden = torch.randn(v, 16), torch.randn(1, t, 16)
    full = hidden[0] @ head.T
    used = torch.sort(torch.randperm(v)[:dv]).values
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1]])
    tg = make_targets(hidden, head, used, loss_mask, doc)
    arg = full.argmax(-1)
    want = torch.tensor([int((used == a).nonzero()[0]) if a in used else -1 for a in arg])
    assert torch.equal(tg.label[0], want)
    # u counts when token u+1 is an assistant token of u's own document
    assert tg.ok[0].tolist() == [False, True, True, True, False, True, True, True, False]
    counted = tg.ok[0] & (want >= 0)
    assert 0 < counted.sum() < t
    want_prob = torch.where(counted[:, None], torch.softmax(full[:, used], -1), 0.0)
    assert torch.allclose(tg.prob[0], want_prob, atol=1e-6)  # zero where u does not count

    logits = torch.randn(1, t, dv, requires_grad=True)
    loss, correct, valid = step_loss(logits, tg, 1)
    s = 2
    ok = tg.ok[0, s:] & (doc[0, : t - s] == doc[0, s:])  # the chain starts in u's document
    counted = ok & (tg.label[0, s:] >= 0)
    lp = torch.log_softmax(logits[0, : t - s], -1)
    manual = -(tg.prob[0, s:] * lp).sum(-1)[counted].mean()
    assert torch.allclose(loss, manual)
    assert torch.equal(valid[0], torch.cat([ok, torch.zeros(s, dtype=torch.bool)]))
    hit = (logits[0, : t - s].argmax(-1) == tg.label[0, s:]) & ok
    assert torch.equal(correct[0, : t - s], hit)
    loss.backward()  # masked positions get no gradient, even with garbage targets there
    assert torch.all(logits.grad[0, t - s :] == 0)


def test_non_finite_targets_at_masked_positions_do_not_poison_the_loss():
    """A NaN hidden state where nothing counts (here: a position whose next token is not the
    assistant's) reaches neither the loss nor the gradient of any step."""
    torch.manual_seed(4)
    v, t, dv = 20, 6, 8
    head, hidden = torch.randn(v, 16), torch.randn(1, t, 16)
    hidden[0, 0] = float("nan")
    used = torch.arange(dv) * 2
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)  # u = 0 does not count
    tg = make_targets(hidden, head, used, loss_mask, torch.zeros(1, t, dtype=torch.long))
    assert torch.isfinite(tg.prob).all() and tg.prob[0, 0].eq(0).all()
    for j in range(3):
        logits = torch.randn(1, t, dv, requires_grad=True)
        loss, _, _ = step_loss(logits, tg, j)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()


def test_compiled_loss_equals_eager_loss_and_gradients():
    """--compile-loss (inductor's CPU backend here) gives the eager loss, statistics and
    gradients at every TTT step."""
    from draftsmith.train.objective import compiled_step_loss

    torch.manual_seed(8)
    b, t, dv, v = 2, 12, 16, 40
    head, hidden = torch.randn(v, 8), torch.randn(b, t, 8)
    used = torch.sort(torch.randperm(v)[:dv]).values
    loss_mask = torch.rand(b, t) < 0.7
    doc = torch.tensor([[0] * 7 + [1] * 5, [0] * 12])
    tg = make_targets(hidden, head, used, loss_mask, doc)
    fn = compiled_step_loss()
    for j in range(3):
        base = torch.randn(b, t, dv)
        eager_in, comp_in = base.clone().requires_grad_(), base.clone().requires_grad_()
        want, got = step_loss(eager_in, tg, j), fn(comp_in, tg, j)
        assert torch.allclose(got[0], want[0], atol=1e-5)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        want[0].backward()
        got[0].backward()
        assert torch.allclose(comp_in.grad, eager_in.grad, atol=1e-6)
    # a corrupt logit row where nothing counts (step 0 at i is scored at u = i + 1): the loss
    # must still show it
    i = int((~(tg.ok[1, 1:] & (tg.label[1, 1:] >= 0))).nonzero()[0])
    bad = torch.randn(b, t, dv)
    bad[1, i] = float("nan")
    assert step_loss(bad, tg, 0)[0].isnan() and fn(bad, tg, 0)[0].isnan()


def test_a_batch_narrower_than_the_step_scores_nothing_there():
    """Rows as wide as their longest can be shorter than j + 1: no position is scored at that
    step (no wrap-around slice), and the statistics keep the batch's width."""
    t, dv = 3, 6
    tg = Targets(torch.full((1, t, dv), 1 / dv), torch.zeros(1, t, dtype=torch.long),
                 torch.ones(1, t, dtype=torch.bool))
    logits = torch.randn(1, t, dv, requires_grad=True)
    for j in (2, 4):
        loss, correct, valid = step_loss(logits, tg, j)
        assert loss.item() == 0 and correct.shape == valid.shape == (1, t)
        assert not valid.any()


def test_accept_length_uses_conditional_acceptance():
    torch.manual_seed(6)
    s, n = 3, 4000
    correct = torch.rand(s, 1, n) < torch.tensor([0.8, 0.6, 0.5])[:, None, None]
    correct[1] |= correct[0] & (torch.rand(1, n) < 0.5)  # correlated: later steps follow earlier
    valid = torch.ones(s, 1, n, dtype=torch.bool)
    got = summarize(chain_counts(correct, valid))
    lead = correct[:, 0].int().cummin(0).values.sum(0)  # drafts accepted per chain
    assert got["accept_length"] == pytest.approx(1 + lead.float().mean().item())
    cond1 = (correct[0] & correct[1]).sum() / correct[0].sum()
    assert got["cond_acc"][1] == pytest.approx(cond1.item())
    product = 1 + sum(torch.tensor(got["acc"][: k + 1]).prod().item() for k in range(s))
    assert abs(got["accept_length"] - product) > 0.05  # the naive estimate is visibly off
    # a chain cut by the end of its sequence does not count at the cut step
    c = torch.tensor([[[1, 1]], [[1, 0]]]).bool()
    v = torch.tensor([[[1, 1]], [[1, 0]]]).bool()
    assert summarize(chain_counts(c, v))["cond_acc"] == [1.0, 1.0]
    assert accept_length([1.0, 1.0]) == 3.0 and accept_length([0.5, 0.5]) == 1.75


def test_a_chain_counts_only_inside_the_document_it_starts_in():
    """Packed documents A|B whose answers start early: step j at index t is scored only where
    t and its target t + j + 1 share a document; a chain from A's end reading B's tokens is in
    neither the loss, its gradient, nor the statistics."""
    torch.manual_seed(8)
    v, dv, a, b = 20, 20, 6, 6
    t = a + b
    head, hidden = torch.randn(v, 16), torch.randn(1, t, 16)
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    doc = torch.tensor([[0] * a + [1] * b])
    tg = make_targets(hidden, head, torch.arange(dv), loss_mask, doc)
    for j in range(4):
        s = j + 1
        logits = torch.randn(1, t, dv, requires_grad=True)
        loss, _, valid = step_loss(logits, tg, j)
        starts = torch.arange(t - s)
        across = doc[0, starts] != doc[0, starts + s]
        assert across.any() and not valid[0, : t - s][across].any()
        assert valid[0, : t - s][~across].equal(tg.ok[0, s:][~across])
        loss.backward()
        assert torch.all(logits.grad[0, : t - s][across] == 0)
