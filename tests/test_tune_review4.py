"""`draftsmith tune`, fourth review: refilled rows priced with a spread of cycle counts, a
static batch's long-answer busy share as its sweep weighs rows, a stopped tune resumed from
tune.partial.json, and costs timed within a target's max_position_embeddings."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from test_tune_cli import _tiny_pair

from draftsmith.errors import DraftsmithError
from draftsmith.tune.cost_model import (
    Acceptance,
    CostTable,
    Measurement,
    PromptMix,
    SpecSetting,
    cycle_tail,
    predict,
    predict_phases,
)
from draftsmith.tune.refill_model import Refill, refill_order, spec_runs, spec_schedule

# ---- refilled rows end at scattered cycles --------------------------------------------------

COSTS = CostTable(verify={4: {1: 10.0, 4: 12.0}}, draft_step={4: {1: 2.0}}, decode={4: 9.0},
                  refill={1: 5.0, 2: 6.0, 4: 8.0}, spec_refill={1: 6.0, 2: 7.0, 4: 9.0})
MIX = PromptMix((Acceptance(chain=(0.7, 0.6, 0.5)), Acceptance(chain=(0.5, 0.4, 0.3)),
                 Acceptance(chain=(0.8, 0.7, 0.6))))


def _simulated_tps(plan: Refill, setting: SpecSetting, batch: int, runs: int = 1500) -> float:
    """Tokens/s of a refilled run drawn token by token: each prompt's cycles drawn cycle by
    cycle (greedy: a prompt decodes alike each time it is taken), the engine's schedule
    (`spec_schedule`) on them, its cycles at the predicted cycle plus its prompt passes."""
    rng = np.random.default_rng(1)
    order = refill_order(len(MIX.prompts), batch, plan.waves)
    pmfs = [-np.diff(np.append(cycle_tail(a, setting), 0.0)) for a in MIX.prompts]
    cycle, tokens, time = math.fsum(predict_phases(COSTS, setting, batch).values()), 0, 0.0
    for _ in range(runs):
        own = []
        for pmf in pmfs:
            made = np.cumsum(rng.choice(np.arange(1, len(pmf) + 1), p=pmf, size=plan.new_tokens))
            own.append(int((made < plan.new_tokens - 1).sum()) + 1)
        s = spec_schedule([own[i] for i in order], batch, plan.every[batch])
        time += cycle * s.cycles + sum(COSTS.refill_ms(k, True) for k in s.fills)
        tokens += len(order) * plan.new_tokens
    return tokens * 1000.0 / time


@pytest.mark.parametrize("waves", [2, 4])
def test_refilled_rows_are_priced_at_their_scattered_ends(waves):
    """Rows of a refilled batch end at scattered cycles and the run waits for its last: the
    model gave each prompt one fixed cycle count, 2.8-3.9 % off a token-level simulation (at
    24 new tokens, batch 4); now within 1.2 %."""
    plan, chain = Refill(24, {4: 2}, {4: 4}, waves=waves), SpecSetting(3)
    got = predict(COSTS, MIX.prompts[0], chain, 4, MIX, plan).tokens_per_s
    want = _simulated_tps(plan, chain, 4)
    assert got == pytest.approx(want, rel=0.012)


def test_many_draws_replay_each_as_the_engines_schedule():
    """The side-by-side replay of many draws (reads that change nothing skipped) is each draw's
    own schedule, refills in order."""
    rng = random.Random(3)
    for _ in range(60):
        count, rows, every = rng.randint(1, 14), rng.randint(1, 6), rng.randint(1, 4)
        need = np.array([[rng.randint(0, 9) for _ in range(count)] for _ in range(5)])
        runs = spec_runs(need, rows, every)
        for d in range(5):
            alone = spec_runs(need[d : d + 1], rows, every)
            assert runs.cycles[d] == alone.cycles[0] and runs.busy[d] == alone.busy[0]
            assert [f[d] for f in runs.fills if f[d]] == [f[0] for f in alone.fills if f[0]]


def test_sure_prompts_keep_one_cycle_count():
    """Prompts that always accept have no spread: the replay of their fixed counts."""
    sure = PromptMix((Acceptance.constant(1.0, 3),) * 2)
    plan = Refill(13, {4: 1}, {4: 4}, waves=2)
    p = predict(COSTS, sure.prompts[0], SpecSetting(3), 4, sure, plan)
    s = spec_schedule([3] * 8, 4, 1)
    assert p.busy == pytest.approx(s.busy / (s.cycles * 4)) == plan.busy(
        sure.prompts[0], SpecSetting(3), 4, sure)
    assert p.phases["refill"] == pytest.approx(sum(COSTS.refill_ms(k, True)
                                                   for k in s.fills[1:]) / s.cycles)


# ---- a static batch's busy share without a token count ---------------------------------------


def test_busy_without_a_token_count_weighs_rows_as_the_sweeps_batches_hold_them():
    """Three prompts in batches of two: [fast, slow], [fast, fast]. Half the slots of the
    first batch idle, so 3 of 4 row slots decode at any length (`fixed_length`); without a
    token count the share was 0.83, the prompts weighed once each."""
    fast, slow = Acceptance(chain=(1.0, 1.0)), Acceptance(chain=(0.0, 0.0))
    mix, chain = PromptMix((fast, slow, fast)), SpecSetting(2)
    assert mix.busy(chain, 2) == pytest.approx(0.75)
    assert mix.fixed_length(chain, 2, 3001)[0] == pytest.approx(0.75)
    assert mix.busy(chain, 1) == mix.busy(SpecSetting.baseline(), 2) == 1.0


# ---- a stopped tune resumes -----------------------------------------------------------------


def _fake_measures(monkeypatch, calls: list, fail: str | None = None) -> None:
    """Measurements that give the same figures every run, each call noted in `calls`; `fail`
    ("tree", "costs", or "sweep": its second setting) raises there, as a failure would."""
    from draftsmith.tune import measure

    def stop(stage: str) -> None:
        calls.append(stage)
        if stage == fail and (stage != "sweep" or calls.count("sweep") == 2):
            raise DraftsmithError(f"out of memory in {stage}")

    def chain(eng, ids, steps, new, eos):
        stop("chain")
        own = tuple(Acceptance(chain=(0.5 + 0.1 * i,) * steps) for i in range(len(ids)))
        return Acceptance(chain=(0.6,) * steps), PromptMix(own)

    def tree(eng, ids, steps, topk, new, eos, acc, mix, tokens):
        stop("tree")
        q = ((0.5, 0.2),) * steps
        counts = tuple(([[3, 2]] * steps, [[1, 1]] * steps) for _ in ids)
        own = tuple(Acceptance(chain=a.chain, tree=q) for a in mix.prompts)
        return Acceptance(chain=acc.chain, tree=q), PromptMix(own, counts)

    def costs(eng, batches, ids, topk, steps, draft, most=None):
        stop("costs")
        return CostTable(verify={b: {1: 1.0 * b, 8: 1.5 * b} for b in batches},
                         draft_step={b: {1: 0.2, 2: 0.3} for b in batches},
                         decode={b: 0.9 * b for b in batches})

    def run(eng, s, ids, b, new, eos, refill=0):
        stop("sweep")
        return Measurement(s, b, 100.0 + 10 * s.steps + s.topk + b, 1.0 + 0.3 * s.steps,
                           {"verify": 0.5, "draft": 0.1 * s.steps}, 2.0, 0.9)

    for name, fn in (("chain_acceptance", chain), ("tree_acceptance", tree),
                     ("cost_table", costs), ("run_setting", run)):
        monkeypatch.setattr(measure, name, fn)


def _tune(tmp_path, folder, prompts, out, new: int = 4):
    from draftsmith.tune.cli import run_tune

    return run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, new, 1, "cpu",
                    torch.float32, False, out, max_topk=2, max_draft=5)


def test_a_stopped_tune_resumes_to_the_report_an_unstopped_one_writes(tmp_path, monkeypatch):
    """Stopped in its tree run, then in its sweep, then let finish: the report equals one run
    without a stop, and nothing kept was measured again (tune.partial.json was kept and never
    read)."""
    from draftsmith.tune.cli import PARTIAL

    folder, prompts = _tiny_pair(tmp_path)
    calls: list = []
    _fake_measures(monkeypatch, calls)
    _tune(tmp_path, folder, prompts, tmp_path / "whole")
    whole = json.loads((tmp_path / "whole" / "tune.json").read_text())
    out, sweeps = tmp_path / "stopped", calls.count("sweep")
    for fail, want in (("tree", ["chain", "tree"]), ("sweep", ["tree", "costs", "sweep",
                                                               "sweep"])):
        calls.clear()
        _fake_measures(monkeypatch, calls, fail)
        with pytest.raises(DraftsmithError, match="resumes from it"):
            _tune(tmp_path, folder, prompts, out)
        assert calls == want and (out / PARTIAL).is_file()
    calls.clear()
    _fake_measures(monkeypatch, calls)
    _tune(tmp_path, folder, prompts, out)
    assert calls == ["sweep"] * (sweeps - 1)  # the one setting measured before the stop kept
    assert json.loads((out / "tune.json").read_text()) == whole
    assert not (out / PARTIAL).exists()


def test_another_tunes_kept_figures_are_refused_and_kept(tmp_path, monkeypatch):
    from draftsmith.tune import cli

    folder, prompts = _tiny_pair(tmp_path)
    calls: list = []
    _fake_measures(monkeypatch, calls, "sweep")
    out = tmp_path / "tune"
    with pytest.raises(DraftsmithError):
        _tune(tmp_path, folder, prompts, out)
    kept = (out / cli.PARTIAL).read_text()
    monkeypatch.setattr("draftsmith.targets.Target.build",
                        lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(DraftsmithError, match="new_tokens 4 there, 5 here") as err:
        _tune(tmp_path, folder, prompts, out, new=5)
    assert str(out / cli.PARTIAL) in str(err.value) and "delete the file" in str(err.value)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "d" / "model.safetensors"))  # retrained
    with pytest.raises(DraftsmithError, match="the drafter's files"):
        _tune(tmp_path, folder, prompts, out)
    assert (out / cli.PARTIAL).read_text() == kept


# ---- costs timed within the target's positions ----------------------------------------------


def test_costs_are_timed_within_a_short_targets_positions(tmp_path, monkeypatch):
    """A target of 40 positions: the costs timed verifies from position 64 and decoded 64
    tokens past a 26-token prompt, forwards it never runs (position 90), without a word; a
    target too short for them is refused before loading its weights."""
    from conftest import write_tiny_folder

    from draftsmith.models import llama
    from draftsmith.tune import measure
    from draftsmith.tune.cli import run_tune

    _, prompts = _tiny_pair(tmp_path)
    seen, timing = [0], [False]
    rope, cost_table = llama.Transformer.rope, measure.cost_table

    def noted(self, positions, dtype):
        if timing[0]:
            seen[0] = max(seen[0], int(positions.max()))
        return rope(self, positions, dtype)

    def timed(*a, **k):
        timing[0] = True
        try:
            return cost_table(*a, **k)
        finally:
            timing[0] = False

    monkeypatch.setattr(llama.Transformer, "rope", noted)
    monkeypatch.setattr(measure, "cost_table", timed)
    for most in (40, 30):
        folder = write_tiny_folder(tmp_path / f"t{most}", "llama", max_position_embeddings=most)
        if most == 30:
            monkeypatch.setattr("draftsmith.targets.Target.build",
                                lambda *a, **k: pytest.fail("weights loaded"))
            with pytest.raises(DraftsmithError, match=r"max_position_embeddings 30 \(or sliding "
                                                      r"window, where smaller\); use shorter"):
                run_tune(tmp_path / "d", str(folder), prompts, [1], 2, 4, 1, "cpu",
                         torch.float32, False, tmp_path / "o30", max_topk=1)
            continue
        run_tune(tmp_path / "d", str(folder), prompts, [1], 2, 4, 1, "cpu", torch.float32,
                 False, tmp_path / "o40", max_topk=2, max_draft=5)
        assert 30 < seen[0] < most


def test_cost_room_moves_timings_back_and_refuses_what_cannot_fit():
    assert measure_room(None, 26, 5) == (64, 64)
    assert measure_room(4096, 26, 33) == (64, 64)
    assert measure_room(40, 26, 5) == (35, 10)
    with pytest.raises(DraftsmithError, match="verifies of up to 33 tokens"):
        measure_room(32, 2, 33)


def measure_room(most, longest: int, widest: int) -> tuple[int, int]:
    from draftsmith.tune.measure import cost_room

    return cost_room(most, [[1] * longest], widest)
