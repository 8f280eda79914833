"""`draftsmith serve` under review: integral floats in integer fields (as vLLM and OpenAI take
them), a stream refused before its 200 went out answers with an HTTP status, the body limit
(`--max-body`, 413) and the JSON parse off the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from test_serve_review4 import Sched, Text  # noqa: E402

from draftsmith.serve import app as serve_app  # noqa: E402
from draftsmith.serve.app import create_app  # noqa: E402
from draftsmith.serve.protocol import ApiError, ServeConfig, parse_chat, parse_completion  # noqa: E402

CFG = ServeConfig("tiny", max_tokens=32, max_prompt_tokens=20, max_batch=4)
MSG = [{"role": "user", "content": "hi"}]


def call(app: Any, route: str, body: dict[str, Any] | bytes) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            if isinstance(body, bytes):
                return await client.post(route, content=body,
                                         headers={"content-type": "application/json"})
            return await client.post(route, json=body)

    return asyncio.run(go())


# ---- integer fields ------------------------------------------------------------------------


def test_integral_floats_are_taken_in_every_integer_field() -> None:
    """`max_tokens: 2.0` was a 400 ("must be an integer, got float"); vLLM (pydantic) and
    OpenAI take it. The values come out as ints."""
    c = parse_completion({"prompt": "hi", "max_tokens": 2.0, "n": 2.0, "top_k": 5.0,
                          "seed": 7.0, "temperature": 1.0}, CFG, Text())
    assert (c.max_tokens, c.n, c.params.top_k, c.seed) == (2, 2, 5, 7)
    assert all(type(v) is int for v in (c.max_tokens, c.n, c.params.top_k, c.seed))
    r = parse_chat({"messages": MSG, "max_completion_tokens": 3.0, "top_logprobs": 0.0,
                    "best_of": 1.0}, CFG, Text())
    assert r.max_tokens == 3 and type(r.max_tokens) is int


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n", "top_k", "seed"])
@pytest.mark.parametrize("value", [2.5, True, "2", float("inf")])
def test_a_fractional_or_boolean_integer_stays_a_400(field: str, value: Any) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": MSG, "temperature": 1.0, field: value}, CFG, Text())
    assert e.value.status == 400 and e.value.param == field
    assert e.value.code == "invalid_type" and "must be an integer" in e.value.message


def test_an_integral_float_over_the_limit_is_still_refused_by_its_range() -> None:
    with pytest.raises(ApiError, match=r"'max_tokens' must be in \[1, 32\]"):
        parse_completion({"prompt": "hi", "max_tokens": 33.0}, CFG, Text())
    with pytest.raises(ApiError, match=r"'n' must be in"):
        parse_completion({"prompt": "hi", "n": 0.0}, CFG, Text())


def test_the_http_answers_for_integral_and_fractional_floats() -> None:
    app = create_app(Text(), CFG, Sched())
    ok = call(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2.0})
    assert ok.status_code == 200, ok.text
    bad = call(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2.5})
    assert bad.status_code == 400
    assert bad.json()["error"] == {"message": "'max_tokens' must be an integer, got float: 2.5",
                                   "type": "invalid_request_error", "param": "max_tokens",
                                   "code": "invalid_type"}


# ---- a stream refused before it started ----------------------------------------------------


class StoppedAfterAccept(Sched):
    """The scheduler's events for a job queued just as the server stopped: accepted, then
    `Scheduler.stop`'s 503, before the response has begun."""

    def submit(self, job: Any) -> None:
        job.emit(("accepted",))
        job.emit(("error", 503, "the server is shutting down"))


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_stream_stopped_before_its_200_went_out_is_an_http_503(kind: str) -> None:
    """It was a 200 carrying an error event: the real client raised a bare APIError (no
    status) instead of the 503 a non-streamed request gets."""
    app = create_app(Text(), CFG, StoppedAfterAccept())

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", max_retries=0,
                                        http_client=http)
            if kind == "chat":
                await client.chat.completions.create(model="tiny", messages=MSG, stream=True)
            else:
                await client.completions.create(model="tiny", prompt="hi", stream=True)

    with pytest.raises(openai.InternalServerError) as e:
        asyncio.run(go())
    assert e.value.status_code == 503 and "shutting down" in str(e.value)


# ---- the body: its limit and its parse -----------------------------------------------------


def test_max_body_is_the_servers_limit_and_the_413_names_it() -> None:
    cfg = ServeConfig("tiny", max_tokens=32, max_prompt_tokens=20, max_batch=4, max_body=1000)
    app = create_app(Text(), cfg, Sched())
    small = b'{"prompt": "hi", "max_tokens": 2, "user": "' + b"u" * 900 + b'"}'
    assert call(app, "/v1/completions", small).status_code == 200
    big = b'{"prompt": "hi", "max_tokens": 2, "user": "' + b"u" * 1000 + b'"}'
    r = call(app, "/v1/completions", big)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "body_too_large" and err["type"] == "invalid_request_error"
    assert "over 1,000 bytes (the server's --max-body)" in err["message"]
    default = create_app(Text(), CFG, Sched())  # 16 MiB when not given
    assert call(default, "/v1/completions", big).status_code == 200
    with pytest.raises(Exception, match="max_body must be >= 1"):
        ServeConfig("tiny", max_body=0)


def test_serve_refuses_a_max_body_under_one_mib_before_loading(monkeypatch, capsys) -> None:
    from test_cli_review2 import NEVER, error_of

    err = error_of(monkeypatch, capsys, "serve", "--target", NEVER, "--max-body", "0")
    assert err == "--max-body must be >= 1, got 0"


def test_the_json_body_is_parsed_off_the_event_loop(monkeypatch) -> None:
    """A 16 MiB body held the event loop (and every other connection) for ~0.2 s."""
    seen: list[threading.Thread] = []
    real = serve_app._json

    def spy(raw: bytes | bytearray) -> Any:
        seen.append(threading.current_thread())
        return real(raw)

    monkeypatch.setattr(serve_app, "_json", spy)
    app = create_app(Text(), CFG, Sched())
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": MSG})):
        assert call(app, route, body).status_code == 200
    assert len(seen) == 2 and threading.main_thread() not in seen
