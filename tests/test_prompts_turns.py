"""MT-bench's and Spec-Bench's question files (`{"question_id", "category", "turns": [...]}`):
each record a conversation of its user turns, bench asking the first, regenerate answering all."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from draftsmith.bench.suites import suite_messages
from draftsmith.data.prompts import load_prompts, read_jsonl_tail_safe
from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate
from draftsmith.errors import DraftsmithError

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]},
    {"question_id": 82, "category": "math", "turns": ["What is 2 + 2?"]},
]


def question_file(tmp_path: Path, records: list) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_each_question_reads_as_its_user_turns(tmp_path: Path) -> None:
    convs = load_prompts(question_file(tmp_path, QUESTIONS), strict=True).conversations
    assert [c.messages for c in convs] == [
        [{"role": "user", "content": "Write a haiku."},
         {"role": "user", "content": "Now a limerick."}],
        [{"role": "user", "content": "What is 2 + 2?"}],
    ]


def test_bench_asks_each_question_its_first_turn(tmp_path: Path) -> None:
    got = suite_messages(str(question_file(tmp_path, QUESTIONS)), 0)
    assert got == [[{"role": "user", "content": "Write a haiku."}],
                   [{"role": "user", "content": "What is 2 + 2?"}]]


@pytest.mark.parametrize(("turns", "why"), [
    ([], "'turns' is not a non-empty list"),
    ("Write a haiku.", "'turns' is not a non-empty list"),
    (["Write a haiku.", 3], "'turns[1]' is not a non-empty string"),
    (["  "], "'turns[0]' is not a non-empty string"),
])
def test_a_bad_question_is_named_at_its_line(tmp_path: Path, turns, why: str) -> None:
    path = question_file(tmp_path, [QUESTIONS[1], {"question_id": 9, "turns": turns}])
    with pytest.raises(DraftsmithError, match=r"question\.jsonl:2: " + re.escape(why)):
        load_prompts(path, strict=True)
    assert len(load_prompts(path).conversations) == 1  # not strict: the good one kept


def test_regenerate_answers_every_turn_of_a_question(tmp_path: Path, target, model) -> None:
    convs = load_prompts(question_file(tmp_path, QUESTIONS[:1]), strict=True).conversations
    cfg = RegenConfig(max_new_tokens=4, max_len=128, batch_size=1, temperature=0.0)
    out = tmp_path / "answers.jsonl"
    regenerate(convs, out, EngineBackend(target, model, cfg), target.tokenizer, cfg,
               progress=False, log=lambda s: None)
    (rec,) = read_jsonl_tail_safe(out)
    roles = [m["role"] for m in rec["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in rec["messages"][::2]] == ["Write a haiku.", "Now a limerick."]
