"""`draftsmith serve` under review, round nineteen, with the real `openai` client: a malformed
`max_tokens` beside `max_completion_tokens` is refused (it was dropped without a word), and the
wire behaviour the review checked (stop lists cut at the first met, usage counting the eos as
vLLM does, logprobs refused, a prompt past the limit a 400) stays as it is."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import engine, tiny_dir  # noqa: E402
from test_serve_review16 import CFG, MSG, Chars, srv  # noqa: E402

from draftsmith.serve.protocol import ApiError, parse_chat, parse_completion  # noqa: E402

__all__ = ["engine", "srv", "tiny_dir"]  # fixtures


@pytest.mark.parametrize(("parse", "body"), [(parse_chat, {"messages": MSG}),
                                             (parse_completion, {"prompt": "hi"})])
def test_a_malformed_max_tokens_beside_max_completion_tokens_is_refused(parse, body) -> None:
    """vLLM (pydantic) refuses it; it was ignored because the newer name wins."""
    with pytest.raises(ApiError, match="'max_tokens' must be an integer") as e:
        parse({**body, "max_completion_tokens": 3, "max_tokens": "ten"}, CFG, Chars())
    assert e.value.status == 400 and e.value.param == "max_tokens"
    both = {**body, "max_completion_tokens": 3, "max_tokens": 30}
    assert parse(both, CFG, Chars()).max_tokens == 3  # the newer name still wins


def test_stop_usage_and_refusals_through_the_client(srv: dict) -> None:
    c, model = srv["client"], srv["model"]
    ask = dict(model=model, messages=MSG, temperature=0, max_tokens=30)
    ids = httpx.post(srv["url"] + "/v1/chat/completions", timeout=60,
                     json={"messages": MSG, "temperature": 0, "max_tokens": 30,
                           "return_token_ids": True}).json()
    full = c.chat.completions.create(**ask).choices[0].message.content
    assert ids["usage"]["completion_tokens"] == len(ids["choices"][0]["token_ids"])
    late, early = full[8:10], full[2:4]
    r = c.chat.completions.create(**ask, stop=[late, early])  # the first met, not the first listed
    assert r.choices[0].message.content == full[: full.index(early)]
    assert r.choices[0].finish_reason == "stop"
    for kw in ({"logprobs": True}, {"top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError, match="not supported"):
            c.chat.completions.create(**ask, **kw)
    with pytest.raises(openai.BadRequestError, match="max-prompt-tokens"):
        c.chat.completions.create(**{**ask, "messages": [{"role": "user", "content": "x " * 300}]})
