"""Review 14 of `draftsmith tune`: the sweep timed neighbours the model never priced (a top
chain's topk-2 tree of steps + 1 tokens, a capped budget a step deeper), so their rows read
"predicted -" and, where one won, the choice had no model error ("cause: not predicted")."""

from __future__ import annotations

import torch
from test_tune_cli import _tiny_pair

from draftsmith.tune.cost_model import (
    Acceptance,
    CostTable,
    Measurement,
    PromptMix,
    SpecSetting,
)

COSTS = CostTable(verify={1: {1: 10.0, 2: 10.4, 4: 11.0, 8: 12.0, 16: 14.0, 32: 20.0}},
                  draft_step={1: {1: 1.0, 2: 1.3}}, draft_first={1: {1: 0.2, 2: 1.0}},
                  extend={1: {2: 1.0, 4: 1.2}}, overhead={1: 0.3}, decode={1: 9.0})
# rank 1 never accepted: trees only cost more, so the top predicted settings are chains
ACC = Acceptance(chain=(0.8, 0.7, 0.6), tree=((0.8, 0.0), (0.7, 0.0), (0.6, 0.0)))


def test_every_swept_setting_is_priced():
    from draftsmith.tune.cli import plan_batch

    preds, todo = plan_batch(COSTS, ACC, 1, (3, 2, 32), PromptMix((ACC,)), None, 8, 3)
    priced = {p.setting for p in preds}
    assert SpecSetting(2, 2, 3) in todo  # a chain's neighbour off the grid
    assert [str(s) for s in todo if s not in priced] == []
    assert len(priced) == len(preds)  # each once, the baseline too
    assert [p.tokens_per_s for p in preds] == sorted((p.tokens_per_s for p in preds),
                                                     reverse=True)


def test_a_tunes_measured_rows_all_have_predictions(tmp_path, monkeypatch):
    from draftsmith.tune import cli, measure
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    mix = PromptMix((ACC,) * 3)
    monkeypatch.setattr(measure, "chain_acceptance", lambda *a, **k: (ACC, mix))
    monkeypatch.setattr(measure, "tree_acceptance", lambda *a, **k: (ACC, mix))
    monkeypatch.setattr(measure, "cost_table", lambda *a, **k: COSTS)
    monkeypatch.setattr(cli, "plot", lambda *a, **k: None)  # the PNG: not the point
    monkeypatch.setattr(measure, "run_setting",
                        lambda eng, s, ids, b, *a: Measurement(s, b, 100.0 + s.steps))
    report = run_tune(tmp_path / "d", str(folder), prompts, [1], 3, 8, 3, "cpu", torch.float32,
                      False, tmp_path / "tune", max_topk=2)
    rows = [r for r in report["rows"] if r["measured_tok_s"] is not None]
    assert any(r["setting"] == "steps 2, topk 2, 3 draft tokens" for r in rows)
    assert [r["setting"] for r in rows if r["predicted_tok_s"] is None] == []
    assert report["recommendations"][0]["error_pct"] is not None
