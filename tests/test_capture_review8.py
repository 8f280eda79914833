"""Capture, eighth review: a run of no sample whose --max-len the target's positions held told
to raise --max-len (which cannot help); a resume after ctrl-C of multi-turn conversations, one
past the context, equal to an uninterrupted run; --aux-layers in each accepted form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_review import run_main
from test_cli_review2 import prompts_file

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import Dataset
from draftsmith.errors import DraftsmithError

LONG = "x" * 600  # past the tiny llama's 512 positions (one token a character)


def turns(*texts: str) -> Conversation:
    roles = ("user", "assistant")
    return Conversation([{"role": roles[k % 2], "content": t} for k, t in enumerate(texts)])


def run(target, model, out: Path, cs: list[Conversation], cfg: CaptureConfig, **kw) -> dict:
    return capture(target, cs, out, cfg, progress=False, model=model, log=lambda s: None, **kw)


@pytest.mark.parametrize("cs, too_long, reason", [
    ([turns("q?", LONG)], "skip", "too_long"),
    ([turns(LONG, "a.")], "truncate", "answer_past_max_len"),
])
def test_a_run_held_to_the_targets_positions_is_not_told_to_raise_max_len(
        target, tmp_path, cs, too_long, reason):
    """--max-len 2048 is held to the target's 512 positions; the fix read "raise --max-len",
    which changes nothing."""
    cfg = CaptureConfig(aux_layer_ids=[0], max_len=2048, too_long=too_long)
    with pytest.raises(DraftsmithError) as e:
        run(target, None, tmp_path / "d", cs, cfg)
    said = str(e.value)
    assert f"(skipped: 1 {reason})" in said and "raise --max-len" not in said
    assert "512 positions (max_position_embeddings)" in said
    assert not (tmp_path / "d").exists()


def test_a_resume_after_ctrl_c_equals_an_uninterrupted_capture(target, model, tmp_path):
    """Multi-turn conversations (only answer tokens trained) and one past the context."""
    cs = [turns(f"q{i}?" + " more" * i, f"a{i}.", "again?", "yes " * i) for i in range(5)]
    cs.append(turns("q?", LONG))
    cfg = CaptureConfig(aux_layer_ids=[-1, 2, 5], batch_size=2, samples_per_shard=2)
    whole = run(target, model, tmp_path / "whole", cs, cfg)

    def stop(k: int) -> None:
        if k == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(target, model, tmp_path / "cut", cs, cfg, on_shard=stop)
    assert len(json.loads((tmp_path / "cut/manifest.json").read_text())["shards"]) == 2
    assert run(target, model, tmp_path / "cut", cs, cfg) == whole
    for f in sorted((tmp_path / "whole").iterdir()):
        assert (tmp_path / "cut" / f.name).read_bytes() == f.read_bytes(), f.name
    ds, tok = Dataset(tmp_path / "whole"), target.tokenizer
    assert max(ds.lengths()) == 512 and whole["max_len"] == 512
    ids, mask = ds.tokens(0)
    trained = tok.decode(ids[mask].tolist())
    assert trained.replace("<|im_end|>", "|") == "a0.||"  # two answers, each with its end


@pytest.mark.parametrize("form", [["--aux-layers", "-1,0,5"], ["--aux-layers=-1,0,5"],
                                  ["--aux-layers", " -1, 0, 5 "]])
def test_aux_layers_in_each_accepted_form(monkeypatch, capsys, tmp_path, tiny_llama_dir, form):
    src, out = prompts_file(tmp_path / "c.jsonl", 2, answered=True), tmp_path / "ds"
    code, _, err = run_main(monkeypatch, capsys, "data", "capture", str(src), "-o", str(out),
                            "--target", str(tiny_llama_dir), "--device", "cpu", *form)
    assert code == 0, err
    m = json.loads((out / "manifest.json").read_text())
    assert m["aux_layer_ids"] == Dataset(out).aux_layer_ids == [-1, 0, 5]
