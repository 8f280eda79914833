"""`draftsmith tune`, eleventh review: `--refill` ranking made fast (each draw replayed from its
own refill to its next, not every read any draw makes; the same predictions bit for bit as
the plain replay), and an NCCL sweep whose settings were all skipped says so, and why."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from test_tune_review10 import fixture

from draftsmith.tune import nccl
from draftsmith.tune import refill_model as rm
from draftsmith.tune.cost_model import SpecSetting, rank_settings, tune_grid
from draftsmith.tune.refill_model import Refill, Runs

# ---- the replay as it was: the reference the fast one must equal bit for bit ---------------


def plain_next_read(t, end, held, since, every, queued, active):
    ahead = np.where(held & (end >= t), end + 1, np.iinfo(np.int64).max).min(axis=1)
    pending = queued & (held & (end <= t)).any(axis=1)
    spaced = np.where(pending, t + np.maximum(every - since, 1), ahead)
    return int(np.minimum(ahead, spaced)[active].min())


def plain_spec_runs(need, rows, every):
    draws, count = need.shape
    rows = min(rows, count)
    end, held = need[:, :rows].copy(), np.ones((draws, rows), dtype=bool)
    ptr, since = np.full(draws, rows), np.zeros(draws, dtype=np.int64)
    cycles, active = np.zeros(draws, dtype=np.int64), np.ones(draws, dtype=bool)
    fills, t = [np.full(draws, rows)], 0
    who = np.broadcast_to(np.arange(draws)[:, None], end.shape)
    while active.any():
        nxt = plain_next_read(t, end, held, since, every, ptr < count, active)
        t, since = nxt, since + (nxt - t)
        ended = held & (end <= t - 1)
        all_done = ended.sum(axis=1) == held.sum(axis=1)
        refill = active & (ptr < count) & (since >= every) & ended.any(axis=1)
        if refill.any():
            freed = ended & refill[:, None]
            idx = ptr[:, None] + np.cumsum(freed, axis=1) - 1
            take = freed & (idx < count)
            held &= ~freed | take
            end[take] = t + need[who[take], idx[take]]
            took = take.sum(axis=1)
            fills.append(took)
            ptr, since = ptr + took, np.where(refill, 0, since)
            all_done &= ~refill
        stop = active & all_done & (ptr >= count)
        cycles[stop], active = t, active & ~stop
    return Runs(cycles, need.sum(axis=1), fills)


@pytest.fixture
def plain(monkeypatch):
    monkeypatch.setattr(rm, "spec_runs", plain_spec_runs)
    monkeypatch.setattr(rm, "_read_means", lambda ms, fills: [float(ms[f].mean()) for f in fills])


def _refill_ranking(new: int) -> list:
    costs, acc, mix, batches = fixture(8)
    costs = dataclasses.replace(costs, refill={1: 3.0, 2: 3.5, 4: 4.0, 16: 7.0},
                                spec_refill={1: 3.2, 2: 3.9, 4: 4.1, 16: 7.3})
    plan = Refill(new, {1: 4, 4: 4, 16: 2}, {1: 4, 4: 4, 16: 3})
    return [(b, p) for b in batches
            for p in rank_settings(costs, acc, b, tune_grid(5, 4, 8), mix, plan, None)]


@pytest.mark.parametrize("new", [24, 96])
def test_refill_ranking_is_the_plain_replay_bit_for_bit(new, request):
    fast = _refill_ranking(new)
    request.getfixturevalue("plain")
    assert _refill_ranking(new) == fast  # every field: phases, busy, tokens/s, exactly


def test_many_draws_replay_as_the_plain_replay():
    rng = random.Random(11)
    for _ in range(400):
        count, rows, every, draws = (rng.randint(1, 16), rng.randint(1, 7), rng.randint(1, 9),
                                     rng.randint(1, 6))
        hi = rng.choice([0, 1, 4, 30])
        need = np.array([[rng.randint(0, hi) for _ in range(count)] for _ in range(draws)])
        got, want = rm.spec_runs(need, rows, every), plain_spec_runs(need, rows, every)
        assert np.array_equal(got.cycles, want.cycles) and np.array_equal(got.busy, want.busy)
        assert np.array_equal(got.fills, np.array(want.fills))


@pytest.mark.parametrize("rows", [1, 2])
def test_a_long_refilled_run_replays_as_the_plain_replay(rows):
    """64 draws of 150 prompts (the plain replay stepped through nearly every cycle of the run:
    12 s of `tune --refill`'s ranking at batch 1; a refill a step now): the same fills."""
    need = np.random.default_rng(5).integers(5, 60, size=(64, 150))
    want = plain_spec_runs(need, rows, 4)
    got = rm.spec_runs(need, rows, 4)
    assert np.array_equal(got.fills, np.array(want.fills))
    assert np.array_equal(got.cycles, want.cycles) and np.array_equal(got.busy, want.busy)


def test_a_baseline_run_keeps_its_fills():
    costs, acc, mix, _ = fixture(3)
    plan = Refill(16, {4: 2}, {4: 4})
    runs = plan.runs(plan.cycle_draws(acc, SpecSetting.baseline(), 4, mix),
                     SpecSetting.baseline(), 4)
    # 16 prompts (4 a row) of 15 steps each, read every 4 steps: 4 rows at a time
    assert runs.fills.tolist() == [[4]] * 4
    assert runs.fills[:, 0].tolist() == list(rm.baseline_schedule([15] * 16, 4, 4).fills)
    assert rm.spec_schedule([3, 1, 5, 2], rows=2, every=1).fills == (2, 1, 1)


# ---- an NCCL sweep with every setting skipped -----------------------------------------------


def _ok(name: str) -> dict:
    return {"setting": name, "status": "ok", "env": {"NCCL_NVLS_ENABLE": "0"},
            "verify": [{"batch": 1, "tokens": 4, "ms": 1.0, "spread_pct": 0.5}]}


SKIPPED = {"setting": "NCCL_ALGO=Tree", "status": "skipped", "error": "time budget spent"}
FAILED = {"setting": "NCCL_PROTO=LL", "status": "failed", "error": "rank 1 died"}


def test_a_sweep_whose_settings_were_all_skipped_says_so_not_failed(capsys):
    rec = nccl.recommend([SKIPPED, {**SKIPPED, "setting": "NCCL_ALGO=Ring"}])
    assert "failed" not in rec["note"]
    assert rec["note"] == "no setting was timed: 2 of 2 settings skipped (time budget spent)"
    report = {"tp": 2, "target_label": "random-8b", "device": "cuda", "backend": "nccl",
              "shapes": [[1, 4]], "results": [SKIPPED], "recommendation": rec}
    assert "Note: no setting was timed: 2 of 2 settings skipped" in nccl.markdown(report)


def test_a_sweep_of_failures_and_skips_counts_each():
    assert nccl.recommend([FAILED, SKIPPED])["note"] == (
        "no setting was timed: 1 failed, 1 of 2 settings skipped (time budget spent)")
    assert nccl.recommend([FAILED, FAILED])["note"] == "every setting failed"
    assert nccl.recommend([])["note"] == "no setting was swept"


def test_a_recommendation_names_the_settings_it_did_not_compare():
    rec = nccl.recommend([_ok("defaults"), _ok("NCCL_PROTO=Simple"), SKIPPED])
    assert rec["overall"]["choice"] == "defaults"
    assert rec["note"] == "1 of 3 settings skipped (time budget spent), not compared"
    assert "note" not in nccl.recommend([_ok("defaults"), FAILED])



def test_defaults_skipped_or_never_swept_are_not_said_to_have_failed():
    """A resumed sweep past its deadline: the settings timed before the stop, the defaults
    (which failed then, so run again) skipped; the note said "the defaults failed"."""
    skipped = {**SKIPPED, "setting": "defaults"}
    rec = nccl.recommend([skipped, _ok("NCCL_PROTO=LL")])
    assert rec["note"].startswith("the defaults were skipped: the fastest setting is shown")
    assert "not compared" in rec["note"] and "failed" not in rec["note"]
    assert nccl.recommend([_ok("LL")])["note"].startswith("the defaults were not swept")
    assert nccl.recommend([{**FAILED, "setting": "defaults"}, _ok("LL")])["note"].startswith(
        "the defaults failed")

def test_a_sweep_run_out_of_time_reports_it_whole(tmp_path):
    """A sweep past its deadline before its first setting: no spawned rank, and its report
    says the settings were skipped (not failed) and that no backend ran."""
    rep = nccl.run_nccl_sweep(2, "tiny", nccl.grid("quick"), [(1, 4)], "cpu", "fp32", 2,
                              out=tmp_path, log=lambda _: None, deadline=0.0)
    assert rep["backend"] == "none (no setting ran)"
    assert rep["recommendation"]["note"] == (
        "no setting was timed: 6 of 6 settings skipped (time budget spent)")
    md = (tmp_path / "nccl.md").read_text()
    assert "backend none (no setting ran)" in md and "every setting failed" not in md


# ---- a sweep run's warm-up stays within its own new tokens -----------------------------------


def _short_target(src, dst, positions: int):
    """The tiny target's folder with `positions` max_position_embeddings."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
    return dst


def test_a_sweep_run_warms_up_within_the_targets_positions(tmp_path, tiny_llama_dir):
    """A target of 12 positions, 6-token prompts, 4 new tokens: the acceptance and the costs fit
    (`cost_room`), but every sweep run warmed up on 8 new tokens, 14 positions, refused
    halfway through the tune (the cost probes' runs too)."""
    import torch

    from draftsmith.engine.drafter_runtime import DrafterRuntime
    from draftsmith.engine.runtime import Runtime
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter
    from draftsmith.targets import load_target
    from draftsmith.tune import measure

    target = load_target(_short_target(tiny_llama_dir, tmp_path / "short", 12))
    model = target.build(torch.float32, "cpu")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.cfg, 64, [0, 2, 4])).eval()
    drafter.set_vocab(torch.zeros(64, dtype=torch.long), torch.arange(128) < 64)
    eng = measure.Engine(Runtime(model, 2, 64), DrafterRuntime(drafter, 2, 256, False), drafter)
    prompts = [[1, 2, 3, 4, 5, 6], [4, 5]]
    assert measure.cost_room(12, prompts, 3) == (9, 2)
    for s in (SpecSetting.baseline(), SpecSetting(2, 2, 4)):
        assert measure.run_setting(eng, s, prompts, 2, 4, []).tokens_per_s > 0
    assert measure.probe_phases(eng, SpecSetting(4), prompts, 2, 2)


def test_a_win_of_no_speculation_still_says_how_to_serve():
    """tune printed no SGLang or vLLM line at all where no speculation was fastest."""
    from draftsmith.tune.cost_model import Measurement, recommend
    from draftsmith.tune.flags import recommendation_text

    measured = [Measurement(SpecSetting.baseline(), 1, 900.0),
                Measurement(SpecSetting(2), 1, 500.0, accept_length=1.1)]
    (rec,) = recommend([], measured)
    assert rec.setting.is_baseline
    text = recommendation_text(rec, "/models/drafter")
    assert "SGLang: no --speculative-* flags" in text
    assert "vLLM:   serve without --speculative-config" in text
    assert "--tp-size 2" in recommendation_text(rec, "/m", tp=2)
