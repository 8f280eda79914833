"""The refill cost model: its schedules replay the engines' host loops cycle for cycle, and its
prices follow from them."""

from __future__ import annotations

import math

import pytest
import torch
from test_refill import PROMPTS
from test_speculative import make_drafter, tiny_target

from draftsmith.engine import refill as plain_refill
from draftsmith.engine import spec_refill
from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.tune.cost_model import (
    Acceptance,
    CostModelError,
    CostTable,
    PromptMix,
    SpecSetting,
    predict,
    tokens_per_cycle,
)
from draftsmith.tune.refill_model import Refill, baseline_schedule, refill_order, spec_schedule

NEW = 16


def test_spec_schedule_by_hand():
    # rows 0, 1 take prompts 0 (3 cycles) and 1 (1 cycle); the host sees a row done one cycle
    # late: row 1 (done at 1) refills after cycle 2 with prompt 2 (ends at 7), row 0 (done at 3)
    # after cycle 4 with prompt 3 (ends at 6); cycle 8 sees both done
    s = spec_schedule([3, 1, 5, 2], rows=2, every=1)
    assert (s.cycles, s.fills, s.busy) == (8, (2, 1, 1), 11)
    # every 4: both rows wait for cycle 4 and refill together (ends 9 and 6)
    assert spec_schedule([3, 1, 5, 2], rows=2, every=4).fills == (2, 2)
    assert spec_schedule([3, 1, 5, 2], rows=2, every=4).cycles == 10
    # more rows than prompts; a prompt done at its prompt pass (0 cycles) still takes a cycle
    assert spec_schedule([2], rows=4, every=1) == spec_schedule([2], rows=1, every=1)
    assert spec_schedule([0], rows=1, every=1).cycles == 1


def test_baseline_schedule_by_hand():
    # the host looks every 3 steps: both rows end at 4, seen at 6; prompt 2 ends at 10, seen at 12
    s = baseline_schedule([4, 4, 4], rows=2, every=3)
    assert (s.cycles, s.fills, s.busy) == (12, (2, 1), 12)


@pytest.mark.parametrize("bad", [dict(need=[]), dict(rows=0), dict(every=0), dict(need=[-1])])
def test_schedules_refuse_bad_input(bad):
    args = {"need": [2, 3], "rows": 2, "every": 1, **bad}
    for schedule in (spec_schedule, baseline_schedule):
        with pytest.raises(CostModelError, match="refill schedule"):
            schedule(**args)


@pytest.fixture(scope="module")
def stops():
    """A tiny target, stop tokens its answers really produce (rows end at varied lengths), and
    each prompt's answer under them."""
    target = tiny_target(vocab=128, seed=1)
    rt = Runtime(target, 1, 96, graphs=False)
    free = [generate(rt, [p], NEW, eos_ids=[])[0] for p in PROMPTS]
    # one answer ends at its first token (done at its prompt pass)
    eos = sorted({free[0][3], free[2][6], free[5][9], free[1][0]})
    want = [generate(rt, [p], NEW, eos_ids=eos)[0] for p in PROMPTS]
    assert len({len(w) for w in want}) > 2 and min(map(len, want)) == 0
    return target, eos, want, {t for f in free for t in f}


def _missing_drafter(target, produced: set[int]):
    """A drafter that always proposes one token no answer contains: every cycle emits exactly
    the target's own token, so a prompt's cycles are known from its answer alone."""
    t0 = next(t for t in range(8, 120) if t not in produced)
    d = make_drafter(target, 8)
    with torch.no_grad():
        d.lm_head.weight.zero_()  # equal logits: the first draft id, t0, is always the top
        d.set_vocab(torch.full((8,), t0), torch.arange(128).ge(t0) & torch.arange(128).lt(t0 + 8))
    return d


def _counted(monkeypatch, owner, at: int) -> list[int]:
    """How many rows each call of owner.start (a refill's prompt pass) filled: its argument
    `at` is the rows."""
    seen, real = [], owner.start

    def start(self, *args, **kw):
        seen.append(len(args[at]))
        return real(self, *args, **kw)

    monkeypatch.setattr(owner, "start", start)
    return seen


@pytest.mark.parametrize(("rows", "every"), [(3, 1), (3, 4), (2, 2), (8, 1), (10, 2)])
def test_spec_schedule_is_the_engines_own(stops, monkeypatch, rows, every):
    """Given each prompt's cycles, the model's schedule has the engine's cycle count and its
    refills of the same sizes, in order."""
    target, eos, want, produced = stops
    dec = SpecDecoder(Runtime(target, rows, 96, graphs=False), _missing_drafter(target, produced),
                      3, 1, None, max_batch=rows)
    fills = _counted(monkeypatch, spec_refill.Prefiller, 1)
    res = spec_refill.generate_refill(dec, PROMPTS, NEW, eos, rows, every)
    assert res.tokens == want and sum(res.accepted) == 0  # one token a cycle, as arranged
    need = [min(len(w), NEW - 1) for w in want]  # the first token came from the prompt pass
    s = spec_schedule(need, rows, every)
    assert (s.cycles, list(s.fills)) == (res.cycles, fills)
    assert s.busy == sum(res.accept_hist)


@pytest.mark.parametrize(("rows", "every"), [(3, 1), (3, 3), (2, 4), (8, 2), (10, 1)])
def test_baseline_schedule_is_the_engines_own(stops, monkeypatch, rows, every):
    target, eos, want, _ = stops
    rt = Runtime(target, rows, 96, graphs=False)
    fills = _counted(monkeypatch, plain_refill.RefillState, 0)
    steps = [0]
    real_step = plain_refill.RefillState.step
    monkeypatch.setattr(plain_refill.RefillState, "step",
                        lambda self: (steps.__setitem__(0, steps[0] + 1), real_step(self)))
    got = plain_refill.generate_refill(rt, PROMPTS, NEW, eos_ids=eos, rows=rows, check_every=every)
    assert got == want
    s = baseline_schedule([min(len(w), NEW - 1) for w in want], rows,
                          plain_refill.step_spacing(every, NEW))
    assert (s.cycles, list(s.fills)) == (steps[0], fills)


def _costs(**refill) -> CostTable:
    return CostTable(verify={4: {1: 10.0, 4: 12.0}}, draft_step={4: {1: 2.0}},
                     decode={4: 9.0}, **refill)


def test_a_refilled_run_takes_the_prompts_in_turn_up_to_its_waves():
    assert refill_order(3, 2) == [0, 1, 2, 0, 1, 2, 0, 1]  # four a row by default
    assert refill_order(10, 2) == list(range(10))  # every prompt, once
    assert refill_order(2, 3, waves=1) == [0, 1, 0]
    with pytest.raises(CostModelError, match="refill_order"):
        refill_order(0, 2)


def test_refill_passes_cost_the_padded_row_count():
    c = _costs(refill={1: 5.0, 2: 6.0, 4: 8.0}, spec_refill={1: 7.0, 4: 11.0})
    assert [c.refill_ms(k, False) for k in (1, 2, 3, 4)] == [5.0, 6.0, 8.0, 8.0]
    assert c.refill_ms(3, True) == 11.0
    assert c.refill_ms(6, False) == 8.0 + 6.0  # beyond the largest count: passes of it
    assert c.refill_ms(8, True) == 22.0
    with pytest.raises(CostModelError, match="tune --refill"):
        _costs().refill_ms(1, False)


def test_refilled_rows_price_their_cycles_and_prompt_passes():
    """Alike prompts that always accept (no spread of cycles): the schedule's cycles at the
    predicted cycle plus each refill's pass; a mix of fast and slow prompts keeps more row
    slots busy refilled than in static batches."""
    c = _costs(refill={1: 5.0, 4: 8.0}, spec_refill={1: 6.0, 4: 9.0})
    fast, slow = Acceptance.constant(0.9, 3), Acceptance.constant(0.1, 3)
    plan = Refill(NEW, every={4: 1}, steps_every={4: 4}, waves=2)
    chain, sure = SpecSetting(3), Acceptance.constant(1.0, 3)
    alike = PromptMix((sure,) * 3)  # taken in turn up to two a row: 8 prompts
    p = predict(c, sure, chain, 4, alike, plan)
    need = math.ceil((NEW - 1) / 4)
    s = spec_schedule([need] * 8, 4, 1)
    assert s.fills == (4, 4)
    cycle = 12.0 + 2.0 * 3  # verify of 4 tokens, three draft steps (no extend measured)
    assert p.cycle_ms == pytest.approx(cycle + 18.0 / s.cycles)
    assert p.tokens_per_s == pytest.approx(8 * NEW * 1000 / (cycle * s.cycles + 18.0))
    # the first fill comes before the first cycle, outside the profiled phases
    assert p.phases["refill"] == p.phases["unprofiled"] == pytest.approx(9.0 / s.cycles)
    base = predict(c, sure, SpecSetting.baseline(), 4, alike, plan)
    assert base.tokens_per_s == pytest.approx(8 * NEW * 1000 / (9.0 * 32 + 16.0))
    # two prompts a row: the last wave's tail idles as much as a static batch's rows do;
    # ten a row: refilled rows stay busy where the static batch's wait for their slowest
    mixed = PromptMix((fast, slow) * 4)
    few = predict(c, fast, chain, 4, mixed, plan).busy
    deep = predict(c, fast, chain, 4, mixed, Refill(NEW, {4: 1}, {4: 4}, waves=10)).busy
    assert few < mixed.busy(chain, 4) + 0.05 < deep
    with pytest.raises(CostModelError, match="a mix"):
        predict(c, fast, chain, 4, None, plan)
    with pytest.raises(CostModelError, match="batch 8"):
        predict(c, fast, chain, 8, alike, plan)


def test_a_tree_is_priced_at_its_own_acceptance_under_refill():
    """A prompt's pace is its own chain's; a tree's, its own tree's where measured, else its
    chain's times the tree's gain over its chain in the pooled figures (trees were priced at
    the chain's pace: review of 9990224), within 1 and steps + 1; a tree whose siblings
    catch what the chain misses is predicted faster than the chain, as in static batches."""
    c = CostTable(verify={8: {1: 10.0, 8: 10.0}}, draft_step={8: {1: 1.0, 4: 1.0}},
                  decode={8: 10.0}, refill={8: 5.0}, spec_refill={8: 5.0})
    acc = Acceptance(chain=(0.6,) * 3, tree=((0.6, 0.2, 0.1, 0.05),) * 3)
    slow, sure = Acceptance.constant(0.5, 3), Acceptance.constant(1.0, 3)
    mix = PromptMix((slow, sure))
    plan = Refill(64, {8: 4}, {8: 4})
    chain, tree = SpecSetting(3), SpecSetting(3, 4, 8)
    assert plan.paces(acc, chain, 8, mix)[:2] == [1.875, 4.0]  # each prompt's own chain
    gain = tokens_per_cycle(acc, tree) / tokens_per_cycle(Acceptance(chain=acc.chain), tree)
    assert gain > 1.2
    assert plan.paces(acc, tree, 8, mix)[:2] == [pytest.approx(1.875 * gain), 4.0]  # capped
    assert predict(c, acc, tree, 8, mix).tokens_per_s > predict(c, acc, chain, 8, mix).tokens_per_s
    refilled = [predict(c, acc, s, 8, mix, plan) for s in (chain, tree)]
    assert refilled[1].tokens_per_s > refilled[0].tokens_per_s
    assert refilled[0].tokens_per_cycle == pytest.approx(2 / (1 / 1.875 + 1 / 4.0))
    own = PromptMix((Acceptance(chain=slow.chain, tree=((0.5, 0.45),) * 3), sure))
    assert plan.paces(acc, tree, 8, own)[:2] == [  # a prompt's own tree, where measured
        pytest.approx(tokens_per_cycle(own.prompts[0], tree)), 4.0]
    assert plan.paces(acc, chain, 8, own)[:2] == [1.875, 4.0]
    zero = CostTable(verify={8: {1: 0.0}}, draft_step={8: {1: 0.0}}, decode={8: 0.0},
                     refill={8: 0.0}, spec_refill={8: 0.0})
    with pytest.raises(CostModelError, match="cycle time"):
        predict(zero, acc, chain, 8, mix, plan)
