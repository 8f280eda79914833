"""A dataset is captured one way: every answer turn as the target's decoded ids, or every one
tokenized from its text. A resume or grow over the other kind of answers file is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import MANIFEST, read_manifest, verify
from draftsmith.errors import DraftsmithError

CFG = CaptureConfig(aux_layer_ids=[-1, 1, 4], batch_size=4, samples_per_shard=2, max_len=120)


def convs(tok, n: int, ids: bool) -> list[Conversation]:
    """`n` one-turn conversations; `ids`: the answers file records the target's ids (here the
    text's own tokens, so only how they were taken differs)."""
    out = []
    for i in range(n):
        answer = f"answer {i}."
        msgs = [{"role": "user", "content": f"question {i}?"},
                {"role": "assistant", "content": answer}]
        rec = {"turn": 0, "finish": "stop"}
        if ids:
            rec["ids"] = tok(answer, add_special_tokens=False)["input_ids"]
        out.append(Conversation(msgs, meta={"answers": [rec]}))
    return out


def run(target, model, cs, out: Path, **kw):
    return capture(target, cs, out, CFG, progress=False, model=model, log=lambda s: None, **kw)


def as_older(out: Path, keep_tally: bool = False) -> None:
    """The manifest as an older draftsmith wrote it: no answer_tokens (and, before the tally,
    no input.answers); one shard left to write, so a rerun has work."""
    m = json.loads((out / MANIFEST).read_text())
    m.pop("answer_tokens", None)
    if not keep_tally:
        m["input"].pop("answers", None)
    m["shards"] = m["shards"][:-1]
    m["complete"] = False
    (out / MANIFEST).write_text(json.dumps(m))


def test_the_manifest_records_how_the_answers_were_taken(target, model, tmp_path):
    tok = target.tokenizer
    assert run(target, model, convs(tok, 3, True), tmp_path / "a")["answer_tokens"] == "target_ids"
    assert run(target, model, convs(tok, 3, False), tmp_path / "b")["answer_tokens"] == "text"


def test_an_older_text_dataset_resumed_over_ids_is_refused(target, model, tmp_path):
    tok = target.tokenizer
    run(target, model, convs(tok, 4, False), tmp_path)
    as_older(tmp_path)
    with pytest.raises(DraftsmithError, match="tokenized from their text.*the target.s decoded ids"
                       ) as e:
        run(target, model, convs(tok, 4, True), tmp_path)
    assert "\n" not in str(e.value) and "--overwrite" in str(e.value)
    assert len(read_manifest(tmp_path)["shards"]) == 1  # nothing written


def test_an_older_text_dataset_grown_over_ids_is_refused(target, model, tmp_path):
    tok = target.tokenizer
    run(target, model, convs(tok, 4, False), tmp_path)
    as_older(tmp_path)
    redo = f"delete {tmp_path} to capture it again"
    with pytest.raises(DraftsmithError, match=f"mix the two; {redo}"):
        run(target, model, convs(tok, 8, True), tmp_path, grow=True, redo=redo)
    assert read_manifest(tmp_path)["expected"]["samples"] == 4  # not adopted


def test_an_ids_dataset_resumed_over_text_is_refused(target, model, tmp_path):
    tok = target.tokenizer
    run(target, model, convs(tok, 4, True), tmp_path)
    with pytest.raises(DraftsmithError,
                       match="are the target.s decoded ids.*are tokenized from their text"):
        run(target, model, convs(tok, 6, False), tmp_path, grow=True)


def test_an_older_dataset_resumed_or_grown_over_text_is_accepted(target, model, tmp_path):
    tok = target.tokenizer
    run(target, model, convs(tok, 4, False), tmp_path)
    as_older(tmp_path)
    m = run(target, model, convs(tok, 4, False), tmp_path)
    assert m["complete"] and m["totals"]["samples"] == 4 and m["answer_tokens"] == "text"
    as_older(tmp_path)
    m = run(target, model, convs(tok, 6, False), tmp_path, grow=True)
    assert m["totals"]["samples"] == 6 and m["answer_tokens"] == "text" and verify(tmp_path)


def test_a_dataset_of_ids_without_the_field_resumed_over_ids_is_accepted(target, model,
                                                                          tmp_path):
    """This week's manifests tally the answers (`input.answers`) without answer_tokens."""
    tok = target.tokenizer
    run(target, model, convs(tok, 4, True), tmp_path)
    as_older(tmp_path, keep_tally=True)
    m = run(target, model, convs(tok, 4, True), tmp_path)
    assert m["complete"] and m["answer_tokens"] == "target_ids"


def test_ranks_over_other_answers_do_not_merge(target, model, tmp_path, monkeypatch):
    tok = target.tokenizer
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run(target, model, convs(tok, 4, True), tmp_path)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DraftsmithError, match="answer_tokens 'text' against 'target_ids'"):
        run(target, model, convs(tok, 4, False), tmp_path)
