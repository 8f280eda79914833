"""Speculative engine review 2, at the edges, each against plain greedy decoding of the same
target: max_new below one cycle, several eos ids (one met at the prefill, one past the
vocabulary, one the drafter cannot draft), a batch of a one-token and a long prompt at the
decoder's exact capacity, trees at their size limits, settings that sample as greedy, and
one-depth trees' sampling against the target's exact distribution."""

from __future__ import annotations

import pytest
import torch
from test_speculative import Steered, greedy_seq, make_drafter, tiny_target
from test_speculative_sampling import chi_square_p

from draftsmith.engine import speculative
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams, probs
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError

LONG = [(7 * i + 3) % 64 for i in range(40)]
PROMPTS = [[3], LONG, [5, 6, 7]]


@pytest.fixture(scope="module")
def small():
    target = tiny_target(64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16)
    rt = Runtime(target, 3, 96)
    return target, rt, greedy_seq(rt, PROMPTS, 40)


def oracle(target, seq: torch.Tensor, dvocab: int = 64, used: torch.Tensor | None = None):
    """A drafter steered to the target's greedy continuation at every position it can draft;
    used: its draft vocabulary's target ids (default: make_drafter's)."""
    drafter = make_drafter(target, dvocab, Steered)
    if used is not None:
        t2d = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
        t2d[used] = True
        with torch.no_grad():
            drafter.set_vocab(used - torch.arange(len(used)), t2d)
    return drafter.steer(seq, 1.0)


@pytest.mark.parametrize(("steps", "topk", "n"), [(5, 1, None), (4, 3, 10), (1, 3, 2)])
def test_max_new_below_one_cycle_stops_exactly(small, steps, topk, n):
    """An oracle drafter accepts whole cycles, so max_new 1 to steps + 1 lands inside the first
    cycle's run: each row gets exactly max_new tokens, plain greedy's, from the prefill alone
    (max_new 1) or one cycle."""
    target, rt, seq = small
    dec = SpecDecoder(rt, oracle(target, seq), steps, topk, n)
    for new in sorted({1, 2, 3, steps, steps + 1}):
        res = dec.generate(PROMPTS, new, eos_ids=[])
        assert res.tokens == generate(rt, PROMPTS, new, eos_ids=[]), new
        assert [len(t) for t in res.tokens] == [new] * 3
        assert res.cycles == (new > 1)


def test_several_eos_ids_end_each_row_at_the_first_one_it_emits(small):
    """eos ids in any order, one past the vocabulary, one met as a row's first (prefill) token
    and one inside another row's accepted run: each row stops at the first eos it emits, in
    output order, and the third row runs on to max_new."""
    target, rt, seq = small
    plain = generate(rt, PROMPTS, 12, eos_ids=[])
    first = plain[1][0]
    cut = next(i for i in range(2, 12) if plain[0][i] not in plain[0][:i] + [first])
    later = next((t for t in plain[0][cut + 1:] if t not in plain[0][:cut + 1] + [first]), 63)
    eos = [later, 10**12, plain[0][cut], first]
    want = generate(rt, PROMPTS, 12, eos_ids=eos)
    assert want[1] == [] and len(want[0]) <= cut
    for steps, topk, n in [(5, 1, None), (4, 3, 10)]:
        res = SpecDecoder(rt, oracle(target, seq), steps, topk, n).generate(PROMPTS, 12,
                                                                              eos_ids=eos)
        assert res.tokens == want
        assert res.measured_accept_length > 2  # eos met inside long accepted runs


@pytest.mark.parametrize(("steps", "topk", "n"), [(3, 1, None), (3, 3, 8)])
def test_an_eos_the_drafter_cannot_draft_still_ends_the_row(small, steps, topk, n):
    """The target's eos outside the draft vocabulary: no draft can hold it, so it comes as a
    cycle's bonus token, and the row ends there as plain greedy's does."""
    target, rt, seq = small
    plain = generate(rt, PROMPTS, 20, eos_ids=[])
    eos = next(t for t in plain[1][3:] if t not in plain[1][:3])
    used = torch.tensor([i for i in range(64) if i != eos][:48])
    drafter = oracle(target, seq, 48, used)
    hot = torch.arange(48) + drafter.d2t
    assert eos not in hot.tolist()
    want = generate(rt, PROMPTS, 20, eos_ids=[eos])
    assert len(want[1]) < 20
    res = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS, 20, eos_ids=[eos])
    assert res.tokens == want and res.measured_accept_length > 1.5


@pytest.mark.parametrize(("steps", "topk", "n"), [(3, 1, None), (3, 3, 8), (2, 4, 12)])
def test_a_one_token_and_a_long_prompt_at_the_exact_capacity(small, steps, topk, n):
    """One batch of a one-token prompt and a long one whose prompt + max_new is the decoder's
    whole capacity decodes as plain greedy (random and oracle drafters); one token more is
    refused naming the max_seq that would hold it, which then decodes it."""
    target, rt, seq = small
    for drafter in (make_drafter(target, 40), oracle(target, seq)):
        dec = SpecDecoder(target, drafter, steps, topk, n, max_batch=2, max_seq=64)
        new = dec.capacity() - len(LONG)
        prompts = [[3], LONG]
        res = dec.generate(prompts, new, eos_ids=[])
        assert res.tokens == generate(rt, prompts, new, eos_ids=[])
    room = len(LONG) + new + 1 + 64 - dec.capacity()  # the drafting margin past the answer
    with pytest.raises(DraftsmithError, match=f"capacity {dec.capacity()} .*shorten the prompt "
                       f"or max_new_tokens, or decode with a max_seq of at least {room}$"):
        dec.generate(prompts, new + 1, eos_ids=[])
    bigger = SpecDecoder(target, drafter, steps, topk, n, max_batch=2, max_seq=room)
    assert bigger.generate(prompts, new + 1, eos_ids=[]).tokens == generate(rt, prompts, new + 1,
                                                                           eos_ids=[])


@pytest.mark.parametrize(("steps", "topk", "n"), [(1, 2, 2), (1, 4, 5), (1, 4, 3), (3, 4, 2),
                                                  (2, 4, 3), (2, 3, 13)])
def test_trees_at_their_size_limits_decode_as_greedy(small, steps, topk, n):
    """One depth of top-k > 1, fewer tokens than top-k, two tokens, and every candidate of the
    tree (1 + k + (S-1)k^2): plain greedy's tokens from random and oracle drafters."""
    target, rt, seq = small
    want = generate(rt, PROMPTS, 16, eos_ids=[])
    for drafter in (make_drafter(target, 40), oracle(target, seq)):
        res = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS, 16, eos_ids=[])
        assert res.tokens == want


def test_tree_sizes_past_their_limits_are_refused_at_construction(small):
    """A tree of one token, more tokens than candidates, or a top-k past the draft vocabulary
    is one DraftsmithError naming what fits; a top-k of the whole draft vocabulary decodes."""
    target, rt, seq = small
    drafter = make_drafter(target, 40)
    for n in (1, 14):
        with pytest.raises(DraftsmithError, match=rf"num_draft_tokens {n} must lie in \[2, 13\]"):
            SpecDecoder(rt, drafter, 2, 3, n)
    tiny = make_drafter(target, 3)
    with pytest.raises(DraftsmithError, match="topk 4 exceeds the drafter's draft vocabulary of 3"):
        SpecDecoder(rt, tiny, 2, 4, 5)
    res = SpecDecoder(rt, tiny, 2, 3, 13).generate(PROMPTS, 10, eos_ids=[])
    assert res.tokens == generate(rt, PROMPTS, 10, eos_ids=[])


@pytest.mark.parametrize(("steps", "topk", "n"), [(3, 1, None), (3, 3, 8)])
def test_settings_that_sample_as_greedy_decode_as_greedy(small, steps, topk, n):
    """Temperature 0 with top-k / top-p given is greedy (same tokens, same accepts), and a
    sampled decoder at a top_p that keeps only the best token emits greedy's tokens."""
    target, rt, seq = small
    drafter = make_drafter(target, 64, Steered).steer(seq, 0.6)
    greedy = SpecDecoder(rt, drafter, steps, topk, n).generate(PROMPTS, 16, eos_ids=[])
    assert greedy.tokens == generate(rt, PROMPTS, 16, eos_ids=[])
    zero = SpecDecoder(rt, drafter, steps, topk, n, SamplingParams(0.0, top_p=0.3, top_k=4))
    res = zero.generate(PROMPTS, 16, eos_ids=[])
    assert res.tokens == greedy.tokens and res.accept_hist == greedy.accept_hist
    narrow = SpecDecoder(rt, drafter, steps, topk, n, SamplingParams(0.8, top_p=1e-9))
    torch.manual_seed(0)
    assert narrow.generate(PROMPTS, 16, eos_ids=[]).tokens == greedy.tokens


def test_a_request_past_both_the_capacity_and_the_window_names_the_window():
    """Past a sliding window no longer max_seq helps: the window is named, not a max_seq that
    would then be refused for the window."""
    target = tiny_target(64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, sliding_window=20)
    dec = SpecDecoder(target, make_drafter(target, 40), 3, max_seq=24)
    assert dec.capacity() == 16
    with pytest.raises(DraftsmithError, match=r"sliding window of 20 tokens.* = 25 > 20\)$"):
        dec.generate([[1] * 5], 20, eos_ids=[])
    with pytest.raises(DraftsmithError, match="capacity 16 .*max_seq of at least 26$"):
        dec.generate([[1] * 3], 15, eos_ids=[])


def exact_joint(model, prompt: list[int], params: SamplingParams, vocab: int) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) [vocab]*3, every x1, x2 enumerated."""
    seqs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    full = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        pr = probs(model(full, torch.arange(full.shape[1]).expand(len(seqs), -1)).logits[
            :, len(prompt) - 1:], params)
    rows = torch.arange(len(seqs))
    joint = pr[rows, 0, seqs[:, 0]] * pr[rows, 1, seqs[:, 1]]
    return (joint[:, None] * pr[:, 2]).view(vocab, vocab, vocab)


@pytest.mark.parametrize(("drafts", "topk", "n", "params"), [
    ("drawn", 2, 3, SamplingParams(0.8, top_k=4)), ("drawn", 3, 2, SamplingParams(1.0)),
    ("topk", 4, 3, SamplingParams(1.0, top_p=0.9))])
def test_one_depth_trees_sample_the_target_for_short_and_long_prompts(drafts, topk, n, params,
                                                                      monkeypatch):
    """Trees of one depth (fewer tokens than top-k, or all of them), drafts drawn or greedy's:
    a one-token prompt and a twelve-token one in one batch each keep the target's exact joint
    over three tokens (4096 answers each)."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    vocab, b = 6, 1024
    target = tiny_target(vocab, seed=5, hidden_size=16, intermediate_size=32, num_layers=3,
                         num_heads=2, num_kv_heads=1, head_dim=8)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.0)
    prompts = [[3], [2, 5, 0, 1, 3, 2, 4, 1, 1, 0, 5, 2]]
    rows = [prompts[i % 2] for i in range(b)]
    if drafts == "drawn":
        drafter = make_drafter(target, 5, seed=6, std=0.6)
        with torch.no_grad():
            drafter.lm_head.weight.mul_(0.1)  # a q near p: accepted often
    else:
        seq = greedy_seq(Runtime(target, b, 32), rows, 7)
        drafter = make_drafter(target, 5, Steered, seed=6, std=0.6).steer(seq, 1.0)
    dec = SpecDecoder(Runtime(target, b, 40), drafter, 1, topk, n, params)
    torch.manual_seed(11)
    counts = torch.zeros(2, vocab, vocab, vocab)
    for _ in range(4):
        res = dec.generate(rows, 3, eos_ids=[])
        for i, t in enumerate(res.tokens):
            counts[(i % 2, *t)] += 1
    assert res.mean_accept_length > 1.3
    for r, prompt in enumerate(prompts):
        assert chi_square_p(counts[r], exact_joint(target, prompt, params, vocab)) > 1e-3
