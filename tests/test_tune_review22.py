"""Tune, twenty-second review: a batch whose swept settings all failed recommends nothing (not
an unswept prediction); a ctrl-C in the sweep says where what finished is kept; batch sizes
past the prompts said; `sweep_run` and its helpers typed."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from test_tune_cli import _tiny_pair
from test_tune_review21 import _fakes

from draftsmith.tune.cost_model import CostTable, Measurement

COSTS = CostTable(verify={b: {1: 1.0 * b, 8: 1.5 * b} for b in (1, 2, 8)},
                  draft_step={b: {1: 0.2, 2: 0.3} for b in (1, 2, 8)},
                  decode={b: 0.9 * b for b in (1, 2, 8)})


def _oom_at_batch_2(eng, s, ids, b, *a):
    if b == 2:
        raise torch.OutOfMemoryError("CUDA out of memory")
    return Measurement(s, b, 100.0 + 10 * s.steps + b)


def test_a_batch_whose_swept_settings_all_failed_recommends_no_unswept_setting(tmp_path,
                                                                            monkeypatch):
    """With trees in the grid, settings the sweep never ran were left after the failed ones:
    batch 2's choice was the best of those predictions, a setting nobody had run, with its
    SGLang flags, above the failures."""
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    _fakes(monkeypatch, _oom_at_batch_2)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 3, 8, 1, "cpu",
                      torch.float32, False, tmp_path / "tune", max_topk=2, max_draft=5)
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert [r["batch"] for r in saved["recommendations"]] == [1]
    assert saved["recommendations"][0]["best_measured_tok_s"] is not None
    last = report["texts"][-1]
    assert last.startswith("batch 2: no setting ran, so none is recommended")
    assert "SGLang" not in last


def test_ctrl_c_in_the_sweep_says_where_what_finished_is_kept(tmp_path, monkeypatch, capsys):
    """typer turns a ctrl-C into exit 130 without a word, so the note naming tune.partial.json
    was never shown: the user could not tell the batch-1 rows were kept for a rerun."""
    from draftsmith.tune.cli import PARTIAL, run_tune

    def stop_at_batch_2(eng, s, ids, b, *a):
        if b == 2:
            raise KeyboardInterrupt
        return Measurement(s, b, 100.0 + s.steps)

    folder, prompts = _tiny_pair(tmp_path)
    _fakes(monkeypatch, stop_at_batch_2)
    out = tmp_path / "tune"
    with pytest.raises(KeyboardInterrupt):
        run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 2, 8, 1, "cpu", torch.float32,
                 False, out, max_topk=1)
    said = capsys.readouterr().out
    assert f"tune: stopped (ctrl-C): what it measured is in {out / PARTIAL}" in said
    assert "the same tune run again resumes from it" in said
    kept = json.loads((out / PARTIAL).read_text())["measured"]
    assert {r["batch"] for r in kept} == {1} and len(kept) == 3


def test_batch_sizes_past_the_prompts_are_said(tmp_path, monkeypatch, capsys):
    """3 prompts at batch 8 (the default 1,8,32 over the 22-prompt chat suite too): rows
    repeat prompts, which nothing said, in the run or in tune.md."""
    from draftsmith.tune import measure
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    _fakes(monkeypatch, lambda eng, s, ids, b, *a: Measurement(s, b, 100.0 + s.steps))
    monkeypatch.setattr(measure, "cost_table", lambda *a, **k: COSTS)
    out = tmp_path / "tune"
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2, 8], 2, 8, 1, "cpu",
                      torch.float32, False, out, max_topk=1)
    note = ("note: batch 8 has more rows than the 3 prompts tuned on, so its rows repeat "
            "prompts: its figures are those prompts', not 8 distinct requests'; give at least 8 "
            "prompts (--prompts, --num-prompts) for distinct rows")
    assert note in capsys.readouterr().out
    assert note in report["texts"] and note in (out / "tune.md").read_text()


def test_batch_sizes_within_the_prompts_say_nothing() -> None:
    from draftsmith.tune.cli import few_prompts

    assert few_prompts(3, [1, 2, 3]) is None
    assert "batch 4, 8 have more rows than the 3 prompts" in few_prompts(3, [1, 4, 8])


@pytest.mark.parametrize("name", ["sweep_run", "failed_lines", "writes_out"])
def test_sweep_run_and_its_helpers_are_typed(name: str) -> None:
    from draftsmith.tune import cli

    sig = inspect.signature(getattr(cli, name))
    assert sig.return_annotation is not inspect.Signature.empty
    assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values())
