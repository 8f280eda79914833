"""Prompt sources, third review: HumanEval copies, LMSYS-Chat-1M rows, whitespace repeats,
and records that answered with a traceback."""

from __future__ import annotations

import json

import pytest

from draftsmith.data.prompts import Conversation, load_prompts
from draftsmith.errors import DraftsmithError

STUB = "def f(x):\n    \"\"\"Twice x.\"\"\"\n"


def _jsonl(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- HumanEval records ------------------------------------------------------------------------


def test_a_humaneval_record_without_entry_point_reads_as_humaneval(tmp_path):
    """A HumanEval copy of prompts only (task_id, prompt) gave the bare stub, no task_id:
    a bench on it timed other prompts than one on the full file."""
    full = _jsonl(tmp_path / "full.jsonl", {"task_id": "HumanEval/0", "prompt": STUB,
                                            "entry_point": "f"})
    bare = _jsonl(tmp_path / "bare.jsonl", {"task_id": "HumanEval/0", "prompt": STUB})
    [want] = load_prompts(full).conversations
    [got] = load_prompts(bare).conversations
    assert got.to_json() == want.to_json()
    assert got.meta == {"source": "humaneval", "task_id": "HumanEval/0"}


def test_a_humaneval_record_with_extra_keys_reads_as_humaneval(tmp_path):
    path = _jsonl(tmp_path / "he.jsonl", {"task_id": "HumanEval/3", "prompt": STUB,
                                          "entry_point": "f", "canonical_solution": "x",
                                          "test": "y", "plus_input": [[1]], "atol": 0})
    [conv] = load_prompts(path).conversations
    assert conv.meta["task_id"] == "HumanEval/3"
    assert conv.first_user().endswith(STUB + "```")


def test_a_humaneval_record_whose_prompt_is_no_text_is_named_with_its_key(tmp_path):
    path = _jsonl(tmp_path / "he.jsonl", {"task_id": "HumanEval/0", "prompt": None})
    assert load_prompts(path).problems == [f"{path}:1: 'prompt' is not a non-empty string"]
    with pytest.raises(DraftsmithError, match=r"he\.jsonl:1: 'prompt' is not"):
        load_prompts(path, strict=True)


# --- LMSYS-Chat-1M rows -----------------------------------------------------------------------

LMSYS = {"conversation_id": "c1", "model": "vicuna-13b", "turn": 1, "language": "English",
         "conversation": [{"role": "user", "content": "What is TCP?"},
                          {"role": "assistant", "content": "A protocol."}]}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_lmsys_row_reads_its_conversation(tmp_path, suffix):
    """LMSYS-Chat-1M keeps its turns under 'conversation': every row was skipped."""
    path = tmp_path / f"lmsys{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([LMSYS]), path)
    else:
        _jsonl(path, LMSYS)
    ps = load_prompts(path)
    assert ps.problems == []
    assert [c.messages for c in ps.conversations] == [LMSYS["conversation"]]


def test_a_turn_list_that_is_no_list_is_named(tmp_path):
    """{"messages": "hi"} was refused as having no 'messages' (keys: messages)."""
    path = _jsonl(tmp_path / "p.jsonl", {"messages": "hi"}, {"conversation": {"role": "user"}})
    assert load_prompts(path).problems == [
        f"{path}:1: 'messages' is not a list of turns, got str",
        f"{path}:2: 'conversation' is not a list of turns, got dict"]


# --- repeats ----------------------------------------------------------------------------------


def test_prompts_differing_only_in_surrounding_whitespace_are_one(tmp_path):
    """"hello" and "hello\\n" were two prompts (the same question asked twice); case is kept."""
    path = _jsonl(tmp_path / "p.jsonl", {"prompt": "hello"}, {"prompt": "  hello\n"},
                  {"messages": [{"role": "user", "content": "hello "}]}, {"prompt": "Hello"},
                  {"prompt": "hello"})
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["hello", "Hello"]
    assert ps.duplicates == 3


def test_conversations_with_other_answers_are_not_repeats(tmp_path):
    def conv(answer):
        return {"messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": answer}]}

    path = _jsonl(tmp_path / "p.jsonl", conv("yes"), conv("no"), conv(" yes\n"))
    ps = load_prompts(path)
    assert [c.messages[1]["content"] for c in ps.conversations] == ["yes", "no"]
    assert ps.duplicates == 1


# --- read-back meta ---------------------------------------------------------------------------


@pytest.mark.parametrize("turn", [[0], {"k": 0}, "0", 0.0, True])
def test_a_cut_answer_whose_turn_is_no_index_is_ignored(turn):
    """An edited answers file whose meta.answers[].turn was a list raised TypeError
    (unhashable) in capture."""
    conv = Conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                        meta={"answers": [{"turn": turn, "finish": "length"}]})
    assert conv.cut_turns() == set()
    conv.meta["answers"].append({"turn": 0, "finish": "length"})
    assert conv.cut_turns() == {1}


def test_a_prompt_repeated_across_sources_with_other_whitespace_is_dropped(tmp_path):
    from draftsmith.data.cli import read_sources

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "bye"}) + "\n")
    b.write_text(json.dumps({"prompt": "hello\n"}) + "\n" + json.dumps({"prompt": "Bye"}) + "\n")
    convs = read_sources([str(a), str(b)], strict=False)
    assert [c.messages[0]["content"] for c in convs] == ["hello", "bye", "Bye"]
