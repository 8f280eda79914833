"""compare, tune and export, first tools review: tune's neighbours at the grid's own widths and
budgets, a choice at a limit of the grid said so, and export's launch lines naming the target."""

from __future__ import annotations

import json
import shlex

import typer
from test_export import make
from typer.testing import CliRunner

from draftsmith.tune import cost_model
from draftsmith.tune.cost_model import Comparison, Prediction, Recommendation, SpecSetting


def _plan(monkeypatch, best: SpecSetting, limits: tuple[int, int, int]) -> list[SpecSetting]:
    """tune's sweep at one batch where the model ranks `best` first."""
    from draftsmith.tune.cli import plan_batch

    def ranked(costs, acc, batch, candidates=None, *rest):
        rest_ = [s for s in candidates or () if s != best]
        return [Prediction(s, batch, 2.0, 1.0, 100.0 - i, {}) for i, s in
                enumerate([best, *rest_])]

    monkeypatch.setattr(cost_model, "rank_settings", ranked)
    return plan_batch(None, None, 1, limits, top=1)[1]


def test_a_best_width_off_the_default_widths_has_width_neighbours(monkeypatch):
    """--max-topk 3: the best tree at topk 3 was swept with no other width beside it (the
    neighbours were looked up in TOPKS, which has no 3)."""
    plan = _plan(monkeypatch, SpecSetting(3, 3, 8), (3, 3, 32))
    assert {s.topk for s in plan if s.steps == 3 and s.topk > 1} == {2, 3}


def test_the_widest_tree_tune_allows_is_a_neighbour(monkeypatch):
    """--max-topk 16: the best at topk 8 never had topk 16 swept beside it, nor 16 the 8."""
    assert SpecSetting(3, 16, 24) in _plan(monkeypatch, SpecSetting(3, 8, 24), (3, 16, 32))
    assert SpecSetting(3, 8, 24) in _plan(monkeypatch, SpecSetting(3, 16, 24), (3, 16, 32))


def test_the_largest_draft_budget_tune_allows_is_a_neighbour(monkeypatch):
    """--max-draft-tokens 48: priced, but never swept beside a best tree of 32 tokens."""
    assert SpecSetting(4, 8, 48) in _plan(monkeypatch, SpecSetting(4, 8, 32), (4, 8, 48))


def _rec(setting: SpecSetting) -> Recommendation:
    rows = (Comparison(setting, 120.0, 110.0), Comparison(SpecSetting.baseline(), 50.0, 50.0))
    return Recommendation(1, setting, "measured", 110.0, 50.0, None, "", rows)


def test_a_choice_at_a_limit_of_the_grid_says_so():
    """The fastest chain at --max-steps 7 read as the answer, though a deeper one was never
    tried; the same for the widest tree and the largest tree budget."""
    from draftsmith.tune.flags import recommendation_text

    def text(s: SpecSetting) -> str:
        return recommendation_text(_rec(s), "/d", tp=1, limits=(7, 8, 32))

    assert "--max-steps 7" in text(SpecSetting(7)) and "deeper" in text(SpecSetting(7))
    assert "--max-topk 8" in text(SpecSetting(5, 8, 24))
    assert "--max-draft-tokens 32" in text(SpecSetting(5, 4, 32))
    assert "limit:" not in text(SpecSetting(5, 4, 16))
    assert "limit:" not in text(SpecSetting(2, 2, 3))  # the tree's whole capacity: no limit
    assert "limit:" not in recommendation_text(_rec(SpecSetting(7)), "/d", tp=1)


def _export(target, tmp_path, fmt: str) -> str:
    from draftsmith.export.cli import export

    app = typer.Typer()
    app.command()(export)
    app.command("other")(lambda: None)
    src = make(target, tmp_path / "d")
    res = CliRunner().invoke(app, ["export", str(src), "-f", fmt, "-o", str(tmp_path / fmt)])
    assert res.exit_code == 0, res.output
    return res.stdout


def test_the_sglang_launch_line_names_the_target(target, tmp_path):
    """The printed SGLang flags named the drafter only: the server needs the target's path."""
    out = _export(target, tmp_path, "sglang")
    line = next(x for x in out.splitlines() if "sglang.launch_server" in x)
    words = shlex.split(line.split(": ", 1)[1])
    assert words[:4] == ["python", "-m", "sglang.launch_server", "--model-path"]
    assert words[4] == str(target.folder.resolve())
    assert words[words.index("--speculative-draft-model-path") + 1] == str(tmp_path / "sglang")
    assert "--speculative-algorithm" in words and "EAGLE3" in words


def test_the_vllm_launch_line_names_the_target(target, tmp_path):
    out = _export(target, tmp_path, "speculators")
    line = next(x for x in out.splitlines() if "vllm serve" in x)
    words = shlex.split(line.split(": ", 1)[1])
    assert words[:3] == ["vllm", "serve", str(target.folder.resolve())]
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "speculators"),
                    "num_speculative_tokens": 3}


def test_every_target_fact_that_differs_is_named(target, tmp_path):
    """Drafters of targets of other depths: only "fingerprints X vs Y" was said, the first fact
    found, though the layer counts (what the aux ids mean) differed too."""
    from conftest import write_tiny_folder
    from test_compare import build

    from draftsmith.compare import differences
    from draftsmith.compare.describe import describe
    from draftsmith.models.eagle3 import save_drafter
    from draftsmith.targets import load_target

    deep = load_target(str(write_tiny_folder(tmp_path / "t", num_hidden_layers=8, seed=1)))
    a = save_drafter(build(target, 128, 32, [0, 2, 4], 0), tmp_path / "a")
    b = save_drafter(build(deep, 128, 32, [0, 2, 4], 0), tmp_path / "b")
    note = next(n for n in differences([describe(a, "a"), describe(b, "b")])
                if "different targets" in n)
    assert f"fingerprints {target.fingerprint} vs {deep.fingerprint}" in note
    assert f"target layers {target.cfg.num_layers} vs 8" in note


def test_a_launch_line_without_a_recorded_target_says_what_to_put_there(tmp_path):
    from draftsmith.export.cli import UNNAMED, _serve_hint

    config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]},
              "draftsmith": {"aux_layer_ids_canonical": [1, 2, 4]}}
    hint = _serve_hint("sglang", tmp_path, config, 3)
    assert f"--model-path {UNNAMED} " in hint and f"\n{UNNAMED}: the drafter records no " in hint
    assert UNNAMED not in _serve_hint("sglang", tmp_path, config, 3, "/t")
