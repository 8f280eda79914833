"""Tune, twenty-first review: a swept setting that fails (out of memory at a large batch) is
reported per setting and the rest kept; drafts deeper than the drafter's trained TTT depth
said; tune-nccl at --tp 1 said not to apply before any setting runs."""

from __future__ import annotations

import json

import pytest
import torch
from test_tune_cli import _tiny_pair

from draftsmith.errors import DraftsmithError
from draftsmith.tune.cost_model import Acceptance, CostTable, Measurement, PromptMix

ACC = Acceptance(chain=(0.8, 0.7, 0.6), tree=((0.8, 0.1), (0.7, 0.1), (0.6, 0.1)))
COSTS = CostTable(verify={b: {1: 1.0 * b, 8: 1.5 * b} for b in (1, 2)},
                  draft_step={b: {1: 0.2, 2: 0.3} for b in (1, 2)},
                  decode={b: 0.9 * b for b in (1, 2)})


def _fakes(monkeypatch, run) -> None:
    """Acceptance and costs from fixed figures; the sweep's runs through `run`."""
    from draftsmith.tune import cli, measure

    mix = PromptMix((ACC,) * 3)
    monkeypatch.setattr(measure, "chain_acceptance", lambda *a, **k: (ACC, mix))
    monkeypatch.setattr(measure, "tree_acceptance", lambda *a, **k: (ACC, mix))
    monkeypatch.setattr(measure, "cost_table", lambda *a, **k: COSTS)
    monkeypatch.setattr(cli, "plot", lambda *a, **k: None)
    monkeypatch.setattr(measure, "run_setting", run)


def _oom_at_batch_2(eng, s, ids, b, *a):
    if b == 2 and s.steps == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return Measurement(s, b, 100.0 + 10 * s.steps + b)


def test_a_setting_out_of_memory_is_reported_and_the_rest_kept(tmp_path, monkeypatch):
    """One setting out of memory at batch 2 ended the whole tune: no tune.json, no
    recommendation at batch 1 either, though every figure there was measured."""
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    _fakes(monkeypatch, _oom_at_batch_2)
    out = tmp_path / "tune"
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 3, 8, 2, "cpu",
                      torch.float32, False, out, max_topk=1)
    saved = json.loads((out / "tune.json").read_text())
    assert [r["batch"] for r in saved["recommendations"]] == [1, 2]
    assert saved["failed"] == [{"batch": 2, "setting": "steps 2, topk 1, 3 draft tokens",
                                "error": "OutOfMemoryError: CUDA out of memory. Tried to "
                                         "allocate 2.00 GiB"}]
    assert saved["recommendations"][1]["setting"] == "steps 3, topk 1, 4 draft tokens"
    assert saved["recommendations"][0]["setting"] == "steps 3, topk 1, 4 draft tokens"
    measured = {(r["batch"], r["setting"]) for r in saved["rows"] if r["measured_tok_s"]}
    assert (1, "steps 2, topk 1, 3 draft tokens") in measured
    assert (2, "steps 2, topk 1, 3 draft tokens") not in measured
    batch2 = report["texts"][1]
    assert batch2.startswith("batch 2:")
    assert "failed: steps 2, topk 1, 3 draft tokens" in batch2 and "OutOfMemoryError" in batch2
    assert "failed" not in report["texts"][0]
    assert not (out / "tune.partial.json").exists()


def test_a_sweep_where_every_setting_fails_stops_naming_the_error(tmp_path, monkeypatch):
    """Nothing measured at all: no report of predictions alone, the error itself raised."""
    from draftsmith.tune.cli import PARTIAL, run_tune

    def broken(*a):
        raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")

    folder, prompts = _tiny_pair(tmp_path)
    _fakes(monkeypatch, broken)
    out = tmp_path / "tune"
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        run_tune(tmp_path / "d", str(folder), prompts, [1], 2, 8, 1, "cpu", torch.float32,
                 False, out, max_topk=1)
    assert not (out / "tune.json").exists() and (out / PARTIAL).exists()


def test_our_own_refusal_in_the_sweep_still_stops_the_tune(tmp_path, monkeypatch):
    """A DraftsmithError (the same for every setting) stops it, what was measured kept."""
    from draftsmith.tune.cli import run_tune

    def refuse(eng, s, ids, b, *a):
        if s.steps == 2:
            raise DraftsmithError("ran no speculative cycle")
        return Measurement(s, b, 100.0)

    folder, prompts = _tiny_pair(tmp_path)
    _fakes(monkeypatch, refuse)
    with pytest.raises(DraftsmithError, match="ran no speculative cycle .tune stopped"):
        run_tune(tmp_path / "d", str(folder), prompts, [1], 2, 8, 1, "cpu", torch.float32,
                 False, tmp_path / "tune", max_topk=1)


def _trained(tmp_path, ttt_steps: int | None) -> None:
    """The drafter of `_tiny_pair` saved again as training saves it, recording its TTT depth."""
    from draftsmith.models.eagle3 import load_drafter, save_drafter

    drafter = load_drafter(tmp_path / "d", "cpu", torch.float32)
    summary = {} if ttt_steps is None else {"training": {"config": {"ttt_steps": ttt_steps}}}
    save_drafter(drafter, tmp_path / "d", **summary)


@pytest.mark.parametrize("ttt, max_steps, said", [
    (2, 3, "note: --max-steps 3 sweeps drafts past the drafter's trained depth (2 TTT steps, "
           "its draftsmith.json): step 3 is measured, not trained for"),
    (1, 3, "steps 2-3 are measured, not trained for"),
    (3, 3, None),
    (None, 3, None),  # an imported drafter: no depth recorded, nothing said
])
def test_drafts_past_the_trained_depth_are_swept_and_said(tmp_path, monkeypatch, capsys, ttt,
                                                          max_steps, said):
    """--max-steps past the drafter's TTT depth swept without a word: the deeper settings'
    low acceptance read as the drafter's, and a choice there untrained."""
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    _trained(tmp_path, ttt)
    _fakes(monkeypatch, lambda eng, s, ids, b, *a: Measurement(s, b, 100.0 + s.steps))
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], max_steps, 8, 1, "cpu",
                      torch.float32, False, tmp_path / "tune", max_topk=1)
    swept = {r["setting"] for r in report["rows"] if r["measured_tok_s"]}
    assert "steps 3, topk 1, 4 draft tokens" in swept  # allowed: swept all the same
    printed, md = capsys.readouterr().out, (tmp_path / "tune" / "tune.md").read_text()
    if said is None:
        assert "trained depth" not in printed + md
    else:
        assert said in printed and said in md


def test_tune_nccl_at_tp_1_says_nccl_does_not_apply_before_any_setting(tmp_path, monkeypatch):
    """--tp 1 timed every setting in fresh processes (14 random-8b loads on a GPU) to end on a
    note that NCCL settings cannot matter there."""
    import typer
    from typer.testing import CliRunner

    from draftsmith.tune import nccl
    from draftsmith.tune.cli import tune_nccl

    monkeypatch.setattr(nccl, "run_nccl_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    app = typer.Typer()
    app.command()(tune_nccl)
    res = CliRunner().invoke(app, ["--tp", "1", "--device", "cpu", "--out", str(tmp_path / "n")])
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception) == ("--tp 1 runs no collective, so NCCL settings do not apply: "
                                  "give --tp 2 or more")
    assert not (tmp_path / "n").exists()
