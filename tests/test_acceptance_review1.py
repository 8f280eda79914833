"""Training-log acceptance figures, review 1: a draft position no chain reached in a logging
window is unmeasured (None, null in the log), not a drafter that is never right there, and
every reader (the loop's line, the plot, the doctor's promise, compare) says where its accept
length stops; a tied SGLang folder's lm_head is counted as the embedding its engine serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_compare import H, V, build, specforge_folder

from draftsmith.train import objective as obj


def _short_chains(steps: int, reached: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draft right, but every sequence ends after `reached` steps (tiny data)."""
    correct = torch.ones(steps, 1, 8, dtype=torch.bool)
    valid = torch.zeros(steps, 1, 8, dtype=torch.bool)
    valid[:reached] = True
    return correct, valid


def test_a_position_no_chain_reached_is_unmeasured_not_zero():
    """Positions 5-6 of tiny data read cond_acc 0.0 in every row and the accept length stopped
    there as if the drafter were never right: they are None, and the accept length says it
    counts the measured positions only."""
    s = obj.summarize(obj.chain_counts(*_short_chains(7, 5)))
    assert s["cond_acc"] == [1.0] * 5 + [None, None]
    assert s["acc"] == [1.0] * 5 + [None, None]
    assert s["accept_length"] == 6.0
    assert obj.measured_words(s["cond_acc"]) == "positions 0..4 of 7 measured"
    assert json.loads(json.dumps(s))["cond_acc"][5] is None  # null in train_log.jsonl
    # every chain rejected at position 0: nothing can reach 1, and the length 1.0 is exact
    c, v = torch.zeros(3, 1, 8, dtype=torch.bool), torch.ones(3, 1, 8, dtype=torch.bool)
    s = obj.summarize(obj.chain_counts(c, v))
    assert s["cond_acc"] == [0.0, None, None] and s["accept_length"] == 1.0
    assert not obj.cut_short(s["cond_acc"]) and obj.measured_words(s["cond_acc"]) == ""
    # nothing measured at all (a window that trained nothing)
    assert obj.measured_words([None, None]) == "no position of 2 measured"
    assert obj.accept_length([None, None]) == 1.0 and obj.accept_length([0.5, 0.5]) == 1.75


def test_the_loops_line_says_where_the_accept_length_stops(tmp_path):
    """The line printed per logged step showed a measured-looking accept length; a window of
    no position (acc0 None) is '-', not a TypeError."""
    from draftsmith.train.loop import Trainer, Window

    def fake(counts: torch.Tensor) -> SimpleNamespace:
        w = Window(counts.shape[1])
        w.n, w.loss, w.seconds, w.counts = 1, 2.0, 1.0, counts
        return SimpleNamespace(window=w, step=1, plan=SimpleNamespace(locate=lambda s: (0, 0)),
                               ctx=SimpleNamespace(world=1, main=True), out=tmp_path,
                               watched=True, tokens=0,
                               cfg=SimpleNamespace(ttt_steps=counts.shape[1]))

    line = Trainer._log(fake(obj.chain_counts(*_short_chains(4, 2))))
    assert "acc0 1.000 accept 3.00 (positions 0..1 of 4 measured) cover" in line
    line = Trainer._log(fake(torch.zeros(4, 3, dtype=torch.float64)))
    assert "acc0 - accept 1.00 (no position of 3 measured) cover" in line
    rows = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert rows[0]["cond_acc"] == [1.0, 1.0, None, None] and rows[1]["acc"] == [None] * 3


def test_the_plot_draws_unmeasured_points_as_gaps(tmp_path):
    from draftsmith.train.report import PLOT, plot

    rows = [{"step": 1, "loss": 3.0, "acc": [0.5, None], "cond_acc": [0.5, None],
             "accept_length": 1.5},
            {"step": 2, "loss": 2.0, "acc": [0.6, 0.0], "cond_acc": [0.6, 0.0],  # an old row
             "accept_length": 1.6, "coverage": 0.9}]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot(tmp_path) == tmp_path / PLOT and (tmp_path / PLOT).stat().st_size > 0


def _log(folder: Path, cond: list, accept: float) -> Path:
    rows = [{"step": s, "cond_acc": cond, "accept_length": accept} for s in (10, 20)]
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_doctors_promise_stops_where_the_log_measured(tmp_path):
    """A log of unmeasured positions crashed the doctor's table (None:.1%) and its promise; the
    promise is now the measured positions', and says so."""
    from draftsmith.doctor.behaviour import (
        gap_findings,
        promise_words,
        promised,
        promised_length,
    )
    from draftsmith.doctor.render import behaviour_table

    promise = promised(_log(tmp_path, [0.8, 0.5, None, None], 2.2))
    assert promise["cond_acc"] == [0.8, 0.5, None, None]
    assert promised_length(promise, 4) == pytest.approx(2.2)
    words = promise_words(promise, 4)
    assert "no chain in those rows reached position 2" in words
    assert "counts positions 0..1 only" in words
    run = {"position_rates": [0.8, 0.5, None, None], "reached": [100, 80, 0, 0],
           "accepted": [80, 40, 0, 0], "mean_accept_length": 2.2, "tokens_per_s": 1.0,
           "aux_layer_ids": [1, 2, 3]}
    b = {"runs": {"as configured": run}, "prompts": 2, "promised": promise, "draft_steps": 4}
    tab = behaviour_table(b)
    promised_col = list(tab.columns[1].cells)
    assert promised_col[2] == "-" and promised_col[4] == "2.20 (positions 0..1)"
    assert gap_findings({"as configured": run}, promise, "d") == []
    # a log whose last rows measured no position: an info finding, not a TypeError
    nothing = {"cond_acc": [None, None], "accept_length": 1.0}
    assert promised_length(nothing, 2) is None
    (f,) = gap_findings({"as configured": run}, nothing, "d")
    assert f.severity == "info" and "promise nothing" in f.what


def test_an_old_log_with_zeros_still_reads(tmp_path):
    from draftsmith.doctor.behaviour import promise_words, promised, promised_length

    promise = promised(_log(tmp_path, [0.8, 0.0, 0.0], 1.8))
    assert promise["cond_acc"] == [0.8, 0.0, 0.0]
    assert promised_length(promise, 3) == pytest.approx(1.8)
    assert "only" not in promise_words(promise, 3)


def test_rows_are_averaged_over_those_that_measured_a_position(tmp_path):
    from draftsmith.doctor.behaviour import promised

    rows = [{"step": 1, "cond_acc": [0.6, 0.4], "accept_length": 1.8},
            {"step": 2, "cond_acc": [0.8, None], "accept_length": 1.8}]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert promised(tmp_path)["cond_acc"] == [pytest.approx(0.7), 0.4]


def test_compare_says_where_the_logged_accept_length_stops():
    from draftsmith.compare.report import _data

    ds = [{"data": None, "training": {"last_accept_length": 1.9,
                                      "last_cond_acc": [0.9, None]}},
          {"data": None, "training": {"last_accept_length": 1.5, "last_cond_acc": [0.5, 0.0]}}]
    rows = {r[0]: r[1:] for r in _data(ds)}
    assert rows["training last_accept_length"] == ["1.9 (positions 0..0 of 2 measured)", "1.5"]
    assert rows["training last_cond_acc"] == ["0.9, -", "0.5, 0"]


def _sglang(target, root: Path, name: str, edit) -> Path:
    folder = specforge_folder(build(target, 128, 32, [0, 2, 4], 0), root / name, [2, 3, 4])
    w = load_file(folder / "model.safetensors")
    del w["lm_head.weight"]
    save_file(w, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_tied_sglang_folders_lm_head_is_the_embedding(target, tmp_path):
    """SGLang's LlamaForCausalLMEagle3 with tie_word_embeddings serves its embedding module as
    lm_head; compare counted that lm_head as 0 parameters."""
    from draftsmith.compare import CompareOptions, run_compare
    from draftsmith.compare.describe import describe

    tied = _sglang(target, tmp_path, "tied", lambda c: c.update(tie_word_embeddings=True))
    p = describe(tied, "tied").params
    assert p.lm_head == V * H and p.lm_head_source == "tied"
    assert p.all == p.core + V * H and p.trainable == p.core  # one tensor, frozen
    from_target = _sglang(target, tmp_path, "head", lambda c: c.pop("draft_vocab_size"))
    q = describe(from_target, "head").params
    assert q.lm_head == V * H and q.lm_head_source == "target"
    assert q.trainable == q.core + V * H and q.all == q.trainable + V * H
    plain = shutil.copytree(tied, tmp_path / "plain")
    (plain / "config.json").write_text((from_target / "config.json").read_text().replace(
        '"hidden_act"', '"draft_vocab_size": 32, "hidden_act"'))
    assert describe(plain, "plain").params.lm_head == 0  # a folder that truly holds none
    res = run_compare(CompareOptions([str(tied), str(from_target)], out=tmp_path / "out"))
    md = (tmp_path / "out" / "compare.md").read_text()
    assert f"| lm_head (as the engine serves it) | {V * H:,} (tied: the embedding" in md
    assert "(the target's lm_head, not stored" in md
    assert res["drafters"][0]["params"]["lm_head_source"] == "tied"


def test_the_doctors_tables_print_paths_as_text(tmp_path):
    """A folder named exp[v2] lost its "[v2]" in the doctor's tables and lines (rich markup),
    and one holding "[/x]" stopped the report with a MarkupError traceback."""
    from io import StringIO

    from rich.console import Console

    from draftsmith.doctor.render import show
    from draftsmith.doctor.report import Finding, Report

    folder = "/runs/exp[v2]/a[/x]"
    rep = Report(context={"target": {"source": folder}, "drafter": {"folder": folder}},
                 skipped=[f"behaviour: {folder} holds no train_log.jsonl"],
                 engines=[{"engine": "sglang", "key": "eagle_config[ids]", "feed": {}}])
    rep.add("behaviour", [Finding("warning", "behaviour", f"{folder}: a gap", folder, "[/x]")])
    out = StringIO()
    show(rep, Console(file=out, width=400))
    text = out.getvalue()
    assert text.count(folder) == 5 and "eagle_config[ids]" in text
