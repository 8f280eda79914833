"""Speculative refill: a finished row takes the next prompt, and every answer is the one its prompt
gets from plain greedy decoding alone."""

from __future__ import annotations

import pytest
import torch
from test_refill import PROMPTS
from test_speculative import Steered, greedy_seq, make_drafter, tiny_target

from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.spec_refill import generate_refill, prompt_pass
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError

NEW = 20


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(vocab=128, seed=1)
    alone = [generate(Runtime(target, 1, 96, graphs=False), [p], NEW, eos_ids=[])[0]
             for p in PROMPTS]
    eos = sorted({alone[0][3], alone[2][7]})  # tokens the answers really produce: rows stop early
    want = [generate(Runtime(target, 1, 96, graphs=False), [p], NEW, eos_ids=eos)[0]
            for p in PROMPTS]
    assert len({len(w) for w in want}) > 2  # the stops really vary the lengths
    seq = greedy_seq(Runtime(target, len(PROMPTS), 96, graphs=False), PROMPTS, NEW + 8)
    return target, eos, want, seq


def decoder(setup, steps: int, topk: int, n: int | None, rows: int = 3) -> SpecDecoder:
    target, _, _, seq = setup
    # steered toward each prompt's greedy answer by row: right for the first prompts in their
    # rows, wrong for the prompts that refill them later (which still decode exactly)
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.8)
    return SpecDecoder(Runtime(target, rows, 96, graphs=False), drafter, steps, topk, n,
                       max_batch=rows)


@pytest.mark.parametrize(("steps", "topk", "n", "rows", "every"), [
    (3, 1, None, 3, 1), (3, 1, None, 3, 4), (3, 2, 6, 3, 2), (4, 4, 10, 3, 8), (2, 1, None, 1, 2),
    (3, 2, 6, 8, 2)])
def test_refilled_answers_equal_plain_greedy_alone(setup, steps, topk, n, rows, every):
    _, eos, want, _ = setup
    dec = decoder(setup, steps, topk, n, rows)
    res = generate_refill(dec, PROMPTS, NEW, eos_ids=eos, rows=rows, check_every=every)
    assert res.tokens == want
    emitted = sum(k * c for k, c in enumerate(res.accept_hist))
    assert emitted + len(PROMPTS) >= res.new_tokens  # the prefills made each first token
    assert sum(res.accept_hist[2:]) > 0  # drafts were accepted, not only bonus tokens
    assert res.extra["refill_rows"] == rows


def test_a_refilled_row_holds_what_a_fresh_start_gives_its_prompt(setup):
    """After a refill run left every row used, a prompt refilled into row 1 holds its prompt's
    target and drafter K/V, the first draft's root (logits, hidden), first token and length as
    a decoder starting that prompt alone. (Answers stay exact with a stale drafter state, so the
    answer tests cannot see one; only acceptance drops.)"""
    _, eos, _, _ = setup
    dec = decoder(setup, 3, 2, 6)
    generate_refill(dec, PROMPTS, NEW, eos_ids=eos, rows=3)
    prompt = PROMPTS[3]
    prompt_pass(dec, 3)([1], [prompt])
    st, ref = dec._state(3), decoder(setup, 3, 2, 6, rows=1).start([prompt], NEW, eos)
    n = len(prompt)
    assert torch.allclose(st.root_logits[1], ref.root_logits[0], atol=1e-5)
    assert torch.allclose(st.root_hidden[1], ref.root_hidden[0], atol=1e-5)
    for got, want in ((st.dcaches, ref.dcaches), (st.tcaches, ref.tcaches)):
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g.k[1, :, :n], w.k[0, :, :n], atol=1e-5)
            assert torch.allclose(g.v[1, :, :n], w.v[0, :, :n], atol=1e-5)
    assert [int(st.L[1]), int(st.last[1]), int(st.count[1])] == [
        int(ref.L[0]), int(ref.last[0]), int(ref.count[0])]


def test_a_second_call_starts_clean(setup):
    _, eos, want, _ = setup
    dec = decoder(setup, 3, 2, 6)
    generate_refill(dec, PROMPTS[::-1], 12, eos_ids=[], rows=3)
    again = generate_refill(dec, PROMPTS, NEW, eos_ids=eos, rows=3)
    assert again.tokens == want
    static = dec.generate(PROMPTS[:3], NEW, eos_ids=eos)  # the static path shares the state
    assert static.tokens == want[:3]


def test_fewer_prompts_than_rows(setup):
    _, eos, want, _ = setup
    res = generate_refill(decoder(setup, 3, 1, None), PROMPTS[:2], NEW, eos_ids=eos, rows=3)
    assert res.tokens == want[:2] and res.extra["refill_rows"] == 2


def test_refills_come_further_apart_from_32_rows_by_default(setup):
    """The default spacing follows the H200 sweeps: every 4 cycles below 32 rows, every 8 from
    32; an explicit spacing is kept."""
    from draftsmith.engine.spec_refill import refill_every_for

    assert [refill_every_for(r) for r in (1, 8, 31, 32, 64)] == [4, 4, 4, 8, 8]
    dec = decoder(setup, 3, 1, None)
    assert generate_refill(dec, PROMPTS, 4, rows=3).extra["check_every"] == 4
    assert generate_refill(dec, PROMPTS, 4, rows=3, check_every=6).extra["check_every"] == 6


def test_a_profiled_refill_times_its_refills_and_decodes_the_same(setup):
    """`--profile` with refilled rows: the four phases of every cycle plus `refill` (harvest and
    prefill, per cycle over all cycles), and the same answers as unprofiled."""
    _, eos, want, _ = setup
    dec = decoder(setup, 3, 2, 6)
    dec.profile = True
    res = generate_refill(dec, PROMPTS, NEW, eos_ids=eos, rows=3, check_every=2)
    assert res.tokens == want
    ph = res.phases
    assert ph is not None and ph.cycles == res.cycles
    assert list(ph.ms) == ["draft", "verify", "accept", "extend", "refill"]
    assert all(v > 0 for v in ph.ms.values())
    assert sum(ph.pct.values()) == pytest.approx(100)
    assert ph.cycle_ms == pytest.approx(sum(ph.ms.values()))
    assert ph.accept_length == res.mean_accept_length
    dec.profile = False
    assert generate_refill(dec, PROMPTS, NEW, eos_ids=eos, rows=3).phases is None


@pytest.mark.parametrize(("prompts", "new", "rows", "what"), [
    ([[1, 2], []], 4, 2, "empty prompt"), ([], 4, 2, "empty prompt list"),
    ([[1] * 90], 8, 2, "exceeds this decoder's capacity"),
    ([[1, 2]], 0, 1, "max_new_tokens must be >= 1"), ([[1, 2]] * 5, 4, 4, "exceed max_batch")])
def test_bad_input_is_refused(setup, prompts, new, rows, what):
    with pytest.raises(DraftsmithError, match=what):
        generate_refill(decoder(setup, 3, 1, None), prompts, new, rows=rows)
