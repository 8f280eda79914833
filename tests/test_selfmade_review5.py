"""Self-made prompts, review 5: the target's special ids are one definition (`control_ids`)
that self-made prompts and regenerate's served ids share; a round's counts are of the rows the
run used."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.data import regenerate, selfmade
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_one_definition_of_the_special_ids_serves_both_callers(target) -> None:
    assert selfmade.control_ids is regenerate.control_ids
    assert not hasattr(regenerate, "_special")
    special = regenerate.control_ids(target.tokenizer)
    assert set(target.tokenizer.all_special_ids) <= special and set(target.eos_ids) <= special


def test_both_callers_get_what_they_got(target) -> None:
    tok = target.tokenizer
    # regenerate: the special id that stopped a served answer is dropped, a word's is kept
    words, im_start = _ids(tok, "a cat sat"), _ids(tok, "<|im_start|>")
    assert regenerate.served_ids(words + im_start, "stop", tok) == words
    assert regenerate.served_ids(words, "stop", tok) == words
    # self-made prompts: a question is cut at the first special id the target wrote
    start = _ids(tok, "<|im_start|>user\n")
    asked = _ids(tok, "What is 2+2?") + im_start + _ids(tok, "assistant")
    assert selfmade._before_control(tok, start, asked, "") == _ids(tok, "What is 2+2?")


def _scripted(monkeypatch, target, rows: list[str], max_new: int) -> None:
    """Every round decodes `rows` (each cut to `max_new` tokens)."""
    from draftsmith.engine import generate

    toks = [_ids(target.tokenizer, r)[:max_new] for r in rows]

    def run(rt, prompts, max_new_tokens, params, stops, on_step=None):
        assert len(prompts) == len(toks)
        return generate.Generation([list(t) for t in toks], 0.0, 0.0)

    monkeypatch.setattr(generate, "run_generation", run)


def test_rows_past_n_are_not_counted_as_dropped(target, model, tmp_path: Path,
                                                monkeypatch) -> None:
    long = " ".join(["word"] * 80)
    rows = ["What is two plus two?", "What is two plus two?", "hi", long]
    _scripted(monkeypatch, target, rows, 64)
    cfg = MagpieConfig(n=1, batch_size=4, max_new_tokens=64)
    out = tmp_path / "p.jsonl"
    stats = self_made_prompts(target, out, cfg, model, progress=False, log=lambda s: None)
    # the first row made the one prompt asked for: the three after it were never wanted
    assert stats == {"kept": 1, "in_file": 1, "duplicates": 0, "length_filtered": 0,
                     "unfinished": 0, "bare_openings": 0, "template_tokens": 0}
    assert [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] \
        == ["What is two plus two?"]


def test_rows_before_n_are_counted(target, model, tmp_path: Path, monkeypatch) -> None:
    long = " ".join(["word"] * 80)
    rows = ["hi", long, "What is two plus two?"]
    _scripted(monkeypatch, target, rows, 64)
    cfg = MagpieConfig(n=1, batch_size=3, max_new_tokens=64)
    stats = self_made_prompts(target, tmp_path / "p.jsonl", cfg, model, progress=False,
                              log=lambda s: None)
    assert stats == {"kept": 1, "in_file": 1, "duplicates": 0, "length_filtered": 1,
                     "unfinished": 1, "bare_openings": 0, "template_tokens": 0}


# DeepSeek-R1's distills: `<｜User｜>` and `<｜Assistant｜>` are added tokens not marked special,
# and the template writes nothing after a user's message, so the target's question ran on past
# `<｜Assistant｜>` into its own answer, all of it kept as the question.
R1_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
               "{{ '<｜User｜>' + m['content'] }}{% else %}{{ '<｜Assistant｜>' + m['content'] "
               "+ eos_token }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


class _Swapped:
    """The target with another tokenizer."""

    def __init__(self, target, tok) -> None:
        self._target, self.tokenizer = target, tok

    def __getattr__(self, name: str):
        return getattr(self._target, name)


def _r1_target(target):
    import copy

    tok = copy.deepcopy(target.tokenizer)
    tok.add_tokens(["<｜User｜>", "<｜Assistant｜>", "<think>"], special_tokens=False)
    tok.chat_template = R1_TEMPLATE
    return _Swapped(target, tok)


def test_a_question_stops_at_the_templates_unmarked_role_token(target, model, tmp_path: Path,
                                                               monkeypatch) -> None:
    r1 = _r1_target(target)
    tok = r1.tokenizer
    marks = selfmade.template_ids(tok) - regenerate.control_ids(tok)  # bos is special already
    assert marks == {tok.convert_tokens_to_ids(t) for t in ("<｜User｜>", "<｜Assistant｜>",
                                                             "<think>")}
    rows = ["What is two plus two?<｜Assistant｜><think>\nIt is four.",
            "<｜Assistant｜>Hello there, friend.", "Name a prime number please"]
    _scripted(monkeypatch, r1, rows, 64)
    cfg = MagpieConfig(n=3, batch_size=3, max_new_tokens=64, max_batches=1)
    out = tmp_path / "p.jsonl"
    stats = self_made_prompts(r1, out, cfg, model, progress=False, log=lambda s: None)
    assert [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] \
        == ["What is two plus two?", "Name a prime number please"]
    assert stats["kept"] == 2 and stats["template_tokens"] == 1


def test_templates_with_special_role_tokens_mark_no_more(target) -> None:
    tok = target.tokenizer  # ChatML: every token the template writes is special already
    assert selfmade.template_ids(tok) <= regenerate.control_ids(tok)
