"""Prompt files as users bring them, chat-template masks under Llama-3 templates, the draft
vocabulary's end-of-turn token, and self-made prompts under a multi-token turn closing."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
from test_data_chat import masked_text
from transformers import AutoTokenizer

from draftsmith.data.chat import template_ids
from draftsmith.data.prompts import Conversation, encode_conversation, load_prompts
from draftsmith.data.selfmade import MagpieConfig, _one, stop_ids
from draftsmith.data.vocab import build_vocab, count_ids, map_problem
from draftsmith.errors import DraftsmithError

LLAMA3 = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Llama 3.1's: the system message moved into a default one that names a date ("Today").
LLAMA31 = (
    "{{- bos_token }}{%- set date_string = '26 Jul 2024' %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']"
    "|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}"
    "{%- endif %}{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|end_of_text|>", "<|im_start|>", "</s>"]


def one(tmp_path, rec, name="p.jsonl", strict=False):
    path = tmp_path / name
    path.write_text(json.dumps(rec) + "\n")
    return load_prompts(path, strict)


# ---- prompt records ------------------------------------------------------------------------

def test_text_parts_join_by_newline_as_the_server_reads_them(tmp_path):
    """Parts were glued ("Summarize:The text"), unlike the request the server renders."""
    rec = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Summarize:"}, {"type": "text", "text": "The text."}]}]}
    assert one(tmp_path, rec).conversations[0].messages[0]["content"] == "Summarize:\nThe text."


def test_an_image_part_is_refused_at_its_line_not_dropped(tmp_path):
    """The image was dropped and its question ("what is in it?") asked without it."""
    rec = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "x.png"}}]}]}
    ps = one(tmp_path, rec)
    assert ps.conversations == []
    assert ps.problems == [f"{tmp_path / 'p.jsonl'}:1: message 0: a content part of type "
                           "'image_url'; only text parts are read"]


def test_a_text_part_of_no_string_is_a_malformed_record_not_a_traceback(tmp_path):
    """A part {"type": "text", "text": 5} raised TypeError out of load_prompts."""
    rec = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    with pytest.raises(DraftsmithError, match=r"p\.jsonl:1: message 0: a text part whose "
                       "'text' is not a string"):
        one(tmp_path, rec, strict=True)


def test_a_lone_surrogate_is_named_at_its_line_not_a_traceback(tmp_path):
    """JSON's "\\ud800" parsed, then hashing the conversation raised UnicodeEncodeError."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "bad \\ud800"}\n'
                    '{"messages": [{"role": "user", "content": "x\\udc00"}]}\n')
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["fine"]
    assert [p.split(": ", 1)[0] for p in ps.problems] == [f"{path}:2", f"{path}:3"]
    assert "unpaired surrogate" in ps.problems[0] and "message 0" in ps.problems[1]


def test_tool_turns_are_refused_as_such_and_developer_is_a_system_prompt(tmp_path):
    tool = {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                         {"role": "tool", "content": "sunny"}]}
    with pytest.raises(DraftsmithError, match="p.jsonl:1: message 1: tool messages and tool "
                       "calls are not supported"):
        one(tmp_path, tool, strict=True)
    dev = {"messages": [{"role": "developer", "content": "be brief"},
                        {"role": "user", "content": "hi"}]}
    assert one(tmp_path, dev).conversations[0].messages[0] == {"role": "system",
                                                               "content": "be brief"}


def test_alpaca_fields_that_are_not_text_are_refused_not_printed_into_the_prompt(tmp_path):
    """{"instruction": null, "input": "x"} became the prompt "None\\n\\nx"; an input of 5, "5"."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"instruction": null, "input": "x"}\n{"instruction": "Add", "input": 5}\n'
                    '{"instruction": "Add", "input": "  "}\n')
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["Add"]
    assert ps.problems == [f"{path}:1: 'instruction' is not a non-empty string",
                           f"{path}:2: 'input' is not a string, got int"]


def test_jsonl_under_a_json_name_is_read_line_by_line(tmp_path):
    """Many datasets ship JSON Lines as .json: the file was refused whole ("Extra data")."""
    path = tmp_path / "data.json"
    path.write_text('{"prompt": "one"}\n{bad\n{"prompt": "three"}\n')
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["one", "three"]
    assert ps.problems[0].startswith(f"{path}:2: not valid JSON")
    with pytest.raises(DraftsmithError, match=r"data\.json:2: not valid JSON"):
        load_prompts(path, strict=True)


def test_a_gzipped_json_array_is_read_whole(tmp_path):
    """A .json.gz was read as JSON Lines: a pretty-printed array gave only malformed lines."""
    path = tmp_path / "data.json.gz"
    path.write_bytes(gzip.compress(json.dumps([{"prompt": "x"}, 5], indent=2).encode()))
    ps = load_prompts(path)
    assert [c.first_user() for c in ps.conversations] == ["x"]
    assert ps.problems == [f"{path} item [1]: expected a JSON object, got int"]


def test_windows_bom_crlf_blank_lines_and_a_last_line_without_newline(tmp_path):
    path = tmp_path / "p.jsonl"
    alpaca = {"instruction": "Sum these", "input": "1 2", "output": "3"}
    sharegpt = {"conversations": [{"from": "system", "value": "terse"},
                                  {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(alpaca).encode() + b"\r\n\r\n  \r\n"
                     + json.dumps(sharegpt).encode() + b"\r\n" + b'{"prompt": "last"}')
    ps = load_prompts(path, strict=True)
    assert [c.messages for c in ps.conversations] == [
        [{"role": "user", "content": "Sum these\n\n1 2"}],
        [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "yo"}],
        [{"role": "user", "content": "last"}]]


# ---- chat-template masks under Llama 3 -----------------------------------------------------

@pytest.fixture()
def llama3_tok(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tok.bos_token = "<|begin_of_text|>"
    return tok


CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What date?"},
        {"role": "assistant", "content": "  Today \n"}, {"role": "user", "content": "Say yes"},
        {"role": "assistant", "content": "yes"}]


@pytest.mark.parametrize("template", [LLAMA3, LLAMA31], ids=["llama3", "llama3.1"])
@pytest.mark.parametrize("eos", ["<|eot_id|>", "<|end_of_text|>"])
def test_llama3_masks_each_answer_and_its_eot_not_the_next_header(llama3_tok, template, eos):
    tok = llama3_tok
    tok.chat_template, tok.eos_token = template, eos
    assert masked_text(tok, CONV) == ["Today<|eot_id|>", "yes<|eot_id|>"]
    assert masked_text(tok, CONV, cut={4}) == ["Today<|eot_id|>", "yes"]
    prompt = tok.decode(template_ids(tok, CONV[:2]))
    assert prompt.endswith("What date?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not tok.decode(template_ids(tok, CONV[:3], False)).endswith("<|end_header_id|>\n\n")


def test_the_end_of_turn_token_is_counted_into_the_draft_vocab(llama3_tok):
    """EAGLE-3 / SpecForge force no token in: the end-of-turn token is there because every
    answer's mask holds it, so the drafter can propose the end of an answer."""
    tok = llama3_tok
    tok.chat_template, tok.eos_token = LLAMA3, "<|end_of_text|>"
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    convs = [Conversation([{"role": "user", "content": f"q{i}"},
                           {"role": "assistant", "content": "ab" * (i + 1)}]) for i in range(3)]
    counts = count_ids((encode_conversation(tok, c) for c in convs), len(tok))
    assert counts[eot] == 3 and counts[tok.convert_tokens_to_ids("<|start_header_id|>")] == 0
    v = build_vocab(counts, 3, len(tok))
    assert v.used.tolist() == sorted([eot, *tok.convert_tokens_to_ids(["a", "b"])])
    assert map_problem(v.d2t, v.t2d, len(tok))[1] is None


def test_a_draft_vocab_larger_than_the_tokens_seen_takes_those_seen(recwarn):
    counts = count_ids([([3, 3, 7, 5], [True, True, True, False])], 10)
    v = build_vocab(counts, 6, 10)
    assert v.used.tolist() == [3, 7] and v.coverage == 1.0
    assert map_problem(v.d2t, v.t2d, 10)[1] is None
    assert "only 2 distinct assistant tokens for a draft vocab of 6" in str(recwarn[0].message)


# ---- self-made prompts: a user turn closed by several tokens -------------------------------

@pytest.fixture()
def byte_tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_a_multi_token_closing_is_no_stop_and_cuts_the_question_at_its_text(byte_tok):
    """Llama 2's user turn closes with " [/INST]": its first token "[" stopped decoding, so
    "Sort [3, 1] ascending" was kept as "Sort"."""
    target = SimpleNamespace(tokenizer=byte_tok, eos_ids=[2])
    bracket = byte_tok("[", add_special_tokens=False)["input_ids"][0]
    assert bracket not in stop_ids(target, " [/INST]")
    im_end = byte_tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_ids(target, "<|im_end|>\n") == sorted({2, im_end})
    cfg = MagpieConfig(max_new_tokens=20, min_chars=1)
    start = byte_tok("[INST] ", add_special_tokens=False)["input_ids"]
    toks = byte_tok("Sort [3, 1] [/INST] Sure", add_special_tokens=False)["input_ids"]
    stats = {"unfinished": 0, "bare_openings": 0, "duplicates": 0, "length_filtered": 0}
    assert _one(target, toks, cfg, set(), stats, "", start, "[/INST]") == "Sort [3, 1]"
    assert stats["unfinished"] == 0  # past max_new_tokens, but closed within it
    long = byte_tok("Sort [3, 1, 4, 1, 5, 9, 2]", add_special_tokens=False)["input_ids"]
    assert _one(target, long, cfg, set(), stats, "", start, "[/INST]") is None
    assert stats["unfinished"] == 1
