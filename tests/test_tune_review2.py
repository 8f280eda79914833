"""`draftsmith tune`, second review: short answers priced with each row's last cycle counted
whole, and an earlier run's NCCL sweep never shown as this run's."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from test_tune_cli import _tiny_pair, invoke_tune

from draftsmith.tune.cost_model import (
    Acceptance,
    CostTable,
    Measurement,
    PromptMix,
    SpecSetting,
    cycle_tail,
    disagreement_cause,
    expected_cycles,
    predict,
    tokens_per_cycle,
)

COSTS = CostTable(verify={b: {1: 2.0 * b, 4: 3.0 * b} for b in (1, 2)},
                  draft_step={b: {1: 0.5 * b} for b in (1, 2)})


def _simulated_cycles(acc: Acceptance, steps: int, tokens: int, runs: int = 20_000) -> float:
    """A chain's cycles until a row has `tokens` tokens, drawn cycle by cycle."""
    rng, total = random.Random(0), 0
    for _ in range(runs):
        made = 0
        while made < tokens:
            k = 0
            while k < steps and rng.random() < acc.p(k + 1):
                k += 1
            made, total = made + k + 1, total + 1
    return total / runs


def test_expected_cycles_count_the_last_cycle_whole():
    always4 = (1.0, 1.0, 1.0, 1.0)  # every cycle makes 4 tokens
    assert [expected_cycles(always4, m) for m in (1, 3, 4, 5, 8, 400)] == [1, 1, 1, 2, 2, 100]
    assert expected_cycles((1.0, 0.5), 2) == pytest.approx(1.5)
    acc = Acceptance(chain=(0.7, 0.6, 0.5))
    tail = cycle_tail(acc, SpecSetting(3))
    assert sum(tail) == pytest.approx(tokens_per_cycle(acc, SpecSetting(3)))
    for m in (1, 2, 3, 7, 200):
        assert expected_cycles(tail, m) == pytest.approx(_simulated_cycles(acc, 3, m), rel=0.02)
    tree = Acceptance(chain=(0.6,) * 3, tree=((0.6, 0.3),) * 3)
    assert sum(cycle_tail(tree, SpecSetting(3, 2, 6))) == pytest.approx(
        tokens_per_cycle(tree, SpecSetting(3, 2, 6)))


def test_a_short_answer_is_not_priced_at_a_whole_cycles_tokens():
    """At --max-new-tokens 2 a row decodes one token after its prefill: one cycle keeps one
    token however many it accepts. The model priced steps 3 at acceptance 1 at 4 tokens a
    cycle (CPU engine run: predicted 1,525 tok/s, measured 352, the miss blamed on a phase)."""
    sure = Acceptance(chain=(1.0,) * 3)
    mix, chain = PromptMix((sure, sure)), SpecSetting(3)
    for new, kept_per_cycle in ((2, 1.0), (3, 2.0), (5, 4.0), (6, 2.5)):
        p = predict(COSTS, sure, chain, 1, mix, new_tokens=new)
        assert p.tokens_per_cycle == 4.0 and p.kept == pytest.approx(kept_per_cycle / 4)
        assert p.tokens_per_s == pytest.approx(kept_per_cycle * 1000 / p.cycle_ms)
    long = predict(COSTS, sure, chain, 2, mix, new_tokens=4001)
    assert long.tokens_per_s == pytest.approx(predict(COSTS, sure, chain, 2, mix).tokens_per_s)
    base = predict(COSTS, sure, SpecSetting.baseline(), 1, mix, new_tokens=2)
    assert base.tokens_per_s == pytest.approx(1000 / 2.0)


def test_a_short_batch_counts_rows_by_their_whole_cycles():
    """Rows that accept 4 and 1 tokens a cycle, 4 tokens to decode: the fast row ends after 1
    cycle, the slow after 4, so 5 of 8 row slots decode and every accepted token is kept."""
    fast, slow = Acceptance(chain=(1.0,) * 3), Acceptance(chain=(0.0,) * 3)
    mix = PromptMix((fast, slow))
    assert mix.fixed_length(SpecSetting(3), 2, 5) == pytest.approx((5 / 8, 1.0))
    assert mix.busy(SpecSetting(3), 2, 5) == pytest.approx(5 / 8)


def test_tokens_past_a_rows_end_are_named_as_the_cause():
    sure = Acceptance(chain=(1.0,) * 3)
    p = predict(COSTS, sure, SpecSetting(3), 1, PromptMix((sure,)), new_tokens=41)
    cut = Measurement(SpecSetting(3), 1, 1000 / p.cycle_ms, 4.0, dict(p.phases), p.cycle_ms,
                      1.0)
    assert disagreement_cause(p, cut).startswith(
        "tokens past a row's end: predicted 100% of accepted tokens kept, measured 25%")


def test_tune_prices_short_answers_near_what_it_measures(tmp_path):
    """End to end at --max-new-tokens 2 with a drafter that always agrees with its target (both
    heads zero: every argmax is token 0): the predicted tokens per kept cycle are the
    measured ones."""
    from safetensors.torch import save_file

    from draftsmith.models.eagle3 import load_drafter, save_drafter
    from draftsmith.targets import load_target
    from draftsmith.targets.hf import read_weights
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    drafter = load_drafter(tmp_path / "d", "cpu", torch.float32)
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    save_drafter(drafter, tmp_path / "d")
    weights = read_weights(folder)
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, str(folder / "model.safetensors"))
    assert load_target(folder).weights["lm_head.weight"].abs().max() == 0
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], 3, 2, 1, "cpu",
                      torch.float32, False, tmp_path / "tune", max_topk=1)
    assert report["acceptance"]["chain"] == [1.0, 1.0, 1.0]
    for r in report["phases"]:
        if r["setting"] != "no speculation" and r["predicted_phases_ms"]:
            assert r["predicted_kept"] == pytest.approx(1 / r["measured_accept"])


def test_a_new_tune_drops_an_earlier_runs_nccl_sweep(tmp_path, monkeypatch):
    """out/nccl/nccl.json from an earlier `tune --nccl-sweep` stayed beside a new tune's
    report, read as this run's sweep of shapes it never timed."""
    from draftsmith.tune import cli

    folder, prompts = _tiny_pair(tmp_path)
    out = tmp_path / "tune"
    (out / "nccl").mkdir(parents=True)
    for name in cli.NCCL_FILES:
        (out / "nccl" / name).write_text("{}")
    (out / "nccl" / "mine.txt").write_text("kept")
    report = cli.run_tune(tmp_path / "d", str(folder), prompts, [1], 1, 3, 1, "cpu",
                          torch.float32, False, out, max_topk=1)
    assert not any((out / "nccl" / name).exists() for name in cli.NCCL_FILES)
    assert (out / "nccl" / "mine.txt").read_text() == "kept"
    assert report["nccl"] is None and json.loads((out / "tune.json").read_text())["nccl"] is None
    res = {"recommendation": {"per_shape": [], "overall": {
        "choice": "LL", "env_line": "NCCL_PROTO=LL", "best": "LL", "gain_pct": 9.0,
        "margin_pct": 3.0}}}
    cli.attach_nccl(out, res)
    assert json.loads((out / "tune.json").read_text())["nccl"]["file"] == "nccl/nccl.json"
    assert "environment to use: `NCCL_PROTO=LL`" in (out / "tune.md").read_text()


def test_tune_nccl_sweep_names_its_sweep_in_tune_json(tmp_path, monkeypatch):
    from draftsmith.tune import cli

    (out := tmp_path / "o").mkdir()
    (out / "tune.json").write_text(json.dumps({"recommendations": [], "nccl": None}))
    (out / "tune.md").write_text("x\n")
    sweep = {"recommendation": {"per_shape": [], "overall": None, "note": "every setting failed"}}
    monkeypatch.setattr(cli, "run_tune", lambda *a, **k: {
        "texts": [], "recommendations": [{"batch": 1, "verify_tokens": 4}]})
    import draftsmith.dist

    monkeypatch.setattr(draftsmith.dist, "launch_tp", lambda *a, **k: cli.run_tune())
    monkeypatch.setattr(cli, "_nccl_for", lambda *a: sweep)
    monkeypatch.setattr("draftsmith.tune.tp_targets.refuse_split", lambda *a: None)
    no_drafter = SimpleNamespace(draft_vocab_size=32)  # no drafter here: its config alone
    monkeypatch.setattr("draftsmith.models.eagle3.check_drafter", lambda d: no_drafter)
    res = invoke_tune("--drafter", str(tmp_path), "--device", "cpu", "--tp", "2",
                      "--nccl-sweep", "--out", str(out))
    assert res.exit_code == 0, (res.output, res.exception)
    assert json.loads((out / "tune.json").read_text())["nccl"]["recommendation"] == sweep[
        "recommendation"]
    assert "Note: every setting failed" in (out / "tune.md").read_text()


def test_tune_sizes_its_cache_for_its_widest_verify(tmp_path):
    """--max-draft-tokens 100: the costs timed a 100-token verify from position 64 in a cache
    sized for 64 tokens past the longest row (IndexError after the acceptance runs; on a GPU
    a write past the cache)."""
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], 1, 2, 1, "cpu",
                      torch.float32, False, tmp_path / "tune", max_topk=2, max_draft=100)
    assert max(report["costs"]["verify"][1]) == 100


def test_tune_refuses_steps_past_its_model_before_loading(tmp_path, monkeypatch):
    """--max-steps 65 loaded the target and measured before the cost model refused it."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.tune import cli

    monkeypatch.setattr(cli, "run_tune", lambda *a, **k: pytest.fail("tune ran"))
    never = str(tmp_path / "never-loaded")
    res = invoke_tune("--drafter", never, "--target", never, "--device", "cpu",
                      "--max-steps", "65")
    assert isinstance(res.exception, DraftsmithError)
    assert "--max-steps must be at most 64, got 65" in str(res.exception)
