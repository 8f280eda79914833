"""Engine review 10: "lossless" on CPU. Greedy speculative output equals plain greedy token for
token in every drafting mode, batch size and edge (eos or max_new inside an accepted run, a
prompt at the decoder's capacity, refilled rows, draft vocabularies that miss target tokens);
sampled speculative decoding draws the target's own distribution (a wrong accept rule fails the
same check); rows of one batch keep their own settings."""

from __future__ import annotations

import pytest
import torch
from test_speculative import Steered, greedy_seq, make_drafter, tiny_target
from test_speculative_sampling import chi_square_p, exact_joint, small_target

from draftsmith.engine import speculative
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.spec_refill import generate_refill
from draftsmith.engine.speculative import SpecDecoder

# prompts of very different lengths: 1 token to 41
LONG = [1] + [(7 * i + 3) % 120 + 2 for i in range(40)]
MIXED = [[5], LONG, [1, 60, 61], LONG[:17], [9, 2]]
NEW = 24
# chain 1, 2 and 4 deep; trees 1 deep, verifying fewer tokens than their candidates, topk 2-4
MODES = [(1, 1, None), (2, 1, None), (4, 1, None), (1, 2, 2), (1, 4, 3), (3, 3, 4),
         (2, 2, 6), (4, 4, 9)]


@pytest.fixture(scope="module")
def base():
    target = tiny_target()
    rt = Runtime(target, 5, 128)
    ref = generate(rt, MIXED, NEW, eos_ids=[])
    seq = greedy_seq(rt, MIXED, NEW + 8)
    return target, rt, ref, seq


@pytest.mark.parametrize("steps,topk,n", MODES)
@torch.no_grad()
def test_every_mode_and_batch_size_decodes_as_plain_greedy(base, steps, topk, n):
    """Batches of 1..5 rows of very different prompt lengths: each row's tokens are its plain
    greedy answer (a partly right drafter: some drafts accepted, some not)."""
    target, rt, ref, seq = base
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.6)
    dec = SpecDecoder(rt, drafter, steps, topk, n)
    for b in range(5, 0, -1):
        res = dec.generate(MIXED[:b], NEW, eos_ids=[])
        assert res.tokens == ref[:b], b
    assert sum(res.accepted) > 0 or steps == 1 and topk == 1 and sum(res.accept_hist[2:]) > 0


def oracle(target, seq, dvocab: int = 128):
    return make_drafter(target, dvocab, Steered).steer(seq, 1.0)


@pytest.mark.parametrize("steps,topk,n", [(4, 1, None), (3, 2, 6)])
@torch.no_grad()
def test_eos_inside_an_accepted_run_ends_the_answer_there(base, steps, topk, n):
    """An oracle accepts every draft, so the eos lands inside an accepted run: nothing after it
    is emitted, the token count is the plain greedy answer's, and the other rows go on."""
    target, rt, ref, seq = base
    dec = SpecDecoder(rt, oracle(target, seq), steps, topk, n)
    row = ref[1]
    # the first token of row 1 not seen before, placed mid-cycle: (cut - 1) % (steps + 1) != 0
    cut = next(i for i in range(3, NEW) if row[i] not in row[:i] and (i - 1) % (steps + 1))
    eos = [row[cut]]
    want = generate(rt, MIXED, NEW, eos_ids=eos)
    res = dec.generate(MIXED, NEW, eos_ids=eos)
    assert res.tokens == want and res.tokens[1] == row[:cut]
    assert res.new_tokens == sum(map(len, want))
    assert sum(res.accept_hist) == res.accept_hist[steps + 1]  # every cycle accepted all


@pytest.mark.parametrize("steps,topk,n", [(4, 1, None), (3, 3, 7)])
@torch.no_grad()
def test_max_new_inside_an_accepted_run_emits_nothing_past_it(base, steps, topk, n):
    """max_new_tokens reached inside a fully accepted run: exactly max_new tokens, plain
    greedy's, for every max_new from 1 to two cycles' worth."""
    target, rt, ref, seq = base
    dec = SpecDecoder(rt, oracle(target, seq), steps, topk, n)
    for new in range(1, 2 * (steps + 1) + 2):
        res = dec.generate(MIXED, new, eos_ids=[])
        assert res.tokens == [r[:new] for r in ref], new
        assert res.new_tokens == new * len(MIXED)


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 2, 5)])
@torch.no_grad()
def test_a_prompt_at_the_decoders_capacity_decodes_as_plain_greedy(steps, topk, n):
    """Prompt + max_new exactly the decoder's capacity (drafts and a tree's scratch slots reach
    the end of the KV cache): plain greedy's tokens, alone and beside a short prompt."""
    target = tiny_target()
    rt = Runtime(target, 2, 64)
    drafter = make_drafter(target, 96)
    dec = SpecDecoder(rt, drafter, steps, topk, n)
    new = 9
    prompt = (LONG * 2)[: dec.capacity() - new]
    want = generate(Runtime(target, 2, 128), [prompt, [4, 5]], new, eos_ids=[])
    seq = greedy_seq(Runtime(target, 2, 128), [prompt, [4, 5]], new + 8)
    for d in (drafter, oracle(target, seq)):
        dec = SpecDecoder(rt, d, steps, topk, n)
        assert dec.generate([prompt, [4, 5]], new, eos_ids=[]).tokens == want
        assert dec.generate([prompt], new, eos_ids=[]).tokens == want[:1]


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (2, 3, 5)])
@torch.no_grad()
def test_refilled_rows_decode_each_prompt_as_alone(base, steps, topk, n):
    """Seven prompts of very different lengths through two rows that refill as they end, one
    eos that ends some answers early: each answer is its prompt's plain greedy answer alone."""
    target, rt, ref, _ = base
    prompts = MIXED + [LONG[5:30], [3]]
    eos = [ref[0][6]]
    want = [generate(rt, [p], NEW, eos_ids=eos)[0] for p in prompts]
    assert any(len(w) < NEW for w in want) and any(len(w) == NEW for w in want)
    dec = SpecDecoder(rt, make_drafter(target, 96), steps, topk, n)
    res = generate_refill(dec, prompts, NEW, eos_ids=eos, rows=2, check_every=1)
    assert res.tokens == want


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (3, 3, 8)])
@torch.no_grad()
def test_a_small_draft_vocabulary_still_gives_the_targets_greedy_tokens(base, steps, topk, n):
    """A drafter of 24 draft ids (d2t into the target's 128): most of the target's tokens lie
    outside its vocabulary and can never be drafted; the answer is still plain greedy's."""
    target, rt, ref, seq = base
    drafter = make_drafter(target, 24, Steered).steer(seq, 1.0)
    hot = set((torch.arange(24) + drafter.d2t).tolist())
    assert any(t not in hot for r in ref for t in r) and any(t in hot for r in ref for t in r)
    res = SpecDecoder(rt, drafter, steps, topk, n).generate(MIXED, NEW, eos_ids=[])
    assert res.tokens == ref and sum(res.accepted) > 0


PROMPT = [3, 1, 4]
SAMPLED = {"top_p": SamplingParams(0.9, top_p=0.8), "top_k": SamplingParams(1.1, top_k=3),
           "all": SamplingParams(1.2, top_k=5, top_p=0.9),
           "temperature": SamplingParams(0.7)}


def sampled_decoder(drafts: str, steps: int, topk: int, n: int | None, params: SamplingParams,
                    b: int) -> tuple:
    """A tiny 8-token target and a drafter for `drafts`: greedy's drafts steered to the target's
    greedy continuation (topk), or a drafter whose q is near enough p to be accepted (drawn)."""
    target = small_target()
    if drafts == "drawn":
        drafter = make_drafter(target, 6, seed=6, std=0.6)
        with torch.no_grad():
            drafter.lm_head.weight.mul_(0.1)
    else:
        seq = greedy_seq(Runtime(target, 1, 24), [PROMPT], 4).expand(b, -1).contiguous()
        drafter = make_drafter(target, 6, Steered, seed=6, std=0.6).steer(seq, 1.0)
    dec = SpecDecoder(Runtime(target, b, 24), drafter, steps, topk, n, params)
    assert dec.drawn == (drafts == "drawn")
    return target, dec


def joint_counts(dec: SpecDecoder, b: int, runs: int) -> torch.Tensor:
    torch.manual_seed(7)
    counts = torch.zeros(8, 8, 8)
    for _ in range(runs):
        for t in dec.generate([PROMPT] * b, 3, eos_ids=[]).tokens:
            counts[t[0], t[1], t[2]] += 1
    return counts


@pytest.mark.parametrize("drafts", ["topk", "drawn"])
@pytest.mark.parametrize("steps,topk,n", [(2, 1, None), (2, 3, 5)])
@pytest.mark.parametrize("setting", list(SAMPLED))
@torch.no_grad()
def test_sampled_speculation_draws_the_targets_joint(setting, steps, topk, n, drafts,
                                                     monkeypatch):
    """4096 draws of (x1, x2, x3) (x2, x3 from the first cycle) under top-p, top-k, both,
    and temperature alone, chain and tree, both sampled-draft rules: they follow the target's
    exact joint under that setting, and not the joint of plain temperature 1."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    params, b = SAMPLED[setting], 1024
    target, dec = sampled_decoder(drafts, steps, topk, n, params, b)
    counts = joint_counts(dec, b, 4)
    assert chi_square_p(counts, exact_joint(target, PROMPT, params, 8)) > 1e-3
    assert chi_square_p(counts, exact_joint(target, PROMPT, SamplingParams(1.0), 8)) < 1e-6


def accept_every_draft(picks: torch.Tensor, tok: torch.Tensor) -> tuple:
    """A wrong chain rule: every draft accepted without a test, the bonus the last draw."""
    s = tok.shape[1] - 1
    n = torch.full((tok.shape[0],), s, dtype=torch.long, device=tok.device)
    return n, (picks if not picks.is_floating_point() else picks.argmax(-1))[:, s]


@pytest.mark.parametrize("drafts,steps,topk,n", [("topk", 2, 1, None), ("drawn", 2, 1, None),
                                                 ("drawn", 2, 3, 5)])
@torch.no_grad()
def test_the_joint_check_fails_a_rule_that_skips_the_accept_test(drafts, steps, topk, n,
                                                                  monkeypatch):
    """The check above has teeth: accepting the draft's token without its test (drawn: no
    min(1, p/q) draw; topk: no match against the target's draw) fails it."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    if drafts == "drawn":
        monkeypatch.setattr(torch, "rand_like", torch.zeros_like)
    else:
        monkeypatch.setattr(speculative.verify, "chain_greedy", accept_every_draft)
    params, b = SAMPLED["all"], 1024
    target, dec = sampled_decoder(drafts, steps, topk, n, params, b)
    counts = joint_counts(dec, b, 4)
    assert chi_square_p(counts, exact_joint(target, PROMPT, params, 8)) < 1e-6


@pytest.mark.parametrize("steps,topk,n", [(2, 1, None), (2, 3, 5)])
@torch.no_grad()
def test_greedy_rows_beside_filtered_rows_keep_their_own_settings(steps, topk, n, monkeypatch):
    """One batch, rows alternating greedy and top-k + top-p at T 1.2: every greedy row is plain
    greedy's answer, and the sampled rows' 2048 draws follow their own setting's joint."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    params, b = SAMPLED["all"], 1024
    target, dec = sampled_decoder("topk", steps, topk, n, params, b)
    greedy = generate(Runtime(target, 1, 24), [PROMPT], 3, eos_ids=[])[0]
    rows = [SamplingParams(), params] * (b // 2)
    torch.manual_seed(7)
    counts = torch.zeros(8, 8, 8)
    for _ in range(4):
        res = dec.generate([PROMPT] * b, 3, eos_ids=[], params=rows)
        assert all(t == greedy for t in res.tokens[::2])
        for t in res.tokens[1::2]:
            counts[t[0], t[1], t[2]] += 1
    assert chi_square_p(counts, exact_joint(target, PROMPT, params, 8)) > 1e-3
