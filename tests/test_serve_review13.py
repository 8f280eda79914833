"""Fields that change the answer refused rather than ignored (SGLang's `json_schema`, the old
`function_call` forcing a function, vLLM's `stream_options.continuous_usage_stats`), through the
real `openai` client; a streamed delta holding U+2028, U+2029 or U+0085 stays one SSE line for
readers that split lines as `str.splitlines` does (httpx's `iter_lines`, httpx-sse)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import engine, live, tiny_dir  # noqa: E402

from draftsmith.serve.app import _sse_line  # noqa: E402
from draftsmith.serve.engine import ServeEngine  # noqa: E402
from draftsmith.serve.protocol import GenRequest, chunk  # noqa: E402

__all__ = ["engine", "tiny_dir"]  # fixtures
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def srv(engine: ServeEngine, tiny_dir: Path) -> Iterator[dict]:
    with live(engine, str(tiny_dir)) as s:
        yield s


@pytest.mark.parametrize(("chat", "extra", "param"), [
    (False, {"json_schema": '{"type": "object"}'}, "json_schema"),  # SGLang's
    (True, {"json_schema": '{"type": "object"}'}, "json_schema"),
    (True, {"function_call": {"name": "f"}}, "function_call"),
    (True, {"stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}},
     "stream_options"),
])
def test_answer_changing_fields_are_400s_not_ignored(srv: dict, chat: bool, extra: dict,
                                                     param: str) -> None:
    c = srv["client"]
    body = {"model": srv["model"], "max_tokens": 4, "temperature": 0}
    stream = extra.pop("stream", False)
    kw = {"stream": True, "stream_options": extra.pop("stream_options")} if stream else {}
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            c.chat.completions.create(messages=MSG, extra_body=extra, **body, **kw)
        else:
            c.completions.create(prompt="hello", extra_body=extra, **body, **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["code"] == "unsupported"


def test_their_defaults_still_pass(srv: dict) -> None:
    c = srv["client"]
    r = c.chat.completions.create(model=srv["model"], messages=MSG, max_tokens=2, temperature=0,
                                  extra_body={"function_call": "auto", "json_schema": None})
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(c.chat.completions.create(
        model=srv["model"], messages=MSG, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": False}))
    assert chunks[-1].usage is not None


@pytest.mark.parametrize("chat", [True, False])
def test_a_delta_with_a_unicode_line_break_stays_one_sse_line(chat: bool) -> None:
    text = "a\u2028b\u2029c\x85d\n"
    req = GenRequest("chat" if chat else "completion", "m", [[1]], 4)
    event = _sse_line(chunk(req, 0, text))
    dec = httpx._decoders.LineDecoder()
    lines = dec.decode(event + "data: [DONE]\n\n") + dec.flush()
    data = [ln for ln in lines if ln]
    assert len(data) == 2 and data[1] == "data: [DONE]", lines
    got = openai._streaming.ServerSentEvent(data=data[0].removeprefix("data: ")).json()
    delta = got["choices"][0]["delta"]["content"] if chat else got["choices"][0]["text"]
    assert delta == text
