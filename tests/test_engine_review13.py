"""Engine review 13 (CPU): exact accept counts and cycle counts for a drafter that always drafts
the target's token and one that never does, static and refilled (prompts that are prefixes of one
greedy answer, so one steered sequence is every row's oracle); a decoder reused between static
and refilled runs of other batches, eos ids and max_new; the step API as `generate`; the eager
drafter prompt pass split into chunks as one pass."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_speculative import Steered, make_drafter, tiny_target

from draftsmith.engine.drafter_runtime import DrafterRuntime
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.spec_refill import generate_refill
from draftsmith.engine.speculative import SpecDecoder, drafter_prompt

NEW = 17
MODES = [(1, 1, None), (3, 1, None), (2, 3, 5), (3, 4, 2)]


@pytest.fixture(scope="module")
def base():
    """A target, one greedy answer (as a sequence from its start) and prompts that are its
    prefixes of very different lengths, so each prompt's greedy answer is the sequence's rest."""
    target = tiny_target()
    rt = Runtime(target, 4, 160)
    start = [1, 9, 33, 70]
    seq = start + generate(rt, [start], 100, eos_ids=[])[0]
    prompts = [seq[:k] for k in (4, 31, 5, 12, 47, 7)]
    return target, rt, seq, prompts


def steered(target, seq: list[int], sign: float) -> Steered:
    rows = torch.tensor(seq).repeat(4, 1)  # every row's continuation is the same sequence
    return make_drafter(target, 128, Steered).steer(rows, 1.0, sign)


def expect(seq: list[int], prompts: list[list[int]], new: int) -> list[list[int]]:
    return [seq[len(p): len(p) + new] for p in prompts]


@pytest.mark.parametrize("steps,topk,n", MODES)
@torch.no_grad()
def test_prefixes_of_one_answer_continue_it(base, steps, topk, n):
    """The fixture's premise, and each mode's answer: plain greedy's, static and refilled."""
    target, rt, seq, prompts = base
    want = expect(seq, prompts, NEW)
    assert generate(rt, prompts[:4], NEW, eos_ids=[]) == want[:4]
    dec = SpecDecoder(rt, make_drafter(target, 96), steps, topk, n)
    assert dec.generate(prompts[:4], NEW, eos_ids=[]).tokens == want[:4]
    assert generate_refill(dec, prompts, NEW, eos_ids=[], rows=3).tokens == want


@pytest.mark.parametrize("steps,topk,n", MODES)
@pytest.mark.parametrize("rows,every", [(None, None), (2, 1), (3, 3)])
@pytest.mark.parametrize("buckets", [False, True])
@torch.no_grad()
def test_an_oracle_accepts_every_draft_static_and_refilled(base, steps, topk, n, rows, every,
                                                            buckets):
    """Every cycle of every prompt accepts the whole tree's deepest path (n drafts deep at most):
    ceil((NEW - 1) / (depth + 1)) cycles a prompt, each counted at that accept length; a static
    batch counts exactly that many cycles; prompts exact or bucketed."""
    target, _, seq, prompts = base
    rt = Runtime(target, 4, 160, prompt_buckets=buckets)
    depth = steps if n is None else min(steps, n - 1)
    per = math.ceil((NEW - 1) / (depth + 1))
    dec = SpecDecoder(rt, steered(target, seq, 1.0), steps, topk, n)
    res = generate_refill(dec, prompts, NEW, eos_ids=[], rows=rows, check_every=every)
    assert res.tokens == expect(seq, prompts, NEW)
    assert res.accept_hist[depth + 1] == sum(res.accept_hist) == per * len(prompts)
    assert res.accepted[:depth] == [per * len(prompts)] * depth
    static = dec.generate(prompts[:4], NEW, eos_ids=[])
    assert static.tokens == expect(seq, prompts[:4], NEW)
    assert static.cycles == per and static.accept_hist[depth + 1] == 4 * per


@pytest.mark.parametrize("steps,topk,n", MODES)
@pytest.mark.parametrize("rows,every", [(None, None), (2, 1), (3, 3)])
@pytest.mark.parametrize("buckets", [False, True])
@torch.no_grad()
def test_a_drafter_that_never_drafts_the_token_emits_one_a_cycle(base, steps, topk, n, rows,
                                                                  every, buckets):
    """Every draft rejected: one token a cycle, NEW - 1 cycles a prompt, nothing accepted, and
    still each prompt's greedy answer, static and refilled; prompts exact or bucketed."""
    target, _, seq, prompts = base
    rt = Runtime(target, 4, 160, prompt_buckets=buckets)
    dec = SpecDecoder(rt, steered(target, seq, -1.0), steps, topk, n)
    res = generate_refill(dec, prompts, NEW, eos_ids=[], rows=rows, check_every=every)
    assert res.tokens == expect(seq, prompts, NEW)
    assert res.accept_hist[1] == sum(res.accept_hist) == (NEW - 1) * len(prompts)
    assert sum(res.accepted) == 0 and res.reached[0] == (NEW - 1) * len(prompts)
    static = dec.generate(prompts[:4], NEW, eos_ids=[])
    assert static.tokens == expect(seq, prompts[:4], NEW) and static.cycles == NEW - 1


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (2, 3, 5)])
@torch.no_grad()
def test_an_eos_inside_an_oracles_run_ends_each_refilled_answer_there(base, steps, topk, n):
    """An eos id met mid-run in some answers and never in others: each refilled answer stops
    just before it, nothing of the accepted run after it kept."""
    target, rt, seq, prompts = base
    want_full = expect(seq, prompts, NEW)
    eos = next(t for t in want_full[0][2:] if any(t not in w for w in want_full))
    want = [w[: w.index(eos)] if eos in w else w for w in want_full]
    assert len({len(w) for w in want}) > 1
    assert want == [generate(rt, [p], NEW, eos_ids=[eos])[0] for p in prompts]
    dec = SpecDecoder(rt, steered(target, seq, 1.0), steps, topk, n)
    assert generate_refill(dec, prompts, NEW, eos_ids=[eos], rows=2, check_every=1).tokens == want
    assert dec.generate(prompts[:4], NEW, eos_ids=[eos]).tokens == want[:4]


@torch.no_grad()
def test_one_decoder_reused_between_static_and_refilled_runs(base):
    """Static and refilled runs on one decoder at one batch size, each with other eos ids and
    max_new: no run's state (eos, max_new, done flags, counts) leaks into the next."""
    target, rt, seq, prompts = base
    dec = SpecDecoder(rt, make_drafter(target, 96), 3, 2, 6)
    runs = [(prompts[:4], 9, [seq[40]]), (prompts, 15, []), (prompts[2:], 5, [seq[20], seq[13]]),
            (prompts[:4], NEW, []), (prompts[1:], 12, [seq[50]])]
    for i, (ps, new, eos) in enumerate(runs * 2):
        ps = ps[:4] if i % 2 == 0 else ps  # a static batch holds the runtime's 4 rows at most
        want = [generate(rt, [p], new, eos_ids=eos)[0] for p in ps]
        got = (dec.generate(ps, new, eos_ids=eos) if i % 2 == 0 else
               generate_refill(dec, ps, new, eos_ids=eos, rows=4, check_every=2))
        assert got.tokens == want, i


@pytest.mark.parametrize("steps,topk,n", [(3, 1, None), (2, 3, 5)])
@torch.no_grad()
def test_the_step_api_decodes_as_generate(base, steps, topk, n):
    """start, cycle until finished (the loop serve runs): each row's first `count` outputs are
    generate's answer, and rows ended early stay unchanged by later cycles."""
    target, rt, seq, prompts = base
    dec = SpecDecoder(rt, make_drafter(target, 96), steps, topk, n)
    eos = [seq[20]]
    want = dec.generate(prompts[:4], NEW, eos_ids=eos).tokens
    st = dec.start(prompts[:4], NEW, eos)
    for _ in range(NEW):
        if dec.finished(st):
            break
        dec.cycle(st)
    assert dec.finished(st)
    counts, out = st.count.tolist(), st.out.tolist()
    got = [o[: min(c, NEW)] for o, c in zip(out, counts, strict=True)]
    assert [g[: g.index(eos[0])] if eos[0] in g else g for g in got] == want


class _Wide:
    """A drafter as the chunked prompt pass sees it, with a draft vocabulary claimed `vocab` wide:
    its chunk of 2**25 // (b * vocab) tokens shrinks to a few."""

    def __init__(self, drafter, vocab: int) -> None:
        self.drafter, self.cfg = drafter, SimpleNamespace(draft_vocab_size=vocab)

    def fuse(self, aux):
        return self.drafter.fuse(aux)

    def __call__(self, *args, **kw):
        return self.drafter(*args, **kw)


@pytest.mark.parametrize("chunk", [1, 2, 5])
@torch.no_grad()
def test_the_chunked_drafter_prompt_pass_is_one_pass(base, chunk):
    """Rows of 3, 11 and 8 tokens through the eager prompt pass in chunks of 1, 2 and 5 tokens:
    the root logits and hidden at each row's last position and the K/V of its positions are
    those of one pass over the whole prompt."""
    target = base[0]
    drafter = make_drafter(target, 96)
    b, longest, naux = 3, 11, len(drafter.cfg.aux_layer_ids)
    torch.manual_seed(3)
    ext = torch.randint(0, 128, (b, longest))
    aux = torch.randn(b, longest, naux, target.cfg.hidden_size) * 0.5
    lens = torch.tensor([3, 11, 8])
    pos = torch.arange(longest).repeat(b, 1)
    whole, parts = DrafterRuntime(drafter, b, 32, False), DrafterRuntime(drafter, b, 32, False)
    want = drafter_prompt(whole, ext, aux, pos, lens, None, whole.caches_for(b))
    vocab = 2**25 // (b * chunk)
    assert 2**25 // (b * vocab) == chunk
    wide = SimpleNamespace(drafter=_Wide(drafter, vocab))
    got = drafter_prompt(wide, ext, aux, pos, lens, None, parts.caches_for(b))
    torch.testing.assert_close(got, want)
    for mine, ref in zip(parts.caches, whole.caches, strict=True):
        for r, n in enumerate(lens.tolist()):
            torch.testing.assert_close(mine.k[r, :, :n], ref.k[r, :, :n])
            torch.testing.assert_close(mine.v[r, :, :n], ref.v[r, :, :n])
