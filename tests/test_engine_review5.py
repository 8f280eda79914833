"""Engine review 5: the speculative core's losslessness (greedy and sampled, chain and tree,
rows of other prompt lengths, eos inside an accepted run, max_new mid-cycle), a draft
vocabulary that maps two draft ids to one target token, and drawn trees' rank counts."""

from __future__ import annotations

import pytest
import torch
from test_speculative import PROMPTS, Steered, greedy_seq, make_drafter, tiny_target
from test_speculative_sampling import chi_square_p

from draftsmith.engine import speculative
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams, probs
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.engine.tree import RankCounts
from draftsmith.errors import DraftsmithError


def small():
    return tiny_target(64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=16)


@pytest.mark.parametrize(("drafts", "topk", "n", "params", "refused"), [
    ("topk", 2, 5, SamplingParams(0.8), True),  # sibling drafts of one token
    ("drawn", 1, None, SamplingParams(0.8), True),  # rejection sampling weighs one id's q
    ("drawn", 2, 5, SamplingParams(0.8, top_k=5), True),
    ("topk", 1, None, SamplingParams(0.8), False),  # one draft a depth matched to the draws
    ("topk", 2, 5, SamplingParams(), False),  # greedy emits the target's argmax regardless
    ("drawn", 1, None, SamplingParams(), False),
])
def test_sampling_with_two_draft_ids_of_one_token_is_refused(drafts, topk, n, params, refused,
                                                             monkeypatch):
    """A d2t mapping two draft ids to one target token (the drafter's loader takes it) made
    sibling drafts of one token: a sampled tree's accept walked the deeper copy, rejection
    sampling weighed one copy's q, neither the target's distribution any more. Sampled
    decoders that read them now refuse such a drafter; greedy ones still decode it exactly."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    target = small()
    drafter = make_drafter(target, 32)
    hot = torch.arange(32) + drafter.d2t
    with torch.no_grad():
        drafter.d2t[20] = int(hot[7]) - 20
    if refused:
        with pytest.raises(DraftsmithError, match=rf"draft ids 7 and 20 to one target id "
                                                  rf"{int(hot[7])}: sampled speculative"):
            SpecDecoder(target, drafter, 3, topk, n, params, max_seq=64)
        return
    dec = SpecDecoder(target, drafter, 3, topk, n, params, max_batch=2, max_seq=64)
    res = dec.generate([[3, 4], [5]], 8, eos_ids=[])
    if params.greedy:
        assert res.tokens == generate(target, [[3, 4], [5]], 8)


def test_a_shuffled_one_to_one_draft_vocabulary_still_decodes_greedy():
    """A d2t whose target ids are distinct but out of order is no duplicate."""
    target = small()
    drafter = make_drafter(target, 32)
    hot = torch.arange(32) + drafter.d2t
    with torch.no_grad():
        drafter.d2t.copy_(hot.flip(0) - torch.arange(32))
    dec = SpecDecoder(target, drafter, 3, 2, 5, max_seq=64)
    assert dec.generate([[3, 4]], 6, eos_ids=[]).tokens == generate(target, [[3, 4]], 6)


@pytest.fixture(scope="module")
def oracle_setup():
    target = tiny_target()
    rt = Runtime(target, 4, 128)
    return target, rt, greedy_seq(rt, PROMPTS, 40)


@pytest.mark.parametrize(("steps", "topk", "n"), [(5, 1, None), (4, 4, 10), (2, 3, 4)])
def test_rows_ending_inside_an_accepted_run_emit_and_grow_nothing_past_it(oracle_setup, steps,
                                                                          topk, n):
    """Rows of four prompt lengths, an oracle drafter (long accepted runs), eos ids met mid-run
    in two rows and max_new 9 cutting the others mid-cycle: each row's tokens are plain
    greedy's; a finished row's length, count, output and the statistics stay as they were
    through further cycles."""
    target, rt, seq = oracle_setup
    plain = generate(rt, PROMPTS, 30, eos_ids=[])
    eos = [plain[1][3], plain[2][5]]
    want = generate(rt, PROMPTS, 9, eos_ids=eos)
    assert [len(t) for t in want] == [9, 3, 5, 9]
    dec = SpecDecoder(rt, make_drafter(target, 96, Steered).steer(seq, 1.0), steps, topk, n)
    res = dec.generate(PROMPTS, 9, eos_ids=eos)
    assert res.tokens == want
    assert res.measured_accept_length > 2
    st = dec.states[4]
    assert st.done.all() and (st.count >= torch.tensor([9, 4, 6, 9])).all()
    def state():  # the output's last slot takes inactive rows' writes: no token's slot
        return st.L, st.count, st.out[:, :-1], st.hist, st.reached, st.accepted

    kept = [t.clone() for t in state()]
    for _ in range(3):
        dec.cycle(st)
    assert all(torch.equal(a, b) for a, b in zip(kept, state(), strict=True))


V, NEW = 6, 5


def exact_joint(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(x1..x5 | prompt) [V]*5, every x1..x4 enumerated."""
    seqs = torch.cartesian_prod(*[torch.arange(V)] * (NEW - 1))
    full = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        lg = model(full, torch.arange(full.shape[1]).expand(len(seqs), -1)).logits
    pr = probs(lg[:, len(prompt) - 1:], params)
    joint = torch.ones(len(seqs))
    for i in range(NEW - 1):
        joint = joint * pr[torch.arange(len(seqs)), i, seqs[:, i]]
    return (joint[:, None] * pr[:, -1]).view(*[V] * NEW)


@pytest.mark.parametrize(("drafts", "steps", "topk", "n", "params"), [
    ("drawn", 2, 1, None, SamplingParams(1.0)),
    ("drawn", 2, 3, 5, SamplingParams(0.8, top_k=4, top_p=0.9)),
    ("drawn", 3, 2, 6, SamplingParams(1.0, top_p=0.85)),
    ("topk", 2, 3, 5, SamplingParams(0.8, top_k=4, top_p=0.9)),
    ("topk", 3, 1, None, SamplingParams(1.2, top_p=0.8)),
])
def test_sampled_speculation_keeps_the_target_over_several_cycles(drafts, steps, topk, n, params,
                                                                  monkeypatch):
    """Two prompts of other lengths in one batch, five tokens a row (two or more cycles): each
    prompt's 4096 answers match the target's exact joint over x1..x5, and its (x3, x4) and
    (x4, x5) marginals, which later cycles draw (after accepts and rejections moved the caches);
    the other temperature's joint is told apart."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    target = tiny_target(V, seed=5, hidden_size=16, intermediate_size=32, num_layers=3,
                         num_heads=2, num_kv_heads=1, head_dim=8)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    prompts, b = [[3, 1, 4], [2, 5, 0, 1, 3, 2, 4]], 1024
    rows = [prompts[i % 2] for i in range(b)]
    if drafts == "drawn":
        drafter = make_drafter(target, 5, seed=6, std=0.6)
        with torch.no_grad():
            drafter.lm_head.weight.mul_(0.1)
    else:
        seq = greedy_seq(Runtime(target, b, 32), rows, NEW + 4)
        drafter = make_drafter(target, 5, Steered, seed=6, std=0.6).steer(seq, 1.0)
    dec = SpecDecoder(Runtime(target, b, 40), drafter, steps, topk, n, params)
    assert dec.drawn == (drafts == "drawn")
    torch.manual_seed(11)
    counts = torch.zeros(2, *[V] * NEW)
    for _ in range(8):
        res = dec.generate(rows, NEW, eos_ids=[])
        for i, t in enumerate(res.tokens):
            counts[(i % 2, *t)] += 1
    assert res.mean_accept_length > 1.5
    other = SamplingParams(params.temperature * 1.6, top_k=params.top_k, top_p=params.top_p)
    for r, prompt in enumerate(prompts):
        joint, c = exact_joint(target, prompt, params), counts[r]
        assert chi_square_p(c, joint) > 1e-3
        assert chi_square_p(c.sum((0, 1, 4)), joint.sum((0, 1, 4))) > 1e-3
        assert chi_square_p(c.sum((0, 1, 2)), joint.sum((0, 1, 2))) > 1e-3
        far = exact_joint(target, prompt, other).sum((2, 3, 4))
        assert chi_square_p(c.sum((2, 3, 4)), far) < 1e-6


def test_drawn_trees_rank_counts_name_the_accepted_sibling_not_its_token(monkeypatch):
    """Drafts drawn from the drafter: a node's children are draws with replacement, so two
    siblings may hold one token. Rank counts found the accepted path by its tokens and counted
    each such sibling as accepted (more accepted than reached); they now follow the accepted
    nodes, so they sum to bench's per-position counts as greedy trees' do."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "drawn")
    target = tiny_target(V, seed=5, hidden_size=16, intermediate_size=32, num_layers=3,
                         num_heads=2, num_kv_heads=1, head_dim=8)
    drafter = make_drafter(target, 5, seed=6, std=0.6)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(0.1)
    setting = (3, 3, 8)
    dec = SpecDecoder(Runtime(target, 4, 64), drafter, *setting, SamplingParams(1.0))
    dec.rank_counts = counts = RankCounts(*setting[:2], dec.device)
    torch.manual_seed(0)
    res = dec.generate([[3, 1, 4], [2, 5], [1], [4, 4, 4]], 30, eos_ids=[])
    reached, accepted = counts.counts()
    assert res.accepted[0] > 10 and res.reached[1] > 10
    assert res.reached == [row[0] for row in reached]
    assert res.accepted == [sum(row) for row in accepted]
    assert all(a <= r for ra, ac in zip(reached, accepted, strict=True)
               for a, r in zip(ac, ra, strict=True))
