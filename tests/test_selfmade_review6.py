"""Self-made prompts, review 6: the chat template's role tokens stop decoding (DeepSeek-R1's
`<｜User｜>`/`<｜Assistant｜>` only cut the question afterwards, the target running on into a fake
next turn), and a plain-text template (`User:`/`Assistant:` lines) ends the question at the next
role line, not at its first newline or space."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from test_selfmade_review5 import _Swapped

from draftsmith.data import selfmade
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts

R1_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
               "{{ '<｜User｜>' + m['content'] }}{% else %}{{ '<｜Assistant｜>' + m['content'] "
               "+ eos_token }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
# role lines, the user's closed by a newline
LINES = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
         "{% else %}Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}Assistant:{% endif %}")
# role lines, the user's closed by nothing (the assistant's header opens with the newline)
BARE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}"
        "{% else %}\nAssistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}\nAssistant:{% endif %}")
# Vicuna's shape: both roles on one line, the user's closed by a space
VICUNA = ("{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
          "{% else %}ASSISTANT: {{ m['content'] }}</s>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def _with_template(target, template: str, added: tuple[str, ...] = ()):
    tok = copy.deepcopy(target.tokenizer)
    if added:
        tok.add_tokens(list(added), special_tokens=False)
    tok.chat_template = template
    return _Swapped(target, tok)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _engine(monkeypatch, target, rows: list[str], max_new: int) -> list[int]:
    """Every round decodes `rows` as the engine would: each stops at the first stop id given
    (excluded) or `max_new` tokens. Returns the tokens each round decoded, a list per round."""
    from draftsmith.engine import generate

    toks = [_ids(target.tokenizer, r) for r in rows]
    spent: list[int] = []

    def run(rt, prompts, max_new_tokens, params, stops, on_step=None):
        out = []
        for t in toks:
            t = t[:max_new_tokens]
            out.append(t[:next((i for i, x in enumerate(t) if x in stops), len(t))])
        spent.append(sum(len(t) for t in out))
        return generate.Generation(out, 0.0, 0.0)

    monkeypatch.setattr(generate, "run_generation", run)
    return spent


def _run(target, model, out: Path, rows: int, max_new: int = 64) -> tuple[list[str], dict]:
    cfg = MagpieConfig(n=rows, batch_size=rows, max_new_tokens=max_new, max_batches=1)
    stats = self_made_prompts(target, out, cfg, model, progress=False, log=lambda s: None)
    made = [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] \
        if out.exists() else []
    return made, stats


def test_r1_role_tokens_stop_decoding(target, model, tmp_path: Path, monkeypatch) -> None:
    r1 = _with_template(target, R1_TEMPLATE, ("<｜User｜>", "<｜Assistant｜>", "<think>"))
    asked = "What is two plus two?"
    spent = _engine(monkeypatch, r1, [asked + "<｜Assistant｜><think>\nIt is four, as 2+2=4.",
                                      "Name a prime number<｜User｜>Name another one please"], 64)
    made, stats = _run(r1, model, tmp_path / "p.jsonl", 2)
    assert made == [asked, "Name a prime number"] and stats["kept"] == 2
    # decoding stopped at each row's role token: nothing of the fake next turn was decoded
    assert spent == [len(asked) + len("Name a prime number")]


def test_chatml_role_tokens_stop_decoding_too(target, model, tmp_path: Path,
                                               monkeypatch) -> None:
    spent = _engine(monkeypatch, target, ["Is the sky blue?<|im_start|>assistant\nYes it is."],
                    64)
    made, _ = _run(target, model, tmp_path / "p.jsonl", 1)
    assert made == ["Is the sky blue?"] and spent == [len("Is the sky blue?")]


def test_plain_role_lines_end_the_question(target, model, tmp_path: Path, monkeypatch) -> None:
    for i, template in enumerate((LINES, BARE)):
        plain = _with_template(target, template)
        rows = ["What is two plus two?\nAssistant: It is four.\nUser: and three?",
                "Fix this code:\nx = 1 +\nprint(x)\nAssistant: The line is cut.",
                "Tell me a joke\nUser: a better one\nAssistant: no",
                "A question that never ends " * 4]
        _engine(monkeypatch, plain, rows, 64)
        made, stats = _run(plain, model, tmp_path / f"p{i}.jsonl", 4)
        # multi-line questions kept whole; a row that ran to --max-new-tokens unfinished
        assert made == ["What is two plus two?", "Fix this code:\nx = 1 +\nprint(x)",
                        "Tell me a joke"], template
        assert stats["unfinished"] == 1, template


def test_a_blank_closing_is_no_stop(target) -> None:
    for template, blank in ((LINES, "\n"), (VICUNA, " ")):
        plain = _with_template(target, template)
        stops = selfmade.stop_ids(plain, blank)
        assert _ids(plain.tokenizer, blank)[0] not in stops and set(target.eos_ids) <= set(stops)


def test_vicuna_roles_on_one_line(target, model, tmp_path: Path, monkeypatch) -> None:
    vicuna = _with_template(target, VICUNA)
    _engine(monkeypatch, vicuna, ["What is two plus two? ASSISTANT: four</s>USER: and three?",
                                  "Sort these numbers: 3 1 2 ASSISTANT: 1 2 3"], 64)
    made, _ = _run(vicuna, model, tmp_path / "p.jsonl", 2)
    # the space closing the user's turn stopped the first word ("What")
    assert made == ["What is two plus two?", "Sort these numbers: 3 1 2"]


def test_role_headers_are_plain_words_only(target) -> None:
    from draftsmith.data.chat import role_headers

    # ChatML's headers hold its special tokens: "assistant" alone would cut "an assistant"
    assert role_headers(target.tokenizer) == ()
    quote = _with_template(target, LINES.replace("User: ", "> ").replace("Assistant: ", "< ")
                           .replace("Assistant:", "<"))
    assert role_headers(quote.tokenizer) == ()  # "if x > 3" is no next turn
    assert role_headers(_with_template(target, LINES).tokenizer) == ("User:", "Assistant:")
