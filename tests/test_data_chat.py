"""Loss masks from chat templates (tiny ChatML, SmolLM2, a history-rewriting template)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from draftsmith.data.chat import encode, user_prefix
from draftsmith.errors import DraftsmithError

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Drops "<think>...</think>" from earlier assistant turns, so turns do not extend one another.
REWRITING = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONV = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok, more."}]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def masked_text(tok, messages, cut=()) -> list[str]:
    ids, mask = encode(tok, messages, cut)
    pieces, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            pieces.append(tok.decode(cur))
            cur = []
    return pieces + ([tok.decode(cur)] if cur else [])


def test_chatml_masks_exactly_the_answers(tok):
    assert masked_text(tok, CONV) == ["hello!<|im_end|>", "ok, more.<|im_end|>"]
    ids, mask = encode(tok, CONV)
    assert ids == tok(tok.apply_chat_template(CONV, tokenize=False), add_special_tokens=False)[
        "input_ids"]


def test_a_conversation_opening_with_the_assistant_masks_its_answers_only(tok):
    """No history renders the first turn's opening: its role header (and a template's default
    system prompt) stay out of the mask."""
    conv = [{"role": "assistant", "content": "Hi!"}, *CONV]
    assert masked_text(tok, conv) == ["Hi!<|im_end|>", "hello!<|im_end|>",
                                      "ok, more.<|im_end|>"]
    old = tok.chat_template
    tok.chat_template = SMOLLM2
    try:
        assert masked_text(tok, conv)[0] == "Hi!<|im_end|>"
    finally:
        tok.chat_template = old


def test_smollm2_template_with_its_default_system_prompt(tok):
    old = tok.chat_template
    tok.chat_template = SMOLLM2
    try:
        assert masked_text(tok, CONV) == ["hello!<|im_end|>", "ok, more.<|im_end|>"]
        sys_conv = [{"role": "system", "content": "be terse"}] + CONV
        assert masked_text(tok, sys_conv) == ["hello!<|im_end|>", "ok, more.<|im_end|>"]
        prefix, suffix = user_prefix(tok)
        assert prefix.endswith("SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n")
        assert suffix == "<|im_end|>\n"
    finally:
        tok.chat_template = old


def test_history_rewriting_template_falls_back_to_the_text(tok):
    conv = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>hm</think>first"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "second"}]
    old = tok.chat_template
    tok.chat_template = REWRITING
    try:
        assert masked_text(tok, conv) == ["first<|im_end|>", "second<|im_end|>"]
    finally:
        tok.chat_template = old


# Mistral v0.3's shape: the system prompt joins the last message only when that is a user's,
# so turn-by-turn renders never prefix the whole conversation.
SYSTEM_LAST = (
    "{% set loop_messages = messages[1:] if messages[0]['role'] == 'system' else messages %}"
    "{% for m in loop_messages %}{% if m['role'] == 'user' %}{% if loop.last and "
    "messages[0]['role'] == 'system' %}[INST] {{ messages[0]['content'] }}\n\n"
    "{{ m['content'] }}[/INST]{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
    "{% else %} {{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
)


def test_a_short_answer_is_not_found_in_the_question_or_a_default_system_prompt(tok):
    """Where a template makes the text be searched for, it is searched for past the question
    (and past a default system prompt for an opening answer), not from the start."""
    old = tok.chat_template
    try:
        tok.chat_template = SYSTEM_LAST
        conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say yes"},
                {"role": "assistant", "content": "yes"}, {"role": "user", "content": "yes?"},
                {"role": "assistant", "content": "yes"}]
        assert masked_text(tok, conv) == ["yes<|im_end|>", "yes<|im_end|>"]
        tok.chat_template = SMOLLM2
        conv = [{"role": "assistant", "content": "helpful"}, *CONV]
        assert masked_text(tok, conv)[0] == "helpful<|im_end|>"
        tok.chat_template = ("{% if not messages | selectattr('role', 'eq', 'user') | list %}"
                             "{{ raise_exception('No user query found') }}{% endif %}" + old)
        assert masked_text(tok, conv)[0] == "helpful<|im_end|>"  # as Qwen3's does
    finally:
        tok.chat_template = old


def test_no_assistant_turn_gives_an_empty_mask(tok):
    ids, mask = encode(tok, CONV[:1])
    assert len(ids) == len(mask) and not any(mask)


def test_a_broken_template_is_a_clear_error(tok):
    old = tok.chat_template
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    try:
        with pytest.raises(DraftsmithError, match="chat template failed"):
            encode(tok, CONV)
    finally:
        tok.chat_template = old


def test_encode_many_equals_encode_one_by_one_across_chunks(tok):
    """Batched tokenization (online training's path) gives each conversation's own ids and mask,
    in order, across chunk boundaries; a template error names the conversation."""
    import random

    from draftsmith.data.chat import encode_many

    rng = random.Random(3)
    words = ["hello", "world", "x=1", "def f():", "  return 2", "é", "🙂", "\n", "  "]
    convs = []
    for n in range(11):
        turns = []
        for k in range(1 + n % 3):
            turns += [{"role": "user", "content": " ".join(rng.choices(words, k=3 + k))},
                      {"role": "assistant", "content": " ".join(rng.choices(words, k=2 + n))}]
        convs.append(turns if n != 4 else turns[:1])  # one without an answer
    want = [encode(tok, c) for c in convs]
    assert list(encode_many(tok, convs, chunk=4)) == want
    assert list(encode_many(tok, convs)) == want
    old = tok.chat_template
    tok.chat_template = ("{% if messages[0]['content'] == 'BOOM' %}{{ raise_exception('boom') }}"
                         "{% endif %}" + old)
    bad = convs[:5] + [[{"role": "user", "content": "BOOM"}]] + convs[5:]
    try:
        with pytest.raises(DraftsmithError, match=r"^conv 5: the chat template failed.*boom"):
            list(encode_many(tok, bad, [f"conv {i}" for i in range(len(bad))], chunk=4))
    finally:
        tok.chat_template = old
