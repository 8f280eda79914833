"""Tune, twentieth review: a drafter made for another target refused before the target's
weights load, naming the flag and what to give; one of another fingerprint said."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_folder
from test_tune_cli import invoke_tune


def _drafter_for(target, folder, fingerprint: str = "") -> None:
    """A drafter shaped for `target` (a folder), recording `fingerprint` as its target's."""
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.targets import load_target

    cfg = load_target(target).cfg
    dc = Eagle3Config.for_target(cfg, 16, [0, 1, cfg.num_layers - 1],
                                 target_fingerprint=fingerprint)
    drafter = Eagle3Drafter(dc)
    drafter.set_vocab(torch.zeros(16, dtype=torch.long), torch.arange(cfg.vocab_size) < 16)
    save_drafter(drafter, folder)


def _no_build(monkeypatch):
    """The target's weights never load: the refusal comes first."""
    from draftsmith.targets import Target

    built = []
    monkeypatch.setattr(Target, "build", lambda *a, **k: built.append(a) or 1 / 0)
    return built


@pytest.mark.parametrize("other, said", [
    # hidden size 48 for a target of 64: refused only once the target's weights and the drafter
    # had loaded and the chain's acceptance began, in the engine's words with no flag
    ({"hidden_size": 48}, "drafter expects vocab 128 / hidden 48, the target has vocab 128 / "
                          "hidden 64"),
    # a drafter of a deeper target (aux layer 7 of a 6-layer target) alike
    ({"num_hidden_layers": 8}, "aux layer ids [7] out of range"),
])
def test_a_drafter_of_another_targets_shapes_is_refused_before_the_weights_load(
        tmp_path, monkeypatch, other, said):
    from draftsmith.errors import DraftsmithError

    mine = write_tiny_folder(tmp_path / "a", "llama")
    _drafter_for(write_tiny_folder(tmp_path / "b", "llama", **other), tmp_path / "d")
    built = _no_build(monkeypatch)
    res = invoke_tune("--drafter", str(tmp_path / "d"), "--target", str(mine), "--device", "cpu",
                      "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError), res.exception
    text = str(res.exception)
    assert text.startswith(f"--drafter {tmp_path / 'd'}: {said}"), text
    assert text.endswith(": give the --target it was trained for") and "\n" not in text
    assert built == [] and not (tmp_path / "o").exists()


def test_a_drafter_trained_for_another_fingerprint_is_said_up_front(tmp_path, monkeypatch):
    """Same shapes, another target's fingerprint: tuned without a word, its low acceptance
    read as the drafter's; bench, generate and serve warn."""
    mine = write_tiny_folder(tmp_path / "a", "llama")
    _drafter_for(mine, tmp_path / "d", fingerprint="0123456789abcdef")
    _no_build(monkeypatch)
    res = invoke_tune("--drafter", str(tmp_path / "d"), "--target", str(mine), "--device", "cpu",
                      "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, ZeroDivisionError), res.exception  # went on to build
    assert ("warning: the drafter was trained for target 0123456789abcdef, this target is "
            in res.output), res.output
    assert "acceptance and the recommendation are this pair's" in res.output


# a synthetic engine whose true costs are known: ms by batch b, verify width n, topk k, steps s
def _true_verify(b: int, n: int) -> float:
    return 4.0 + 0.05 * b * n + 0.01 * n


def _true_draft(b: int, k: int, s: int) -> float:
    return (0.2 + 0.01 * b) + (s - 1) * (0.6 + 0.1 * k + 0.02 * b * k)


OVERHEAD = 0.3


def _fitted_costs(monkeypatch, batches: list[int], limits: tuple[int, int, int]):
    """The cost table tune fits from the shapes it times (`measure.cost_plan`), read off the
    synthetic engine: verifies at `verify_ns` widths only, drafts from two probe depths."""
    from draftsmith.tune import measure
    from draftsmith.tune.cost_model import CostTable

    steps, topk, draft = limits
    plan = measure.cost_plan(batches, topk, steps, measure.cost_width(steps, topk, draft))
    monkeypatch.setattr(measure, "_probe", lambda eng, s, prompts, b, new: {
        "draft": _true_draft(b, s.topk, s.steps), "accept": OVERHEAD})
    first, step, overhead = measure.draft_phase_costs(None, plan.probe, [[1]])
    verify = {b: {n: _true_verify(b, n) for c, n in plan.verify if c == b} for b in batches}
    return CostTable(verify=verify, draft_step=step, draft_first=first, overhead=overhead,
                     decode={b: _true_verify(b, 1) for b in batches})


def test_the_fitted_model_prices_settings_it_did_not_time_and_picks_the_true_best(monkeypatch):
    """Every setting of the grid, most of them never timed (verify widths 7, 9, 10, ...; draft
    depths other than the probes'), priced at the synthetic engine's true cycle; the model's
    pick at each batch size the true fastest."""
    from draftsmith.tune import cost_model as cm
    from draftsmith.tune.cli import plan_batch

    limits, batches = (6, 4, 12), [1, 8]
    costs = _fitted_costs(monkeypatch, batches, limits)
    acc = cm.Acceptance(chain=(0.8, 0.7, 0.6, 0.5, 0.45, 0.4),
                        tree=((0.8, 0.1, 0.05, 0.02),) * 6)
    for b in batches:
        ranked, todo = plan_batch(costs, acc, b, limits)
        truth = {}
        for p in ranked:
            s = p.setting
            cycle = _true_verify(b, 1) if s.is_baseline else (
                _true_draft(b, s.topk, s.steps) + _true_verify(b, s.num_draft_tokens) + OVERHEAD)
            assert abs(p.cycle_ms - cycle) < 1e-9, (b, s, p.cycle_ms, cycle)
            truth[s] = b * cm.tokens_per_cycle(acc, s) * 1000 / cycle if s.steps else (
                b * 1000 / cycle)
        best = max(truth, key=truth.get)
        assert ranked[0].setting == best and best in todo, (b, ranked[0].setting, best)
        assert not best.is_baseline
