"""Tune, eighteenth review: the cost model's tokens per cycle checked against a brute-force
draft tree; the report now says where the model's pick and the sweep's best part (the regret
in tok/s and %); a --max-topk past the drafter's draft vocabulary refused before loading."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import write_tiny_folder
from test_tune_cli import _tiny_pair, invoke_tune

from draftsmith.tune.cost_model import (
    Acceptance,
    Measurement,
    Prediction,
    SpecSetting,
    chain_tokens_per_cycle,
    recommend,
    tree_capacity,
    tree_tokens_per_cycle,
)
from draftsmith.tune.flags import recommendation_text

TREE = ((0.6, 0.25), (0.5, 0.3), (0.7, 0.1))  # q[d][r]: no two paths tie


def _sglang_tree(acc: Acceptance, steps: int, topk: int, n: int) -> dict:
    """The verified nodes as SGLang's EAGLE-2 drafter picks them, built node by node: depth 1
    the root's topk children, then each frontier node's topk children (topk^2 candidates),
    the topk best of them the next frontier; then the n - 1 best candidates of all. A node is
    its path of sibling ranks; its score the product of q along it."""
    scores: dict[tuple[int, ...], float] = {}
    frontier = [()]
    for d in range(1, steps + 1):
        children = {}
        for parent in frontier:
            for r in range(topk):
                children[(*parent, r)] = scores.get(parent, 1.0) * acc.q(d, r)
        scores.update(children)
        frontier = sorted(children, key=children.get, reverse=True)[:topk]
    kept = sorted(scores, key=scores.get, reverse=True)[: n - 1]
    return dict.fromkeys(kept)


def _simulated_tree(acc: Acceptance, steps: int, topk: int, n: int, runs: int = 40_000) -> float:
    """Mean tokens per cycle: at each depth the target's token is the rank-r child with chance
    q(d, r) (no child otherwise); accepted while that child was verified, plus the bonus."""
    kept, rng, total = _sglang_tree(acc, steps, topk, n), random.Random(0), 0
    for _ in range(runs):
        path: tuple[int, ...] = ()
        for d in range(1, steps + 1):
            u, r = rng.random(), 0
            while r < topk and u >= acc.q(d, r):
                u -= acc.q(d, r)
                r += 1
            if r == topk or (*path, r) not in kept:
                break
            path = (*path, r)
        total += 1 + len(path)
    return total / runs


def test_a_chain_is_one_plus_the_running_products_of_its_acceptance():
    acc = Acceptance(chain=(0.8, 0.6, 0.5))
    assert chain_tokens_per_cycle(acc, 3) == pytest.approx(1 + 0.8 + 0.48 + 0.24)
    assert chain_tokens_per_cycle(acc, 5) == pytest.approx(1 + 0.8 + 0.48 + 0.24 + 0.12 + 0.06)


@pytest.mark.parametrize(("steps", "topk"), [(2, 2), (3, 2)])
def test_the_tree_model_matches_a_brute_force_tree(steps, topk):
    acc = Acceptance(tree=TREE)
    for n in range(2, tree_capacity(steps, topk) + 1):
        exact = 1 + sum(_path_chance(acc, p) for p in _sglang_tree(acc, steps, topk, n))
        assert tree_tokens_per_cycle(acc, steps, topk, n) == pytest.approx(exact, abs=1e-12)
    full = tree_capacity(steps, topk)
    assert tree_tokens_per_cycle(acc, steps, topk, full) == pytest.approx(
        _simulated_tree(acc, steps, topk, full), abs=0.02)


def _path_chance(acc: Acceptance, path: tuple[int, ...]) -> float:
    out = 1.0
    for d, r in enumerate(path, start=1):
        out *= acc.q(d, r)
    return out


def _pred(setting: SpecSetting, tps: float) -> Prediction:
    return Prediction(setting, 1, 2.0, 10.0, tps, {})


def _recs(pred: dict[SpecSetting, float], meas: dict[SpecSetting, float]):
    (rec,) = recommend([_pred(s, v) for s, v in pred.items()],
                       [Measurement(s, 1, v, accept_length=2.0) for s, v in meas.items()])
    return rec


BASE, CHAIN, TREE_SETTING = SpecSetting.baseline(), SpecSetting(3), SpecSetting(3, 2, 6)


def test_a_model_pick_the_sweep_beat_is_said_with_its_regret():
    """The model ranked the tree first; the sweep measured the chain faster. The report
    showed both rows' figures but never said the model's pick lost, nor by how much."""
    rec = _recs({BASE: 90.0, CHAIN: 140.0, TREE_SETTING: 160.0},
                {BASE: 90.0, CHAIN: 150.0, TREE_SETTING: 120.0})
    assert rec.setting == CHAIN and rec.predicted_best == TREE_SETTING
    assert rec.regret_tps == pytest.approx(30.0) and rec.regret_pct == pytest.approx(20.0)
    text = recommendation_text(rec, "runs/d")
    assert (f"  model's pick: {TREE_SETTING} (predicted 160.0 tok/s) measured 120.0 tok/s: "
            "30.0 tok/s (20.0 %) below the measured best") in text.splitlines()


def test_a_model_pick_the_sweep_confirmed_says_so():
    rec = _recs({BASE: 90.0, CHAIN: 140.0, TREE_SETTING: 130.0},
                {BASE: 90.0, CHAIN: 150.0, TREE_SETTING: 120.0})
    assert rec.predicted_best == CHAIN and rec.regret_tps == 0.0 and rec.regret_pct == 0.0
    assert "  model's pick: the measured best" in recommendation_text(rec, "runs/d").splitlines()
    nothing = _recs({BASE: 90.0, CHAIN: 140.0}, {})
    assert nothing.regret_tps is None and "model's pick" not in recommendation_text(
        nothing, "runs/d")


def test_tune_json_carries_the_models_pick_and_regret(tmp_path):
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], 2, 4, 1, "cpu",
                      torch.float32, False, tmp_path / "tune", max_topk=1)
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    (rec,) = saved["recommendations"]
    rows = {r["setting"]: r for r in saved["rows"]}
    best = max(rows.values(), key=lambda r: r["predicted_tok_s"])
    assert rec["predicted_best"] == best["setting"]
    assert rec["regret_tok_s"] == pytest.approx(rec["tokens_per_s"] - best["measured_tok_s"])
    assert rec["regret_pct"] == pytest.approx(100 * rec["regret_tok_s"] / rec["tokens_per_s"])
    assert "model's pick:" in (tmp_path / "tune" / "tune.md").read_text()
    assert any("model's pick:" in t for t in report["texts"])


def test_a_max_topk_past_the_draft_vocabulary_is_refused_before_loading(tmp_path):
    """--max-topk 8 with a draft vocabulary of 4: the target loaded and the chain's
    acceptance ran before the tree run refused `topk 8` (not the flag to change)."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.targets import load_target

    target = load_target(write_tiny_folder(tmp_path / "t", "llama"))
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.cfg, 4, [0, 2, 4]))
    drafter.set_vocab(torch.zeros(4, dtype=torch.long), torch.arange(128) < 4)
    save_drafter(drafter, tmp_path / "d")
    never = str(tmp_path / "never-loaded")
    res = invoke_tune("--drafter", str(tmp_path / "d"), "--target", never, "--device", "cpu",
                      "--max-topk", "8", "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError), res.exception
    assert str(res.exception) == ("--max-topk 8 exceeds the drafter's draft vocabulary of 4: "
                                  "give --max-topk 4 or less")
    assert not (tmp_path / "o").exists()
