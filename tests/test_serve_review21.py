"""`draftsmith serve` under review, round twenty-one, through the real `openai` client: streamed
chunks' shape with n > 1 (each choice's text and finish as the whole answer's, usage last when
stream_options.include_usage asks), stop strings spanning two tokens (streamed or not: the text
cut before them, the usage and token ids up to them), a system message, logprobs refused by name,
max_tokens 0 or missing, and seeded or greedy requests beside sampled ones at other temperatures
answering as alone. Fixed here: a `stream_options` field of the wrong type is named by its path
(`stream_options.include_usage`), and an empty token-id prompt is refused as empty, naming which
prompt, not as a prompt of the wrong type."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import engine, tiny_dir  # noqa: E402
from test_serve_review13 import srv  # noqa: E402

from draftsmith.serve.engine import ServeEngine  # noqa: E402

__all__ = ["engine", "srv", "tiny_dir"]  # fixtures
MSG = [{"role": "user", "content": "hello there"}]


def post(srv: dict, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv['url']}/v1/{route}", json=body, timeout=30)


def test_a_chat_stream_of_two_choices_adds_up_to_the_whole_answer(srv: dict) -> None:
    c = srv["client"]
    kw = dict(model=srv["model"], messages=MSG, n=2, max_tokens=20, temperature=0)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    texts, fins = ["", ""], [None, None]
    for ch in chunks[:-1]:
        (x,) = ch.choices
        assert fins[x.index] is None and ch.usage is None  # nothing after a choice's finish
        texts[x.index] += x.delta.content or ""
        fins[x.index] = x.finish_reason
    assert texts == [x.message.content for x in whole.choices]
    assert fins == [x.finish_reason for x in whole.choices]


def test_a_text_stream_of_two_prompts_and_two_choices_each(srv: dict) -> None:
    c = srv["client"]
    kw = dict(model=srv["model"], prompt=["hi", "yo"], n=2, max_tokens=20, temperature=0)
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage == whole.usage
    texts = [""] * 4
    for ch in chunks[:-1]:
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == [x.text for x in whole.choices]


def test_a_system_message_reaches_the_prompt(srv: dict) -> None:
    c = srv["client"]
    system = [{"role": "system", "content": "be brief"}, *MSG]
    r = c.chat.completions.create(model=srv["model"], messages=system, max_tokens=5,
                                  temperature=0)
    alone = c.chat.completions.create(model=srv["model"], messages=MSG, max_tokens=5,
                                      temperature=0)
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens


@pytest.mark.parametrize("kw", [{"logprobs": True}, {"logprobs": True, "top_logprobs": 2},
                                {"top_logprobs": 2}])
def test_chat_logprobs_are_one_400_naming_the_field(srv: dict, kw: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        srv["client"].chat.completions.create(model=srv["model"], messages=MSG, max_tokens=3,
                                              **kw)
    assert e.value.body["param"] in kw and "not supported" in e.value.body["message"]


def test_max_tokens_missing_or_zero(srv: dict) -> None:
    c = srv["client"]
    r = c.completions.create(model=srv["model"], prompt="x", temperature=0)
    assert r.usage.completion_tokens <= 16  # OpenAI's default for a text completion
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=srv["model"], prompt="x", max_tokens=0)


def spanning(srv: dict, engine: ServeEngine, kw: dict) -> tuple[str, list[int], list[str]]:
    """A sampled answer's text, ids and the strings that span two of its tokens."""
    r = srv["client"].completions.create(**kw, extra_body={"return_token_ids": True})
    text, ids = r.choices[0].text, r.choices[0].token_ids
    pieces = [engine.decode(ids[:i]) for i in range(len(ids) + 1)]
    stops = []
    for a, b in zip(pieces[1:], pieces[2:], strict=False):
        if a and len(b) > len(a) and text.find(stop := a[-1] + b[len(a)]) == len(a) - 1:
            stops.append(stop)
    return text, ids, stops


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_across_two_tokens(srv: dict, engine: ServeEngine, stream: bool) -> None:
    kw = dict(model=srv["model"], prompt="abc", max_tokens=30, temperature=1.5, seed=1)
    text, ids, stops = spanning(srv, engine, kw)
    assert len(stops) >= 3
    for stop in stops[:4]:
        got = srv["client"].completions.create(
            **kw, stop=[stop], stream=stream, extra_body={"return_token_ids": True},
            stream_options={"include_usage": True} if stream else None)
        parts = list(got) if stream else [got]
        choices = [p.choices[0] for p in parts if p.choices]
        assert "".join(x.text for x in choices) == text[: text.index(stop)]
        assert choices[-1].finish_reason == "stop"
        used = parts[-1].usage.completion_tokens
        assert sum((x.token_ids for x in choices), []) == ids[:used]
        assert stop in engine.decode(ids[:used]) and stop not in engine.decode(ids[: used - 1])


def test_seeded_and_greedy_answers_beside_other_temperatures(srv: dict) -> None:
    c = srv["client"]

    def one(i: int) -> tuple[tuple, str]:
        key = ([0, 0.7, 1.3][i % 3], 7 if i % 2 else None)
        r = c.completions.create(model=srv["model"], prompt="once", max_tokens=12,
                                 temperature=key[0], seed=key[1])
        return key, r.choices[0].text

    alone = dict(one(i) for i in range(6))
    with ThreadPoolExecutor(12) as pool:
        for key, text in pool.map(one, range(12)):
            if key[0] == 0 or key[1] is not None:
                assert text == alone[key], key


# ---- fixed --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["include_usage", "continuous_usage_stats"])
def test_a_stream_options_field_of_the_wrong_type_is_named_by_its_path(srv: dict,
                                                                       name: str) -> None:
    r = post(srv, "chat/completions", {"messages": MSG, "stream": True,
                                       "stream_options": {name: "yes"}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == f"stream_options.{name}"
    assert err["message"].startswith(f"'stream_options.{name}' must be a boolean, got str")


@pytest.mark.parametrize(("prompt", "where"), [([], ""), ([[]], ""), ([[1, 2], []], " (prompt 1)")])
def test_an_empty_token_id_prompt_is_refused_as_empty(srv: dict, prompt: list,
                                                      where: str) -> None:
    r = post(srv, "completions", {"prompt": prompt, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and err["code"] == "invalid_value"
    assert err["message"] == f"the prompt{where} is empty: send at least one token or character"
