"""`draftsmith serve`'s HTTP side as a demanding client meets it: bodies and numbers that JSON
allows but Python's parsing or a float cannot hold are a 400 in OpenAI's error shape, not a 500."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from draftsmith.serve.app import create_app  # noqa: E402
from draftsmith.serve.protocol import ApiError, ServeConfig, parse_chat, parse_completion  # noqa: E402

CFG = ServeConfig("tiny", max_tokens=32, max_prompt_tokens=20, max_batch=4)
MSG = [{"role": "user", "content": "hi"}]


class Text:
    """A stand-in text side: one id a character."""

    vocab_size, max_len = 256, 52

    def chat_ids(self, messages: list[dict[str, str]], most: int | None = None) -> list[int]:
        return list("".join(m["content"] for m in messages).encode())

    def text_ids(self, text: str, most: int | None = None) -> list[int]:
        return list(text.encode())


class Sched:
    """A stand-in scheduler that answers every job with one empty choice at once."""

    status_waits = False

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def count(self, **kv: int) -> None: ...

    def status(self) -> dict[str, Any]:
        return {"alive": True, "queued": 0, "metrics": {}}

    def submit(self, job: Any) -> None:
        from draftsmith.serve.protocol import Choice

        for i in range(job.req.rows):
            job.emit(("finish", i, Choice("", "stop", 0)))
        job.emit(("done", 0))

    @staticmethod
    def cancel(job: Any) -> None:
        job.cancelled = True


def post(route: str, body: bytes) -> httpx.Response:
    async def go() -> httpx.Response:
        app = create_app(Text(), CFG, Sched())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(route, content=body,
                                     headers={"content-type": "application/json"})

    return asyncio.run(go())


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_integer_too_large_for_a_float_is_a_400_naming_it(field: str, kind: str) -> None:
    """JSON integers have no bound: 10**400 once raised OverflowError, a 500."""
    body = {"messages": MSG} if kind == "chat" else {"prompt": "hi"}
    parse = parse_chat if kind == "chat" else parse_completion
    with pytest.raises(ApiError) as e:
        parse({**body, field: 10**400}, CFG, Text())
    assert e.value.status == 400 and e.value.param == field and "out of range" in e.value.message


@pytest.mark.parametrize(("body", "word"), [
    (b"[" * 100_000, "too deeply"),
    (b'{"prompt": "hi", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "too deeply"),
    (b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}", "digits"),
], ids=["deep-array", "deep-field", "long-integer"])
def test_json_python_cannot_parse_is_a_400_not_a_500(body: bytes, word: str) -> None:
    """Deep nesting (RecursionError) and an integer of over 4,300 digits (ValueError) are not
    JSONDecodeErrors: both once fell to the catch-all, a 500 "internal error"."""
    r = post("/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert "not valid JSON" in err["message"] and word in err["message"]


def test_the_stand_in_app_answers_a_good_body() -> None:
    """The helper itself: a valid request gets a 200 (so the 400s above are the body's)."""
    r = post("/v1/completions", b'{"prompt": "hi", "max_tokens": 3}')
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
