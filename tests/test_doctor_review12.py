"""Doctor review 12: --prompts refused as a count in one line, the draft vocab's coverage named
as what it counts (and the dataset's own vocab where the drafter does not use it), and the
findings table readable at 80 columns."""

from __future__ import annotations

import shutil
import warnings

import pytest
import test_doctor as td
import torch
import typer
from typer.testing import CliRunner

from draftsmith.doctor import Finding, Report
from draftsmith.doctor import doctor as command
from draftsmith.doctor.checks import _coverage
from draftsmith.errors import DraftsmithError

target_dir, target, data_dir = td.target_dir, td.target, td.data_dir


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)
    return app


@pytest.mark.parametrize("value", ["chat", "prompts.jsonl", "2.5"])
def test_prompts_that_are_no_count_get_one_clear_line(monkeypatch, value):
    """`doctor --prompts chat` (compare's and tune's suite) gave click's "Input should be a
    valid integer", not what --prompts takes here."""
    monkeypatch.setattr("draftsmith.doctor.run_doctor", lambda opts: pytest.fail("ran"))
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", "--prompts", value])
    assert isinstance(res.exception, DraftsmithError), res.output
    assert str(res.exception).startswith(
        f"--prompts takes a number of prompts for the short run, got {value!r}; ")
    assert "\n" not in str(res.exception)


def test_prompts_as_a_count_still_reaches_the_run(monkeypatch):
    seen = {}
    monkeypatch.setattr("draftsmith.doctor.run_doctor",
                        lambda opts: seen.setdefault("n", opts.prompts) and Report())
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", "--prompts", "7"])
    assert res.exit_code == 0, res.output
    assert seen["n"] == 7
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", "--prompts", "0"])
    assert str(res.exception) == "--prompts must be >= 1, got 0"
    res = CliRunner().invoke(_app(), ["doctor", "--data", "x", "--prompts", "4"])
    assert res.exception is None or "--prompts" not in str(res.exception)  # its default


def test_prompts_help_says_it_is_a_count():
    res = CliRunner().invoke(_app(), ["doctor", "--help"], env={"COLUMNS": "200"})
    line = next(x for x in res.output.splitlines() if "--prompts" in x)
    assert "a count" in line


def test_coverage_names_what_it_counts_and_the_datasets_own_vocab(target, data_dir,
                                                                   tmp_path):
    """"covers 58.3% of the data's assistant tokens" beside `data make`'s 100% of the same
    tokens read as a contradiction: the drafter's vocab was another than the dataset's."""
    from draftsmith.data.vocab import build_vocab, count_dataset, save_vocab

    vocab = target.cfg.vocab_size
    counts = count_dataset(data_dir, vocab)
    small = counts.nonzero().flatten()[:3]  # a drafter of 3 draft tokens
    (f,) = _coverage(small, vocab, data_dir)
    total = int(counts.sum())
    assert f.what.startswith("the drafter's draft vocab (3 tokens) holds ")
    assert f"of the {total} loss-masked (assistant) tokens in {data_dir}'s shards" in f.what
    assert "cover(target) counts the target's own next tokens" in f.what
    assert f.fix == "train with a larger --draft-vocab-size"
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fewer distinct tokens than 32000
        save_vocab(build_vocab(counts, 32000, vocab), data)  # what `data make` writes
    (f,) = _coverage(small, vocab, data)
    assert "the drafter does not use the dataset's own vocab.safetensors" in f.what
    assert "100.0% of them, the figure `data make` printed" in f.what
    assert f.fix == f"train with --vocab {data / 'vocab.safetensors'}, or a larger " \
                    "--draft-vocab-size"
    whole = counts.nonzero().flatten()
    assert _coverage(whole, vocab, data) == []
    assert _coverage(torch.cat([small, whole[3:]]), vocab, data) == []


LONG = ("id -1 needs vLLM id 0; vLLM aux layer id 0 (the embedding output) fails on vLLM "
        "versions before 0.11 whose capture hook reads layer outputs only, so the drafter "
        "gets another layer's states than it was trained on and accepts far fewer tokens")
FIX = "serve it with newer vLLM model files, or retrain on ids 1, 3, 5 which every engine takes"


def test_findings_table_is_readable_at_80_columns(monkeypatch):
    """Five folded columns ran one finding's cell over ~30 lines at 80 columns."""
    rep = Report()
    rep.add("capturable", [Finding("warning", "capturable", LONG, "/w/d2/config.json", FIX)])
    rep.add("wiring: drafter vs its training data",
            [Finding("info", "wiring: drafter vs its training data", "short", "x")])
    monkeypatch.setattr("draftsmith.doctor.run_doctor", lambda opts: rep)
    res = CliRunner().invoke(_app(), ["doctor", "--drafter", "d", "--no-run"],
                             env={"COLUMNS": "80"})
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 80
    table = lines[lines.index(next(x for x in lines if "findings" in x)):]
    first = table[3:table.index(next(x for x in table[3:] if x.startswith("├")))]
    assert len(first) <= 10, "\n".join(first)
    words = set(" ".join(x.replace("│", " ") for x in lines).split())
    assert set((LONG + " " + FIX + " /w/d2/config.json").split()) <= words
    assert "where:" in words and "fix:" in words
