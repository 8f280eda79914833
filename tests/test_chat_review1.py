"""Chat-template review: masks and ids across templates, and a template without a system role."""

from __future__ import annotations

import pytest
from test_data_chat import masked_text
from transformers import AutoTokenizer

from draftsmith.data.chat import encode, template_ids, user_prefix
from draftsmith.errors import DraftsmithError
from draftsmith.targets.tokenizer import CHATML, write_byte_tokenizer

# Gemma's way: no system role (refused by name), the assistant's turn called "model".
NO_SYSTEM = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<|im_start|>{{ role }}\n{{ m['content'] | trim }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"
)
# Llama 3's way: the header closed by its own token, content trimmed, the bos in the text.
TRIMMING = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>\n\n"
    "{{ m['content'] | trim }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>\n\n{% endif %}"
)
CONV = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say yes"},
        {"role": "assistant", "content": "yes"}, {"role": "user", "content": "more?"},
        {"role": "assistant", "content": " ok, more. "}, {"role": "user", "content": "bye"}]


@pytest.fixture
def tok(tmp_path):
    write_byte_tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def hf_ids(tok, messages, add_generation_prompt: bool) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                        add_generation_prompt=add_generation_prompt))


@pytest.mark.parametrize("template, close", [(CHATML, "<|im_end|>"), (TRIMMING, "</s>"),
                                             (NO_SYSTEM, "</s>")])
def test_masks_are_the_answers_and_their_close_and_ids_are_hfs(tok, template, close):
    tok.chat_template = template
    conv = CONV[1:] if template is NO_SYSTEM else CONV
    ids, _ = encode(tok, conv)
    assert ids == hf_ids(tok, conv, False)
    answers = ["yes", " ok, more. " if template is CHATML else "ok, more."]
    assert masked_text(tok, conv) == [a + close for a in answers]
    assert masked_text(tok, conv, cut=(len(conv) - 2,)) == [answers[0] + close, answers[1]]
    prompt = conv[:2]
    assert template_ids(tok, prompt) == hf_ids(tok, prompt, True)


def test_a_system_message_under_a_template_without_one_is_named_with_the_fix(tok):
    tok.chat_template = NO_SYSTEM
    assert user_prefix(tok)[0].endswith("<|im_start|>user\n")
    with pytest.raises(DraftsmithError) as e:
        user_prefix(tok, "Be terse.")
    said = str(e.value)
    assert "\n" not in said
    assert "System role not supported" in said and "without a system message" in said
