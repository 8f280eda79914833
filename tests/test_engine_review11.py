"""Engine review 11 (CPU): profiled runs decode as unprofiled ones and their phases add up to
the cycle; both refill engines give each prompt its answer alone; sampled rows of different
prompt lengths each draw their own prompt's joint."""

from __future__ import annotations

import pytest
import torch
from test_speculative import Steered, greedy_seq, make_drafter, tiny_target
from test_speculative_sampling import chi_square_p, exact_joint, small_target

from draftsmith.engine import refill, speculative
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.spec_refill import generate_refill
from draftsmith.engine.speculative import SpecDecoder

LONG = [1] + [(5 * i + 7) % 120 + 2 for i in range(33)]
MIXED = [[4], LONG, [1, 60, 61], LONG[:12], [8, 2, 3, 9]]
NEW = 20
MODES = [(3, 1, None), (2, 3, 5)]


@pytest.fixture(scope="module")
def base():
    target = tiny_target()
    rt = Runtime(target, 5, 128)
    ref = generate(rt, MIXED, NEW, eos_ids=[])
    seq = greedy_seq(rt, MIXED, NEW + 8)
    return target, rt, ref, seq


def eos_of(ref: list[list[int]]) -> list[int]:
    """An id that ends some rows early, at different cycles, and leaves one row whole."""
    for i in range(2, NEW):
        cut = [r.index(ref[1][i]) if ref[1][i] in r else NEW for r in ref]
        if len(set(cut)) > 2 and max(cut) == NEW:
            return [ref[1][i]]
    raise AssertionError("no eos that splits the rows")


def assert_phases_add_up(phases, cycles: int, names: set[str]) -> None:
    assert phases.cycles == cycles > 0
    assert set(phases.ms) == names
    assert phases.cycle_ms == pytest.approx(sum(phases.ms.values()))
    assert sum(phases.pct.values()) == pytest.approx(100.0)


@pytest.mark.parametrize("steps,topk,n", MODES)
@torch.no_grad()
def test_a_profiled_run_decodes_as_plain_greedy_and_its_phases_add_up(base, steps, topk, n):
    target, rt, ref, seq = base
    eos = eos_of(ref)
    want = generate(rt, MIXED, NEW, eos_ids=eos)
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.6)
    plain = SpecDecoder(rt, drafter, steps, topk, n).generate(MIXED, NEW, eos_ids=eos)
    res = SpecDecoder(rt, drafter, steps, topk, n, profile=True).generate(MIXED, NEW, eos_ids=eos)
    assert plain.tokens == res.tokens == want
    assert res.cycles == plain.cycles
    assert_phases_add_up(res.phases, res.cycles, {"draft", "verify", "accept", "extend"})


@pytest.mark.parametrize("steps,topk,n", MODES)
@pytest.mark.parametrize("every", [1, None])
@torch.no_grad()
def test_a_profiled_refill_decodes_each_prompt_alone_and_its_phases_add_up(base, steps, topk,
                                                                           n, every):
    target, rt, ref, seq = base
    eos = eos_of(ref)
    prompts = MIXED + MIXED[::-1] + [[3]]
    want = [generate(rt, [p], NEW, eos_ids=eos)[0] for p in prompts]
    dec = SpecDecoder(rt, make_drafter(target, 96), steps, topk, n, profile=True)
    res = generate_refill(dec, prompts, NEW, eos_ids=eos, rows=3, check_every=every)
    assert res.tokens == want
    assert_phases_add_up(res.phases, res.cycles, {"draft", "verify", "accept", "extend",
                                                  "refill"})


@pytest.mark.parametrize("steps,topk,n", MODES)
@pytest.mark.parametrize("new", [1, 2, 3, 4, 5])
@torch.no_grad()
def test_refill_at_small_max_new_gives_each_prompt_alone(base, steps, topk, n, new):
    target, rt, ref, seq = base
    prompts = MIXED + MIXED[:2]
    want = [r[:new] for r in ref] + [r[:new] for r in ref[:2]]
    dec = SpecDecoder(rt, make_drafter(target, 96, Steered).steer(seq, 1.0), steps, topk, n)
    assert generate_refill(dec, prompts, new, eos_ids=[], rows=2).tokens == want
    assert dec.generate(MIXED, new, eos_ids=[]).tokens == [r[:new] for r in ref]


@pytest.mark.parametrize("every", [1, 3, 16])
@torch.no_grad()
def test_the_plain_refill_gives_each_prompt_alone(base, every):
    target, rt, ref, seq = base
    eos = eos_of(ref)
    prompts = MIXED + MIXED[::-1]
    want = [generate(rt, [p], NEW, eos_ids=eos)[0] for p in prompts]
    got = refill.generate_refill(rt, prompts, NEW, eos_ids=eos, rows=2, check_every=every)
    assert got == want


SHORT, TALL = [3, 1, 4], [2, 7, 1, 5, 6, 0, 3]


@pytest.mark.parametrize("drafts", ["topk", "drawn"])
@pytest.mark.parametrize("steps,topk,n", [(2, 1, None), (2, 3, 5)])
@torch.no_grad()
def test_rows_of_different_prompt_lengths_each_draw_their_prompts_joint(steps, topk, n, drafts,
                                                                        monkeypatch):
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    params, b = SamplingParams(1.1, top_k=5, top_p=0.95), 1024
    target = small_target()
    drafter = make_drafter(target, 6, seed=6, std=0.6)
    dec = SpecDecoder(Runtime(target, b, 24), drafter, steps, topk, n, params)
    torch.manual_seed(11)
    counts = torch.zeros(2, 8, 8, 8)
    for _ in range(4):
        res = dec.generate([SHORT, TALL] * (b // 2), 3, eos_ids=[])
        for i, t in enumerate(res.tokens):
            counts[i % 2, t[0], t[1], t[2]] += 1
    for i, prompt in enumerate((SHORT, TALL)):
        assert chi_square_p(counts[i], exact_joint(target, prompt, params, 8)) > 1e-3


@pytest.mark.parametrize("drafts", ["topk", "drawn"])
@torch.no_grad()
def test_refilled_sampled_rows_draw_their_prompts_joint(drafts, monkeypatch):
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    params = SamplingParams(0.9, top_k=6)
    target = small_target()
    drafter = make_drafter(target, 6, seed=6, std=0.6)
    dec = SpecDecoder(Runtime(target, 64, 24), drafter, 2, 3, 5, params)
    torch.manual_seed(12)
    counts = torch.zeros(2, 8, 8, 8)
    res = generate_refill(dec, [SHORT, TALL] * 2048, 3, eos_ids=[], rows=64)
    for i, t in enumerate(res.tokens):
        counts[i % 2, t[0], t[1], t[2]] += 1
    for i, prompt in enumerate((SHORT, TALL)):
        assert chi_square_p(counts[i], exact_joint(target, prompt, params, 8)) > 1e-3


def summed(results: list, key: str) -> list[int]:
    return [sum(c) for c in zip(*(getattr(r, key) for r in results), strict=True)]


def assert_counts_of_each_alone(res, alone: list) -> None:
    assert res.tokens == [r.tokens[0] for r in alone]
    assert (res.accept_hist, res.reached, res.accepted) == tuple(
        summed(alone, k) for k in ("accept_hist", "reached", "accepted"))


@pytest.mark.parametrize("steps,topk,n", MODES)
@torch.no_grad()
def test_a_batchs_accept_counts_are_each_prompts_alone_summed(base, steps, topk, n):
    """Rows ending at different cycles (eos, max_new) count nothing once done: the batch's
    histogram and position counts are those of each prompt decoded alone, summed."""
    target, rt, ref, seq = base
    eos = eos_of(ref)
    drafter = make_drafter(target, 96, Steered).steer(seq, 0.6)
    dec = SpecDecoder(rt, drafter, steps, topk, n)
    alone = []
    for i, p in enumerate(MIXED):
        drafter.row0 = i  # steered alone as it is in row i of the batch
        alone.append(dec.generate([p], NEW, eos_ids=eos))
    drafter.row0 = 0
    assert_counts_of_each_alone(dec.generate(MIXED, NEW, eos_ids=eos), alone)


@pytest.mark.parametrize("steps,topk,n", MODES)
@pytest.mark.parametrize("rows,every", [(2, 1), (3, None), (5, 2)])
@torch.no_grad()
def test_a_refills_accept_counts_are_each_prompts_alone_summed(base, steps, topk, n, rows,
                                                               every):
    """Idle rows and rows waiting for their refill count nothing either."""
    target, rt, ref, seq = base
    eos = eos_of(ref)
    dec = SpecDecoder(rt, make_drafter(target, 96), steps, topk, n)
    prompts = MIXED + MIXED[:3]
    alone = [dec.generate([p], NEW, eos_ids=eos) for p in prompts]
    assert sum(summed(alone, "accepted")) > 0
    res = generate_refill(dec, prompts, NEW, eos_ids=eos, rows=rows, check_every=every)
    assert_counts_of_each_alone(res, alone)
