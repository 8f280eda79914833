"""The tune cost model on synthetic cost and acceptance tables whose right answer is known."""

import json
import math

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.tune.cost_model import (
    TREE_PRIOR,
    Acceptance,
    CostTable,
    Measurement,
    PromptMix,
    SpecSetting,
    batch_groups,
    candidate_grid,
    chain_tokens_per_cycle,
    disagreement_cause,
    leviathan_speedup,
    leviathan_tokens_per_cycle,
    predict,
    prompt_tree,
    rank_settings,
    recommend,
    steps_series,
    sweep_plan,
    tokens_per_cycle,
    tree_capacity,
    tree_tokens_per_cycle,
)
from draftsmith.tune.flags import (
    recommendation_text,
    sglang_flags,
    vllm_flags,
    vllm_speculative_config,
)

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 11, 16, 32, 64)


def seed_costs() -> CostTable:
    """The seed's 2-GPU numbers: verify 18.67 ms at 3 tokens, +1.1 ms a token, draft
    0.45 ms a step, re-extend 0.28 ms, plain decode 11.3 ms."""
    verify = {1: {n: 18.67 + 1.1 * (n - 3) for n in WIDTHS if n >= 2}}
    return CostTable(
        verify=verify,
        draft_step={1: {k: 0.45 for k in (1, 2, 4, 8)}},
        extend={1: {3: 0.28}},
        decode={1: 11.3},
    )


def best_speculative(preds):
    return next(p for p in preds if not p.setting.is_baseline)


# ------------------------------------------------------------------------ expected tokens


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.9, 1.0])
@pytest.mark.parametrize("steps", [1, 2, 5, 10])
def test_chain_matches_leviathan_closed_form(alpha: float, steps: int) -> None:
    acc = Acceptance.constant(alpha, depth=steps)
    want = leviathan_tokens_per_cycle(alpha, steps)
    assert chain_tokens_per_cycle(acc, steps) == pytest.approx(want, rel=1e-12)
    if alpha < 1:
        assert want == pytest.approx((1 - alpha ** (steps + 1)) / (1 - alpha))


def test_leviathan_speedup_worth_it_only_when_alpha_above_c() -> None:
    assert leviathan_speedup(0.5, 1, 0.4) > 1.0
    assert leviathan_speedup(0.3, 1, 0.4) < 1.0


def test_acceptance_from_histogram_reproduces_mean_accept_length() -> None:
    hist = [10, 20, 30, 40]  # cycles that accepted 0, 1, 2, 3 drafts, steps 3
    acc = Acceptance.from_accept_histogram(hist)
    assert acc.chain == pytest.approx((0.9, 70 / 90, 40 / 70))
    mean = sum(a * n for a, n in enumerate(hist)) / sum(hist)
    assert chain_tokens_per_cycle(acc, 3) == pytest.approx(1 + mean)


def test_chain_counts_stop_at_unreached_positions_and_hold_the_last() -> None:
    acc = Acceptance.from_chain_counts([100, 50, 0], [50, 10, 0])
    assert acc.chain == (0.5, 0.2)
    assert acc.depth == 2
    assert acc.p(5) == 0.2


def test_tree_by_hand() -> None:
    acc = Acceptance(tree=((0.6, 0.3), (0.5, 0.2)))
    # depth 1: .6, .3; depth 2 children of both: .3, .12, .15, .06; keep the best 3
    assert tree_tokens_per_cycle(acc, 2, 2, 4) == pytest.approx(1 + 0.6 + 0.3 + 0.3)
    assert tree_tokens_per_cycle(acc, 2, 2, tree_capacity(2, 2)) == pytest.approx(
        1 + 0.6 + 0.3 + 0.3 + 0.12 + 0.15 + 0.06
    )


def test_tree_at_least_chain_when_rank0_is_the_chain() -> None:
    p = (0.8, 0.7, 0.6, 0.5, 0.4)
    tree = Acceptance(tree=tuple((x, (1 - x) * 0.5, (1 - x) * 0.2) for x in p))
    chain = Acceptance(chain=p)
    for steps in range(1, 6):
        want = chain_tokens_per_cycle(chain, steps)
        assert tree_tokens_per_cycle(tree, steps, 1, steps + 1) == pytest.approx(want)
        for topk in (2, 4, 8):
            n = min(steps + 1 + 4, tree_capacity(steps, topk))
            assert tree_tokens_per_cycle(tree, steps, topk, n) > want


def test_tree_without_tree_data_ties_with_chain() -> None:
    acc = Acceptance(chain=(0.8, 0.6, 0.4))
    want = chain_tokens_per_cycle(acc, 3)
    assert tokens_per_cycle(acc, SpecSetting(3, 4, 16)) == pytest.approx(want)


def test_acceptance_from_tree_counts() -> None:
    acc = Acceptance.from_tree_counts([100, 80], [[60, 20, 5], [40, 8]])
    assert acc.tree[0] == pytest.approx((0.6, 0.2, 0.05))
    assert acc.tree[1] == pytest.approx((0.5, 0.1))
    assert acc.p(1) == pytest.approx(0.6)
    assert acc.q(2, 3) == 0.0


# ---------------------------------------------------------------------------------- costs


def test_costs_interpolate_and_extrapolate_linearly() -> None:
    costs = CostTable(
        verify={1: {2: 10.0, 4: 14.0}, 4: {2: 20.0, 4: 30.0}},
        draft_step={1: {1: 0.5, 4: 0.8}, 4: {1: 1.0}},
        overhead={1: 0.1, 4: 0.2},
    )
    assert costs.verify_ms(1, 3) == pytest.approx(12.0)
    assert costs.verify_ms(1, 8) == pytest.approx(22.0)  # slope 2 ms a token
    assert costs.verify_ms(2, 2) == pytest.approx(10.0 + 10.0 / 3)  # between batches 1 and 4
    assert costs.draft_step_ms(1, 2) == pytest.approx(0.6)
    assert costs.decode_ms(1) == pytest.approx(8.0)  # verify extrapolated to 1 token
    assert costs.extend_ms(1, 4) == 0.0
    with pytest.raises(ValueError, match="batch 8 is outside"):
        costs.verify_ms(8, 2)


def test_costs_survive_a_json_round_trip() -> None:
    costs = seed_costs()
    again = CostTable.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert again == costs


def test_predicted_phases_and_throughput() -> None:
    pred = predict(seed_costs(), Acceptance.constant(0.5), SpecSetting(2), batch=1)
    assert pred.phases == pytest.approx(
        {"draft": 0.9, "verify": 18.67, "extend": 0.28, "accept": 0.0}
    )
    assert pred.cycle_ms == pytest.approx(19.85)
    assert pred.tokens_per_s == pytest.approx(1.75 * 1000 / 19.85)
    assert not pred.extrapolated


# ---------------------------------------------------------------------------- the choices


def test_speculation_loses_when_verify_is_steep_and_acceptance_low() -> None:
    costs = CostTable(
        verify={1: {1: 10.0, 2: 16.0, 4: 28.0, 64: 388.0}},
        draft_step={1: {1: 1.0, 8: 3.0}},
    )
    preds = rank_settings(costs, Acceptance.constant(0.2), batch=1)
    assert preds[0].setting.is_baseline
    (rec,) = recommend(preds)
    assert not rec.speculate
    assert rec.source == "predicted"
    assert sglang_flags(rec.setting) == ""
    assert vllm_flags(rec.setting, "/d") == ""


def test_deeper_steps_win_when_verify_is_flat_and_acceptance_high() -> None:
    costs = CostTable(
        verify={1: {n: 10.0 for n in WIDTHS}},
        draft_step={1: {k: 0.05 for k in (1, 2, 4, 8)}},
        extend={1: {n: 0.2 for n in WIDTHS}},
    )
    best = rank_settings(costs, Acceptance.constant(0.95), batch=1)[0]
    assert best.setting == SpecSetting(10)
    assert best.tokens_per_cycle == pytest.approx(leviathan_tokens_per_cycle(0.95, 10))


def test_seed_costs_pick_two_steps_when_acceptance_falls_fast() -> None:
    fast_fall = Acceptance(chain=(0.75, 0.55, 0.3, 0.15, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1))
    preds = rank_settings(seed_costs(), fast_fall, batch=1)
    assert preds[0].setting == SpecSetting(2, 1, 3)
    assert preds[0].tokens_per_s > next(p for p in preds if p.setting.is_baseline).tokens_per_s

    slow_fall = Acceptance(chain=(0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4))
    assert best_speculative(rank_settings(seed_costs(), slow_fall, batch=1)).setting.steps > 2


def test_tree_wins_when_siblings_catch_what_rank0_misses() -> None:
    costs = seed_costs()
    tree = Acceptance(tree=tuple((0.6, 0.25, 0.1) for _ in range(10)))
    best = rank_settings(costs, tree, batch=1)[0]
    assert best.setting.topk > 1


def test_recommend_picks_the_measured_best_and_reports_the_error() -> None:
    acc = Acceptance(chain=(0.8, 0.7, 0.6, 0.5))
    preds = rank_settings(seed_costs(), acc, batch=1, candidates=candidate_grid(4, (1,)))
    assert preds[0].setting == SpecSetting(3)
    slow_verify = {"draft": 1.35, "verify": 21.0, "extend": 0.28}  # the model said 19.77
    tpc3 = preds[0].tokens_per_cycle
    measured = [
        Measurement(SpecSetting.baseline(), 1, 88.0),
        Measurement(SpecSetting(2), 1, 125.0),
        Measurement(SpecSetting(3), 1, tpc3 * 1000 / 22.63, tpc3, slow_verify),
    ]
    (rec,) = recommend(preds, measured)
    assert rec.setting == SpecSetting(2)
    assert rec.source == "measured"
    assert rec.speedup == pytest.approx(125 / 88)
    pred2 = next(p for p in preds if p.setting == SpecSetting(2))
    assert rec.error_pct == pytest.approx(100 * (pred2.tokens_per_s - 125) / 125)
    assert rec.rows[0].setting == SpecSetting(2)
    assert [r.setting.steps for r in rec.rows[:3]] == [2, 3, 0]
    cause = disagreement_cause(preds[0], measured[2])
    assert cause.startswith("verify: predicted 19.77 ms, measured 21.00 ms")
    text = recommendation_text(rec, "/models/drafter")
    assert "--speculative-num-steps 2" in text
    assert '"num_speculative_tokens": 2' in text


def test_idle_rows_point_at_refill_only_where_many_row_slots_idle() -> None:
    """The text names refilled rows where the choice's measured share of row slots decoding is
    under 90 % (static batches of answers of different lengths), and not otherwise."""
    for busy, hint in ((0.76, True), (0.95, False), (None, False)):
        measured = [Measurement(SpecSetting.baseline(), 8, 500.0, busy=busy),
                    Measurement(SpecSetting(2), 8, 900.0, accept_length=2.2, busy=busy)]
        (rec,) = recommend([], measured)
        assert rec.setting == SpecSetting(2) and rec.busy == busy
        text = recommendation_text(rec, "/models/drafter")
        assert ("24% of row slots idle" in text) == hint
        assert ("bench --refill" in text) == ("tune --refill" in text) == hint
        # a tune of refilled rows has no static batch to point away from
        assert "row slots idle" not in recommendation_text(rec, "/m", refilled=True)


def test_recommend_says_no_speculation_when_the_measured_baseline_wins() -> None:
    preds = rank_settings(seed_costs(), Acceptance.constant(0.7), batch=1)
    measured = [
        Measurement(SpecSetting.baseline(), 1, 90.0),
        Measurement(SpecSetting(2), 1, 80.0, accept_length=1.5),
    ]
    (rec,) = recommend(preds, measured)
    assert not rec.speculate
    assert rec.error_pct == pytest.approx(100 * (1000 / 11.3 - 90) / 90)


def test_predicted_phases_carry_the_profilers_names_so_the_cause_is_the_phase_that_moved(
        ) -> None:
    """The bookkeeping phase is "accept" on both sides: a measurement equal to the prediction
    but for a slower verify is blamed on the verify, not on a name only one side has."""
    import dataclasses

    from draftsmith.engine.profiler import PHASES

    costs = dataclasses.replace(seed_costs(), overhead={1: 0.5})
    pred = predict(costs, Acceptance.constant(0.8), SpecSetting(2), batch=1)
    assert set(pred.phases) == set(PHASES) and pred.phases["accept"] == pytest.approx(0.5)
    measured = {**pred.phases, "verify": pred.phases["verify"] + 0.2}
    cycle = math.fsum(measured.values())
    meas = Measurement(SpecSetting(2), 1, 1000 * pred.tokens_per_cycle / cycle,
                       pred.tokens_per_cycle, measured)
    assert disagreement_cause(pred, meas).startswith("verify: predicted 18.67 ms, measured 18.87")


def test_disagreement_from_acceptance_and_unprofiled_time() -> None:
    pred = predict(seed_costs(), Acceptance.constant(0.8), SpecSetting(2), batch=1)
    low_accept = Measurement(SpecSetting(2), 1, 60.0, accept_length=1.2)
    assert disagreement_cause(pred, low_accept).startswith("acceptance: predicted 2.44")
    wall = 1000 * pred.tokens_per_cycle / 100.0  # 24.4 ms, the phases add to 19.85
    slow = Measurement(SpecSetting(2), 1, 100.0, pred.tokens_per_cycle, dict(pred.phases))
    assert wall > pred.cycle_ms
    assert disagreement_cause(pred, slow).startswith("unprofiled: +4.55 ms")


def test_the_draft_phase_is_its_first_step_then_the_rest() -> None:
    """With the engine's own draft phase timed (a first step that reads the root from the
    extend, then full steps), a draft of s steps costs first + (s - 1) x step; without it,
    s x step as before. A JSON round trip keeps the first steps."""
    costs = CostTable(verify={1: {1: 5.0, 16: 9.0}}, draft_step={1: {1: 0.2, 4: 0.3}},
                      draft_first={1: {1: 0.05, 4: 0.2}})
    assert predict(costs, Acceptance.constant(0.5), SpecSetting(5), 1).phases["draft"] == (
        pytest.approx(0.05 + 4 * 0.2))
    tree = predict(costs, Acceptance.constant(0.5), SpecSetting(5, 4, 16), 1)
    assert tree.phases["draft"] == pytest.approx(0.2 + 4 * 0.3)
    assert costs.draft_ms(1, 2, 3) == pytest.approx(0.1 + 2 * (0.2 + 0.1 / 3))  # topk between
    plain = CostTable(verify=costs.verify, draft_step=costs.draft_step)
    assert plain.draft_ms(1, 4, 5) == pytest.approx(1.5)
    assert CostTable.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs


def test_a_trees_extend_is_priced_at_its_accepted_path() -> None:
    """The drafter re-extends over steps + 1 tokens whatever the tree verified (the engine's
    extend width), so a 32-token tree of 3 steps pays a 4-token extend, not a 32-token one."""
    costs = CostTable(verify={1: {1: 5.0, 32: 20.0}}, draft_step={1: {1: 0.3, 4: 0.5}},
                      extend={1: {2: 1.0, 8: 4.0}})
    pred = predict(costs, Acceptance.constant(0.5), SpecSetting(3, 4, 32), 1)
    assert pred.phases["extend"] == pytest.approx(2.0)
    assert SpecSetting(3, 4, 24) in candidate_grid(3, (4,))


def test_tree_acceptance_from_counts_by_depth_and_rank() -> None:
    """q is accepted over reached per rank; a row whose ratios overshoot 1 (a rarely verified
    rank) is scaled back to a distribution; a depth whose rank 0 was never reached ends it;
    chains keep their own figures, trees read the measured ones."""
    acc = Acceptance.from_rank_counts([[10, 10], [8, 4], [0, 3]], [[6, 3], [4, 4], [0, 0]],
                                      chain=(0.6, 0.5))
    assert acc.chain == (0.6, 0.5)
    assert acc.tree[0] == pytest.approx((0.6, 0.3))
    assert acc.tree[1] == pytest.approx((1 / 3, 2 / 3))
    assert len(acc.tree) == 2
    assert acc.p(1) == 0.6 and acc.q(1, 1) == pytest.approx(0.3)
    chain_only = Acceptance(chain=(0.6, 0.5))
    tree = SpecSetting(2, 2, 4)
    assert tokens_per_cycle(acc, tree) > tokens_per_cycle(chain_only, tree)
    with pytest.raises(DraftsmithError, match="depth 1 accepted"):
        Acceptance.from_rank_counts([[2, 2]], [[3, 0]])
    with pytest.raises(DraftsmithError, match="never reached"):
        Acceptance.from_rank_counts([[0, 0]], [[0, 0]])


def test_a_prompts_own_tree_starts_from_the_pooled_one() -> None:
    """prompt_tree: a prompt's q is its own counts plus TREE_PRIOR row-cycles at the pooled q,
    so a prompt never counted takes the pooled tree, a rank it never reached the pooled q (not
    0), and many counts their own ratio; chains stay the prompt's own."""
    pooled = Acceptance(chain=(0.7,), tree=((0.5, 0.2), (0.4, 0.1)))
    none = [[0, 0], [0, 0]]
    assert prompt_tree(pooled, none, none, (0.3,)) == Acceptance(chain=(0.3,), tree=pooled.tree)
    own = prompt_tree(pooled, [[4, 0], [0, 0]], [[4, 0], [0, 0]], (0.9,))
    m = TREE_PRIOR
    assert own.tree[0][0] == pytest.approx((4 + m * 0.5) / (4 + m))
    assert own.tree[0][1] == pytest.approx(0.2) and own.tree[1] == pytest.approx((0.4, 0.1))
    sure = prompt_tree(pooled, [[10_000, 10_000], [10_000, 5]], [[1000, 9000], [0, 0]], ())
    assert sure.tree[0] == pytest.approx((0.1, 0.9), abs=1e-3)
    assert prompt_tree(Acceptance(chain=(0.7,)), none, none, (0.2,)) == Acceptance(chain=(0.2,))


def test_siblings_narrow_the_spread_of_a_static_batch() -> None:
    """A prompt whose chain misses often but whose second-ranked drafts catch the misses, and
    one that rank 0 serves: their chains part (idle rows), their trees less (tune_default.md,
    CPU run of 2026-12-05: static trees were priced 0.03-0.07 below their measured busy share
    while each prompt's tree was taken from its chain)."""
    slow = Acceptance(chain=(0.4,) * 3, tree=((0.4, 0.5),) * 3)
    sure = Acceptance(chain=(0.9,) * 3, tree=((0.9, 0.05),) * 3)
    mix, chain_only = PromptMix((slow, sure)), PromptMix(tuple(Acceptance(chain=a.chain)
                                                               for a in (slow, sure)))
    tree = SpecSetting(3, 2, 7)
    assert mix.busy(tree, 2) > mix.busy(SpecSetting(3), 2) == chain_only.busy(tree, 2)


def test_a_static_batch_runs_at_its_slowest_rows_pace() -> None:
    """Two prompts that accept 3.0 and 1.5 tokens a cycle: alone, 2N tokens take N/3 + N/1.5
    cycles (a slot's tokens are their harmonic mean, 2); in one batch of two, N/1.5 cycles
    carry 2N tokens, 1.5 a slot, so 75 % of the slots decode."""
    fast, slow = Acceptance(chain=(1.0, 1.0)), Acceptance(chain=(0.5, 0.0))
    chain2 = SpecSetting(2)
    assert (tokens_per_cycle(fast, chain2), tokens_per_cycle(slow, chain2)) == (3.0, 1.5)
    mix = PromptMix((fast, slow))
    assert mix.slot_tokens(chain2, 1) == pytest.approx(2.0)
    assert mix.slot_tokens(chain2, 2) == pytest.approx(1.5)
    assert mix.busy(chain2, 2) == pytest.approx(0.75)
    assert mix.busy(chain2, 1) == 1.0 and mix.busy(SpecSetting.baseline(), 2) == 1.0
    assert PromptMix((fast, fast)).busy(chain2, 2) == 1.0  # alike rows end together
    # three prompts in batches of 2: [fast, slow] then [fast, fast] (filled from the first)
    assert batch_groups(3, 2) == [[0, 1], [2, 0]]
    three = PromptMix((fast, slow, fast))
    assert three.slot_tokens(chain2, 2) == pytest.approx(2 / (1 / 1.5 + 1 / 3.0))
    pooled = Acceptance(chain=(0.8, 0.5))
    costs = CostTable(verify={b: {1: 5.0 * b, 4: 6.0 * b} for b in (1, 2)},
                      draft_step={b: {1: 0.3 * b} for b in (1, 2)})
    alone, batched = (predict(costs, pooled, chain2, b, mix) for b in (1, 2))
    assert batched.busy == pytest.approx(0.75) and alone.busy == 1.0
    assert batched.tokens_per_s == pytest.approx(
        2 * batched.tokens_per_cycle * 0.75 * 1000 / batched.cycle_ms)
    with pytest.raises(DraftsmithError, match="no prompt"):
        PromptMix(())
    with pytest.raises(DraftsmithError, match="1 prompts' tree counts for 2"):
        PromptMix((fast, slow), (([[1]], [[1]]),))


def test_disagreement_from_idle_rows_and_the_engines_own_cycle() -> None:
    """Rows idling in their batch are named as such, not as time no phase accounts for; the
    engine's cycle time, where given, is the wall time the phases are held against."""
    pred = predict(seed_costs(), Acceptance.constant(0.8), SpecSetting(2), batch=1)
    tpc, cycle = pred.tokens_per_cycle, pred.cycle_ms
    idle = Measurement(SpecSetting(2), 1, 0.6 * tpc * 1000 / cycle, tpc, dict(pred.phases),
                       cycle, 0.6)
    assert disagreement_cause(pred, idle).startswith(
        "idle rows: predicted 100% of row slots decoding, measured 60%")
    slow = Measurement(SpecSetting(2), 1, tpc * 1000 / (cycle + 3), tpc, dict(pred.phases),
                       cycle + 3.0, 1.0)
    assert disagreement_cause(pred, slow).startswith("unprofiled: +3.00 ms")


def test_recommend_one_per_batch() -> None:
    costs = CostTable(
        verify={1: {1: 5.0, 4: 6.0, 64: 12.0}, 8: {1: 6.0, 4: 12.0, 64: 100.0}},
        draft_step={1: {1: 0.3, 8: 0.5}, 8: {1: 0.6, 8: 2.0}},
    )
    acc = Acceptance.constant(0.6)
    preds = [p for b in (1, 8) for p in rank_settings(costs, acc, b)]
    recs = recommend(preds)
    assert [r.batch for r in recs] == [1, 8]
    assert recs[0].speculate
    assert 0 < recs[1].setting.steps < recs[0].setting.steps  # bigger batch: verify costs more


def test_steps_series_best_per_step_with_baseline_at_zero() -> None:
    preds = rank_settings(seed_costs(), Acceptance.constant(0.6), batch=1)
    series = steps_series(preds, [Measurement(SpecSetting(2), 1, 90.0)], batch=1)
    assert [s for s, _ in series["predicted"]] == list(range(11))
    assert series["measured"] == [(2, 90.0)]


# ------------------------------------------------------------------ candidates and sweeps


def test_candidate_grid_is_valid_and_bounded() -> None:
    grid = candidate_grid()
    assert len(grid) == len(set(grid))
    assert SpecSetting(1) in grid and SpecSetting(10) in grid
    assert SpecSetting(1, 2, 3) in grid  # 4 tokens do not fit: capped at the capacity
    assert all(s.num_draft_tokens <= tree_capacity(s.steps, s.topk) for s in grid)
    assert {s.topk for s in grid} == {1, 2, 4, 8}
    assert max(s.num_draft_tokens for s in grid) == 64


def test_sweep_plan_has_baseline_top_and_neighbours() -> None:
    preds = rank_settings(seed_costs(), Acceptance.constant(0.6), batch=1)
    plan = sweep_plan(preds, top=1)
    top = best_speculative(preds).setting
    assert plan[:2] == [SpecSetting.baseline(), top]
    assert SpecSetting(top.steps + 1) in plan and SpecSetting(top.steps - 1) in plan
    assert any(s.topk == 2 and s.steps == top.steps for s in plan)


def test_a_chains_tree_neighbour_is_a_tree_not_the_chain_again() -> None:
    """Topk 2 next to the 1-step chain: 2 draft tokens (root + one node) would be that chain,
    measured twice and predicted never; the neighbour is the 1-step tree of both children."""
    from draftsmith.tune.cost_model import _neighbours

    near = _neighbours(SpecSetting(1))
    assert SpecSetting(1, 2, 2) not in near and SpecSetting(1, 2, 3) in near
    assert SpecSetting(1, 2, 3) in candidate_grid(3)  # so it is predicted too
    assert SpecSetting(3, 2, 4) in _neighbours(SpecSetting(3))  # deeper chains: as before


# -------------------------------------------------------------------------- flags, errors


def test_flags_exact() -> None:
    chain = SpecSetting(3)
    assert sglang_flags(chain) == (
        "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4"
    )
    config, note = vllm_speculative_config(chain, "/models/drafter")
    assert config == (
        '{"method": "eagle3", "model": "/models/drafter", "num_speculative_tokens": 3}'
    )
    assert note is None
    assert vllm_flags(chain, "/models/drafter") == f"--speculative-config '{config}'"
    assert sglang_flags(SpecSetting(5, 8, 32), "/d").endswith(
        "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32 "
        "--speculative-draft-model-path /d"
    )


def test_vllm_gets_the_chain_equivalent_of_a_tree_and_says_so() -> None:
    config, note = vllm_speculative_config(SpecSetting(4, 4, 16), "/d")
    assert json.loads(config) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}
    assert note is not None and "chain of 4" in note


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3, 1, 5), r"num_draft_tokens must be steps \+ 1 = 4"),
        ((2, 2, 100), r"num_draft_tokens must be 2 to 7"),
        ((2, 4, 0), r"must be 2 to"),
        ((-1, 1, 0), r"steps must be 0"),
        ((2, 0, 3), r"topk must be at least 1"),
        ((0, 2, 1), r"no speculation"),
    ],
)
def test_invalid_settings_raise(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpecSetting(*args)


def test_settings_derive_chain_tokens_and_print() -> None:
    assert SpecSetting(2).num_draft_tokens == 3
    assert str(SpecSetting(2)) == "steps 2, topk 1, 3 draft tokens"
    assert str(SpecSetting.baseline()) == "no speculation"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Acceptance(chain=(1.2,)), r"chain position 1 is 1.2"),
        (lambda: Acceptance(tree=((0.7, 0.4),)), r"tree depth 1"),
        (lambda: Acceptance(), r"neither"),
        (lambda: Acceptance.from_chain_counts([10, 5], [11, 2]), r"accepted 11 of reached 10"),
        (lambda: Acceptance.from_chain_counts([0], [0]), r"never reached"),
        (lambda: CostTable(verify={}, draft_step={1: {1: 1.0}}), r"at least one batch"),
        (lambda: CostTable(verify={1: {2: -1.0}}, draft_step={1: {1: 1.0}}), r"verify: batch 1"),
    ],
)
def test_bad_tables_raise_clear_errors(make, message: str) -> None:
    with pytest.raises(DraftsmithError, match=message):
        make()


def test_extrapolation_is_flagged() -> None:
    acc = Acceptance(chain=(0.8, 0.6))
    assert predict(seed_costs(), acc, SpecSetting(5), 1).extrapolated
    costs = CostTable(verify={1: {1: 5.0, 4: 6.0}}, draft_step={1: {1: 0.3}})
    assert predict(costs, Acceptance.constant(0.5), SpecSetting(6), 1).extrapolated
    assert not predict(costs, Acceptance.constant(0.5), SpecSetting(3), 1).extrapolated
    assert math.isfinite(predict(costs, acc, SpecSetting.baseline(), 1).tokens_per_s)


def test_tuned_flags_name_engine_exports_and_a_flag_tune_has() -> None:
    """tune printed SGLang and vLLM flags naming the draftsmith folder it tuned, which neither
    engine loads (no config.json), and its vLLM note said `tune with --topk 1`, a flag tune
    lacks (it has --max-topk)."""
    from draftsmith.tune.flags import export_paths

    measured = [Measurement(SpecSetting.baseline(), 1, 90.0),
                Measurement(SpecSetting(2, 4, 6), 1, 150.0, accept_length=2.5)]
    (rec,) = recommend([], measured)
    text = recommendation_text(rec, "runs/d", exports=export_paths("runs/d"))
    assert "--speculative-draft-model-path runs/d-sglang" in text
    assert '"model": "runs/d-speculators"' in text
    assert ("export: draftsmith export runs/d --format sglang --out runs/d-sglang; draftsmith "
            "export runs/d --format speculators --speculative-tokens 2 --out runs/d-speculators"
            ) in text
    assert "--max-topk 1" in text and "--topk 1" not in text.replace("--max-topk 1", "")


def test_steps_series_of_trees_is_the_best_tree_per_depth() -> None:
    """The tune PNG's tree line: per depth, the best over every topk > 1 and budget, measured
    and predicted alike; chains stay out of it (a winning tree was missing from the plot)."""
    meas = [Measurement(SpecSetting(3, 4, 8), 1, 120.0),
            Measurement(SpecSetting(3, 2, 6), 1, 130.0), Measurement(SpecSetting(3), 1, 150.0),
            Measurement(SpecSetting(5, 4, 16), 1, 110.0),
            Measurement(SpecSetting(3, 4, 8), 8, 999.0)]
    series = steps_series([], meas, batch=1, topk=None)
    assert series["measured"] == [(3, 130.0), (5, 110.0)]
    assert steps_series([], meas, batch=1)["measured"] == [(3, 150.0)]


def test_predictions_past_the_measured_depth_are_marked_in_the_text_and_rows() -> None:
    """A setting deeper than the measured acceptance is predicted from the last measured value
    reused; the text and tune.json's rows say so (the flag was computed and never shown)."""
    acc = Acceptance(chain=(0.7, 0.6))  # measured to depth 2
    preds = [p for p in rank_settings(seed_costs(), acc, batch=1) if p.setting.topk == 1]
    (rec,) = recommend(preds)
    deep = {r.setting.steps: r.extrapolated for r in rec.rows}
    assert deep[2] is False and deep[5] is True
    text = recommendation_text(rec, "/m", top=len(rec.rows))
    assert "* predicted past what was measured" in text
    rows = {line.split(",")[0].strip(): line for line in text.splitlines()[1:]}
    assert "*" not in rows["steps 2"]
    assert rows["steps 5"].split("measured")[0].rstrip().endswith("*")
