"""Prompt files in the shapes people have: ShareGPT turns keyed `role`/`content` (and OpenAI
messages keyed `from`/`value`) were refused as `unknown from None`, and UltraChat's `data`
lists (alternating user and assistant texts) as having no known key."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.data.prompts import load_prompts


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_sharegpt_turns_keyed_role_and_content_are_read(tmp_path: Path) -> None:
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "a"}]
    path = _jsonl(tmp_path / "p.jsonl", [
        {"conversations": turns},
        {"messages": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
    ])
    ps = load_prompts(path)
    assert ps.problems == []
    assert [c.messages for c in ps.conversations] == [
        turns, [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]]


def test_a_turn_with_no_role_is_named_with_the_keys_expected(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"conversations": [{"speaker": "user", "text": "q"}]}])
    assert load_prompts(path).problems == [
        f"{path}:1: message 0: no 'from' or 'role' (keys: speaker, text)"]


def test_ultrachat_data_lists_are_alternating_turns(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "u.jsonl", [
        {"id": "0", "data": ["q1", "a1", "q2", "a2"]},
        {"id": "1", "data": ["q1", 5]},
        {"id": "2", "data": []},
    ])
    ps = load_prompts(path)
    assert [c.messages for c in ps.conversations] == [[
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]]
    assert ps.problems == [f"{path}:2: 'data' item 1 is not a string (UltraChat's 'data': "
                           "user and assistant texts in turn)",
                           f"{path}:3: 'data' holds no text (UltraChat's 'data': user and "
                           "assistant texts in turn)"]


# Self-made questions: a control token of the chat template the target wrote inside its question
# (`<|im_start|>assistant`: it left the user's turn) was dropped by the decode, the words after it
# kept as part of the question; a question of such tokens alone counted as too short.

def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _stats() -> dict[str, int]:
    return dict.fromkeys(("unfinished", "bare_openings", "duplicates", "length_filtered",
                          "template_tokens"), 0)


def test_a_question_holding_the_templates_tokens_is_dropped_and_counted(target) -> None:
    from draftsmith.data.selfmade import MagpieConfig, _one

    tok, cfg = target.tokenizer, MagpieConfig(min_chars=1)
    start = _ids(tok, "<|im_start|>user\n")
    for junk in ("<|im_start|>", "<s><pad>what", " <unk>"):
        stats = _stats()
        assert _one(target, _ids(tok, junk), cfg, set(), stats, "", start) is None, junk
        assert stats == _stats() | {"template_tokens": 1}, junk
    for asked in ("What is 2+2?", "What is 2+2?<|im_start|>assistant\n4", "What is 2+2?<s>"):
        stats = _stats()
        assert _one(target, _ids(tok, asked), cfg, set(), stats, "", start) == "What is 2+2?"
        assert stats == _stats(), asked


def test_template_tokens_past_a_closing_of_several_tokens_are_no_junk(target) -> None:
    from draftsmith.data.selfmade import MagpieConfig, _one

    tok, cfg = target.tokenizer, MagpieConfig(min_chars=1)
    toks = _ids(tok, "Sort [3, 1] [/INST] Sure<|im_start|>")
    stats = _stats()
    assert _one(target, toks, cfg, set(), stats, "", _ids(tok, "[INST] "), "[/INST]") \
        == "Sort [3, 1]"
    assert stats == _stats()


def test_a_run_counts_them_and_a_short_run_says_so(target, model, tmp_path: Path) -> None:
    from draftsmith.data.selfmade import MagpieConfig, self_made_prompts

    said: list[str] = []
    cfg = MagpieConfig(n=40, batch_size=8, max_new_tokens=60, min_chars=1, max_batches=2)
    stats = self_made_prompts(target, tmp_path / "p.jsonl", cfg, model, progress=False,
                              log=said.append)
    assert stats["template_tokens"] > 0  # a tiny random target writes them often
    assert f"{stats['template_tokens']} holding the chat template's tokens" in said[-1]
