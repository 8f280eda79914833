"""Review of a new user's `data make` walkthrough: a self-made round said nothing while it
decoded, ctrl-C in the prompts or capture stage was silent (and left an empty prompts file),
a capture of an unrelated input pointed at --grow, `data vocab` named the vocab's maker by
guess and a grown `data make` replaced it silently, and users were shown Python dicts."""

from __future__ import annotations

import json

import pytest
from test_data_capture import CFG, convs
from typer.testing import CliRunner

from draftsmith.data import progress
from draftsmith.data.capture import capture
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.errors import DraftsmithError

SMALL = MagpieConfig(n=2, batch_size=3, max_new_tokens=6, min_chars=1)


def _lines(monkeypatch) -> list[str]:
    """Progress as off a terminal (plain lines), the lines said collected."""
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    return []


# --- 1. a round says what it decodes ----------------------------------------------------------


def test_each_round_says_what_it_decodes_before_it_decodes(target, model, tmp_path,
                                                           monkeypatch):
    said = _lines(monkeypatch)
    from draftsmith.engine import generate

    real = generate.run_generation

    def run(*a, **k):  # the line comes before the round's (long) decode
        assert any("round 1: decoding 3 rows x up to 6 tokens" in s for s in said), said
        return real(*a, **k)

    monkeypatch.setattr(generate, "run_generation", run)
    self_made_prompts(target, tmp_path / "p.jsonl", SMALL, model, log=said.append)
    assert said[0] == "prompts: round 1: decoding 3 rows x up to 6 tokens"


def test_make_help_says_a_round_decodes_batch_size_rows_whatever_n():
    from draftsmith.data.cli import app

    res = CliRunner().invoke(app, ["make", "--help"], terminal_width=200)
    text = " ".join(res.output.split())
    assert "each round decodes --batch-size rows of up to --prompt-tokens tokens, whatever --n" \
        in text
    assert "--max-new-tokens tokens at most" in text
    res = CliRunner().invoke(app, ["prompts", "--help"], terminal_width=200)
    assert "rounds of --batch-size rows of up to --max-new-tokens tokens, whatever N" in \
        " ".join(res.output.split())


# --- 2. ctrl-C says what is kept; no empty file left ------------------------------------------


def _interrupt(*a, **k):
    raise KeyboardInterrupt


def test_ctrl_c_in_the_first_round_leaves_no_empty_prompts_file(target, model, tmp_path,
                                                                monkeypatch):
    from draftsmith.engine import generate

    monkeypatch.setattr(generate, "run_generation", _interrupt)
    said: list[str] = []
    out = tmp_path / "p.jsonl"
    with pytest.raises(KeyboardInterrupt):
        self_made_prompts(target, out, SMALL, model, progress=False, log=said.append)
    assert not out.exists()
    assert said == [f"prompts: stopped (ctrl-C): no prompt was made yet, {out} is not kept; a "
                    "rerun of the same command starts it"]


def test_ctrl_c_after_a_round_keeps_its_prompts_and_says_a_rerun_resumes(target, model, tmp_path,
                                                                        monkeypatch):
    from draftsmith.engine import generate

    out = tmp_path / "p.jsonl"
    self_made_prompts(target, out, SMALL, model, progress=False, log=lambda s: None)
    before = out.read_bytes()
    monkeypatch.setattr(generate, "run_generation", _interrupt)
    said: list[str] = []
    more = MagpieConfig(n=40, batch_size=3, max_new_tokens=6, min_chars=1)
    with pytest.raises(KeyboardInterrupt):
        self_made_prompts(target, out, more, model, progress=False, log=said.append)
    assert out.read_bytes() == before
    assert said == [f"prompts: stopped (ctrl-C): {out} keeps the 2 prompts made before; a rerun "
                    "of the same command resumes after them"]


def test_ctrl_c_in_capture_says_the_shards_kept_and_that_a_rerun_resumes(target, model, tmp_path,
                                                                        monkeypatch):
    from draftsmith.data import capture as cap

    real, calls = cap.forward_shard, []

    def forward(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(cap, "forward_shard", forward)
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        capture(target, convs(8), tmp_path, CFG, progress=False, model=model, log=said.append)
    assert said[-1] == (f"capture: stopped (ctrl-C): {tmp_path} keeps the 1 shard(s) finished "
                        "(4 samples); a rerun of the same command captures the rest")
    monkeypatch.setattr(cap, "forward_shard", real)
    m = capture(target, convs(8), tmp_path, CFG, progress=False, model=model, log=lambda s: None)
    assert m["totals"]["samples"] == 8


# --- 3. --grow pointed at only where the input grew -------------------------------------------


def test_an_unrelated_input_is_named_so_and_not_pointed_at_grow(target, model, tmp_path):
    capture(target, convs(6), tmp_path, CFG, progress=False, model=model, log=lambda s: None)
    other = convs(12)[6:]
    with pytest.raises(DraftsmithError) as e:
        capture(target, other, tmp_path, CFG, progress=False, model=model, log=lambda s: None)
    msg = str(e.value)
    assert "(6 there, 6 in this input, not an extension of those" in msg
    assert "--grow" not in msg and msg.endswith("use another folder or --overwrite")


# --- 4. the vocab's maker, and a grown make's new vocab ---------------------------------------


def test_data_vocab_names_the_vocab_by_its_recorded_maker(tmp_path):
    import torch

    from draftsmith.data.cli import app
    from draftsmith.data.vocab import build_vocab, save_vocab

    save_vocab(build_vocab(torch.tensor([3, 0, 2, 1]), 2), tmp_path,
               {"command": "draftsmith data vocab x.jsonl --size 2"})
    src = tmp_path / "x.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    res = CliRunner().invoke(app, ["vocab", str(src)])
    assert res.exit_code != 0
    msg = str(res.exception)
    assert "made by `draftsmith data vocab x.jsonl --size 2`" in msg and "data make's" not in msg
    (tmp_path / "vocab.json").unlink()  # nothing recorded: no maker guessed
    msg = str(CliRunner().invoke(app, ["vocab", str(src)]).exception)
    assert "exists (a drafter may have been trained on it with --vocab)" in msg


def test_a_grown_make_says_its_vocab_changed(target, model, tmp_path):
    import torch

    from draftsmith.data.pipeline import _vocab
    from draftsmith.data.vocab import build_vocab, save_vocab, vocab_json

    capture(target, convs(6), tmp_path, CFG, progress=False, model=model, log=lambda s: None)
    vocab = target.cfg.vocab_size
    save_vocab(build_vocab(torch.arange(vocab), 3, vocab), tmp_path)  # the older run's
    said: list[str] = []
    new = _vocab(tmp_path, 8, vocab, said.append, "draftsmith data make d --n 6")
    assert said[0] == (f"vocab: {tmp_path / 'vocab.safetensors'} replaced: 3 -> "
                       f"{new['draft_vocab_size']} draft tokens, counted on this run's data (a "
                       "drafter trained with --vocab on the old one used another vocabulary)")
    assert vocab_json(tmp_path)["command"] == "draftsmith data make d --n 6"
    said.clear()
    _vocab(tmp_path, 8, vocab, said.append)  # the same vocabulary again: nothing to say
    assert not any("replaced" in s for s in said)


# --- 5. words, not Python structures ----------------------------------------------------------


def test_another_sampling_is_named_by_its_flags():
    from draftsmith.data.regenerate import _differs

    there = {"temperature": 0.0, "top_p": 0.95, "top_k": 0, "max_new_tokens": 32, "seed": 0}
    now = {**there, "temperature": 0.8}
    diff = _differs({"model": "m", "sampling": there}, {"model": "m", "sampling": now})
    assert diff == ["sampled with --temperature 0 (greedy), this run with --temperature 0.8"]


def test_inspect_says_none_for_no_skipped_input(target, model, tmp_path):
    from draftsmith.data.cli import describe
    from draftsmith.data.shards import Dataset

    capture(target, convs(4), tmp_path, CFG, progress=False, model=model, log=lambda s: None)
    assert describe(Dataset(tmp_path))["skipped inputs"] == "none"
