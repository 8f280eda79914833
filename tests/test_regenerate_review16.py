"""Regenerate review 16: the built-in engine asks a later turn after the ids it decoded for the
earlier answers, which capture splices in place of their text's tokens (the target's context for
turn 2 is what capture trains on), measured so against --max-len; and a rerun's failed
conversations said to be written after the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.data.prompts import Conversation, encode_conversation, parse_record
from draftsmith.data.prompts import read_jsonl_tail_safe as read
from draftsmith.data.regenerate import (
    EngineBackend,
    RegenConfig,
    _counter,
    failed_words,
    regenerate,
)


def quiet(_: str) -> None:
    pass


def two_turns(n: int) -> list[Conversation]:
    return [parse_record({"turns": [f"q{i} a?", f"q{i} b?"]}) for i in range(n)]


@pytest.mark.parametrize("refill", [True, False])
def test_a_later_turn_is_asked_after_the_ids_capture_splices(target, model, tmp_path,
                                                            monkeypatch, refill):
    """A sampled answer holds special tokens and spaces at its ends that its stripped text does
    not: asked from the text, turn 2 followed another context than capture's samples hold."""
    import draftsmith.engine.generate as G
    import draftsmith.engine.refill as R

    seen: list[list[int]] = []

    def spy(fn):
        def run(rt, prompts, *a, **k):
            seen.extend(list(p) for p in prompts)
            return fn(rt, prompts, *a, **k)
        return run

    monkeypatch.setattr(R, "generate_refill", spy(R.generate_refill))
    monkeypatch.setattr(G, "run_generation", spy(G.run_generation))
    cfg = RegenConfig(max_new_tokens=12, max_len=256, batch_size=2, temperature=1.0,
                      refill=refill)
    out, tok = tmp_path / "a.jsonl", target.tokenizer
    regenerate(two_turns(6), out, EngineBackend(target, model, cfg), tok, cfg, False, quiet)
    recs, texts_differ = read(out), 0
    assert len(recs) == 6
    for r in recs:
        conv = Conversation(r["messages"], r["id"], r["meta"])
        ids, _ = encode_conversation(tok, conv)  # as capture builds the sample
        later = [p for p in seen if ids[: len(p)] == p and len(p) > len(seen[0]) // 2
                 and tok.decode(p).endswith(f"{r['messages'][2]['content']}<|im_end|>\n"
                                            "<|im_start|>assistant\n")]
        assert len(later) == 1, r["messages"]
        second = r["meta"]["answers"][1]["ids"]
        assert ids[len(later[0]) : len(later[0]) + len(second)] == second
        texts_differ += target.chat_ids(r["messages"][:3], True) != later[0]
    assert texts_differ  # the text's tokens are another context: the case is met


def test_the_limit_counts_the_prompt_the_engine_asks(target) -> None:
    from draftsmith.data.regenerate import prompt_ids

    tok = target.tokenizer
    said = tok(" ab ", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<s>")]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"},
            {"role": "user", "content": "r"}]
    spliced = prompt_ids(tok, msgs, {1: said})
    assert spliced != target.chat_ids(msgs, True)
    assert tok.decode(spliced).count(" ab <s>") == 1
    assert _counter(tok, True)(msgs, {1: said}) == len(spliced)
    assert _counter(tok, False)(msgs, {1: said}) == len(target.chat_ids(msgs, True))
    assert prompt_ids(tok, msgs, {}) == target.chat_ids(msgs, True)


def test_failed_words_say_the_failed_ones_are_written_after_the_others(tmp_path: Path) -> None:
    stats = {"done_before": 0, "answered": 2, "failed": 1, "refused_by_server": 0}
    words = failed_words(stats, tmp_path / "a.jsonl", "http://h:1/v1")
    assert "rerun the same command to ask the failed ones again" in words
    assert "after the others" in words, words
