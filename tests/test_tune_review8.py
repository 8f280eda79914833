"""`draftsmith tune`, eighth review: a prompt mix priced at its own rows' tokens per cycle, deep
trees' depth neighbours swept, tune-nccl's --device and --target checked before any setting,
and a stopped `tune --nccl-sweep` resumed without measuring the tune again."""

from __future__ import annotations

import json

import pytest
import torch
from test_tune_cli import _tiny_pair, invoke_tune
from test_tune_review4 import _fake_measures
from test_tune_review6 import LL, RING, _fake_settings

from draftsmith.errors import DraftsmithError
from draftsmith.tune import nccl
from draftsmith.tune.cost_model import (
    Acceptance,
    CostTable,
    Prediction,
    PromptMix,
    SpecSetting,
    _row_cycles,
    cycle_tail,
    expected_cycles,
    predict,
    sweep_plan,
    tokens_per_cycle,
)

# ---- a mix's rows at their own tokens per cycle --------------------------------------------------


def _pooled(prompts: tuple[Acceptance, ...], steps: int, tokens: int) -> Acceptance:
    """The chain counts `measure.chain_acceptance` pools: each prompt's expected cycles at the
    measured depth, position by position."""
    reached, accepted = [0.0] * steps, [0.0] * steps
    for a in prompts:
        r = expected_cycles(cycle_tail(a, SpecSetting(steps)), tokens)
        for k in range(steps):
            reached[k] += r
            r *= a.p(k + 1)
            accepted[k] += r
    return Acceptance.from_chain_counts(reached, accepted)


def test_a_mix_is_priced_at_its_own_rows_tokens_per_cycle():
    """A sure prompt and an unsure one, pooled at depth 7: a chain of 3 was priced at the pooled
    figures' 1.82 tokens a cycle, where its rows make 2.01 (the pooled ones weigh each prompt
    by its cycles at depth 7): 9 % low, exact only at the measured depth, so the choice leaned
    deep."""
    sure, unsure = Acceptance.constant(0.9, 7), Acceptance.constant(0.3, 7)
    mix, new = PromptMix((sure, unsure)), 128
    pooled = _pooled(mix.prompts, 7, new - 1)
    costs = CostTable(verify={1: {1: 10.0, 8: 12.0}}, draft_step={1: {1: 1.0}})
    for steps in (1, 3, 5, 7):
        s = SpecSetting(steps)
        p = predict(costs, pooled, s, 1, mix, None, new)
        cycles = [_row_cycles(a, s, new - 1) for a in mix.prompts]
        # one row a batch: two batches, each its row's cycles, new - 1 tokens after the prefill
        assert p.tokens_per_s == pytest.approx(2 * (new - 1) * 1000 / (sum(cycles) * p.cycle_ms))
        made = sum(c * tokens_per_cycle(a, s) for c, a in zip(cycles, mix.prompts, strict=True))
        assert p.tokens_per_cycle == pytest.approx(made / sum(cycles))
        long = predict(costs, pooled, s, 1, mix)  # no token count: each row's tokens / its pace
        paces = [1 / tokens_per_cycle(a, s) for a in mix.prompts]
        assert long.tokens_per_s == pytest.approx(2 * 1000 / (sum(paces) * long.cycle_ms))


def test_a_deep_trees_depth_neighbours_are_swept():
    """--max-steps up to 64, but a tree's steps +-1 neighbours stopped at 10: a tree best at
    depth 12 was swept with no depth beside it."""
    best = SpecSetting(12, 2, 16)
    plan = sweep_plan([Prediction(best, 1, 3.0, 1.0, 100.0, {})], top=1)
    assert SpecSetting(11, 2, 16) in plan and SpecSetting(13, 2, 16) in plan


# ---- tune-nccl's --device and --target ---------------------------------------------------------


def _tune_nccl(monkeypatch, *args: str, sweep=None):
    import typer
    from typer.testing import CliRunner

    from draftsmith.tune.cli import tune_nccl

    monkeypatch.setattr(nccl, "run_nccl_sweep",
                        sweep or (lambda *a, **k: pytest.fail("the sweep ran")))
    monkeypatch.setattr(nccl, "print_report", lambda *a, **k: None)
    app = typer.Typer()
    app.command()(tune_nccl)
    return CliRunner().invoke(app, list(args))


def test_tune_nccl_refuses_random_8b_on_cpu_before_any_setting(monkeypatch, tmp_path):
    """Given by name on CPU, random-8b built 8B random parameters over the ranks of every
    setting: minutes each (an OOM on a small host), each past its --timeout, all failed."""
    res = _tune_nccl(monkeypatch, "--device", "cpu", "--target", "random-8b", "--out",
                     str(tmp_path / "n"))
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "--target random-8b on cpu" in str(res.exception)
    assert "give --target tiny" in str(res.exception)


def test_tune_nccl_says_why_a_gpu_host_sweeps_on_cpu(monkeypatch, tmp_path):
    import torch

    seen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    res = _tune_nccl(monkeypatch, "--out", str(tmp_path / "n"),
                     sweep=lambda tp, target, s, sh, dev, *a, **k: seen.append((target, dev)))
    assert res.exit_code == 0, (res.output, res.exception)
    assert seen == [("tiny", "cpu")] and "1 CUDA device(s) here, --tp 2 needs 2" in res.output


# ---- a stopped `tune --nccl-sweep` -------------------------------------------------------------


def _tune_sweep(tmp_path, folder, prompts, out):
    return invoke_tune(
        "--drafter", str(tmp_path / "d"), "--target", str(folder), "--prompts", str(prompts),
        "--batch-sizes", "1", "--max-steps", "2", "--max-new-tokens", "4", "--max-topk", "2",
        "--max-draft-tokens", "5", "--device", "cpu", "--tp", "2", "--nccl-sweep", "--out",
        str(out))


def test_a_stopped_tune_nccl_sweep_resumes_without_measuring_the_tune_again(tmp_path,
                                                                            monkeypatch):
    """Stopped in its NCCL sweep (after tune.json), the same command run again measured the
    whole tune again (tune.partial.json was gone), then dropped the sweep's nccl.partial.json
    as stale: both lost."""
    import draftsmith.dist
    from draftsmith.tune import cli

    folder, prompts = _tiny_pair(tmp_path)
    monkeypatch.setattr(draftsmith.dist, "launch_tp",
                        lambda fn, tp, *args, **k: cli.run_tune(*args))
    monkeypatch.setattr("draftsmith.tune.tp_targets.refuse_split", lambda *a: None)
    monkeypatch.setattr(nccl, "grid", lambda kind="quick": [nccl.DEFAULTS, LL, RING])
    calls: list = []
    ran: list = []
    _fake_measures(monkeypatch, calls)
    _fake_settings(monkeypatch, ran, stop_at="Ring")
    out = tmp_path / "tune"
    try:
        res = _tune_sweep(tmp_path, folder, prompts, out)
        assert res.exit_code != 0  # click turns the ctrl-C into an abort
    except KeyboardInterrupt:
        pass
    assert "sweep" in calls and ran == ["defaults", "LL", "Ring"]
    assert (out / "tune.json").is_file() and (out / cli.PARTIAL).is_file()
    calls.clear()
    ran.clear()
    _fake_settings(monkeypatch, ran)
    res = _tune_sweep(tmp_path, folder, prompts, out)
    assert res.exit_code == 0, (res.output, res.exception)
    assert calls == [] and ran == ["Ring"]
    assert json.loads((out / "tune.json").read_text())["nccl"]["file"] == "nccl/nccl.json"
    assert not (out / cli.PARTIAL).exists() and not (out / "nccl" / nccl.PARTIAL).exists()


def test_tunes_sweep_drops_an_earlier_tunes_stopped_sweep_of_other_shapes(tmp_path, monkeypatch):
    """tune.json's new shapes are not an earlier tune's: its stopped sweep in out/nccl (which
    tune owns) is dropped and the sweep runs whole, where tune-nccl's own --out refuses it."""
    folder, _ = _tiny_pair(tmp_path)
    ran: list = []
    _fake_settings(monkeypatch, ran)
    out = tmp_path / "nccl"
    out.mkdir()
    other = {"run": {"tp": 2, "target": "elsewhere"}, "results": [
        {"setting": "LL", "status": "ok", "env": LL.env()}]}
    (out / nccl.PARTIAL).write_text(json.dumps(other))
    kw = dict(settings=[nccl.DEFAULTS, LL], shapes=[(1, 1)], device="cpu", dtype="fp32",
              iters=1, log=lambda _: None, out=out)
    with pytest.raises(DraftsmithError, match="another NCCL sweep"):
        nccl.run_nccl_sweep(2, str(folder), **kw)
    nccl.run_nccl_sweep(2, str(folder), **kw, replace_other=True)
    assert ran == ["defaults", "LL"] and not (out / nccl.PARTIAL).exists()


# ---- the printed recommendation ----------------------------------------------------------------


def test_tunes_flags_print_whole_and_as_written(tmp_path, monkeypatch):
    """The texts went through rich: a drafter path's `[x]` vanished from the flags, a `[/x]`
    raised MarkupError after the whole tune, and the flags line broke at 80 columns when piped
    (at the terminal's width otherwise) into lines that paste as separate commands."""
    from draftsmith.tune import cli
    from draftsmith.tune.cost_model import Comparison, Recommendation
    from draftsmith.tune.flags import export_paths, recommendation_text

    for name in ("run[1]", "run[/x]"):
        drafter = tmp_path / name / "drafter"
        rec = Recommendation(1, SpecSetting(3), "measured", 100.0, 50.0, None, "", (
            Comparison(SpecSetting(3), 90.0, 100.0),), 1.0)
        text = recommendation_text(rec, str(drafter), exports=export_paths(drafter))
        assert f"{drafter}-sglang" in text
        monkeypatch.setattr(cli, "run_tune", lambda *a, text=text, **k: {
            "texts": [text], "recommendations": []})
        res = invoke_tune("--drafter", str(tmp_path), "--device", "cpu", "--out",
                          str(tmp_path / "o"))
        assert res.exit_code == 0, (res.output, res.exception)
        assert all(line in res.output.splitlines() for line in text.splitlines())


# ---- --max-topk and --max-draft-tokens themselves priced ----------------------------------------


def test_tune_prices_its_own_max_topk_and_max_draft_tokens(tmp_path, monkeypatch):
    """The grid took topk from 1, 2, 4, 8 and budgets from 4 ... 64 at or below the limits:
    --max-topk 3 priced no topk 3 (its tree acceptance measured, unused), --max-draft-tokens 6
    no 6-token tree, --max-topk 16 nothing past 8, all without a word."""
    from draftsmith.tune.cli import run_tune
    from draftsmith.tune.cost_model import tune_grid, tune_topks

    assert tune_topks(8) == [1, 2, 4, 8] and tune_topks(16) == [1, 2, 4, 8, 16]
    assert SpecSetting(3, 16, 64) in tune_grid(3, 16, 64)
    folder, prompts = _tiny_pair(tmp_path)
    _fake_measures(monkeypatch, [])
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], 2, 4, 1, "cpu", torch.float32,
                      False, tmp_path / "o", max_topk=3, max_draft=6)
    priced = {r["setting"] for r in report["rows"]}
    assert "steps 2, topk 3, 6 draft tokens" in priced
    assert "steps 2, topk 2, 6 draft tokens" in priced
