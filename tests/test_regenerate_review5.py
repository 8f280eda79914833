"""A server's client side: timeouts told apart from a server that is not there, a model listing
that hangs, credentials in --base-url kept out of records and messages, and token ids of
another model's vocabulary not recorded as the target's."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from openai.types.chat import ChatCompletion
from test_data_regenerate import ok_reply, running
from test_regenerate_review4 import FINE_S, SLOW_S, asks, dead_url

from draftsmith import options
from draftsmith.data import regenerate as R
from draftsmith.data.pipeline import Server, _server_client
from draftsmith.data.regenerate import (
    OpenAIBackend,
    RegenConfig,
    answerer,
    failed_words,
    regenerate,
    reply,
    served_ids,
)
from draftsmith.errors import DraftsmithError
from draftsmith.options import command_line

CFG = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2, temperature=0.0)


async def _wait(seconds: float, release: threading.Event | None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (release is not None and release.is_set()):
        await asyncio.sleep(0.02)


def slow_app(hang: str = "slow", models_delay: float = 0.0, hang_s: float = 0.6,
             release: threading.Event | None = None) -> FastAPI:
    """Answers, but `hang_s` later (slower than the client waits) for prompts starting with
    `hang`; the model listing `models_delay` later, or once `release` is set."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if (await request.json())["messages"][-1]["content"].startswith(hang):
            await asyncio.sleep(hang_s)
        return ok_reply()

    @app.get("/v1/models")
    async def models():
        await _wait(models_delay, release)
        return {"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                            "owned_by": "x"}]}

    return app


def run(convs: list, out: Path, backend: OpenAIBackend, tok: Any) -> dict:
    try:
        return regenerate(convs, out, backend, tok, CFG, False, lambda s: None)
    finally:
        backend.close()


def test_a_chunk_that_timed_out_says_so_not_no_server(target, tmp_path: Path) -> None:
    with running(slow_app()) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=2, retries=0, timeout=0.2)
        with pytest.raises(DraftsmithError) as e:
            run(asks(6, "slow"), tmp_path / "a.jsonl", backend, target.tokenizer)
    msg = str(e.value)
    assert msg.startswith(f"regenerate: the server at {url} takes requests but answered none "
                          "in time: each of the 2 requests of a chunk timed out after 0.2 s"), msg
    assert "raise --timeout (now 0.2 s), lower --concurrency (now 2)" in msg
    assert "no server answered" not in msg


def test_a_dead_server_is_still_no_server() -> None:
    backend = OpenAIBackend(dead_url(), "m", CFG, retries=0, timeout=2)
    got = backend.one([{"role": "user", "content": "hi"}])
    backend.close()
    assert got.unreached and not got.timed_out


def test_failed_words_name_timeouts_and_concurrency(target, tmp_path: Path) -> None:
    convs = [c for pair in zip(asks(2, "slow"), asks(2, "fine"), strict=True) for c in pair]
    with running(slow_app(hang_s=SLOW_S)) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=2, retries=0, timeout=FINE_S)
        stats = run(convs, tmp_path / "a.jsonl", backend, target.tokenizer)
    assert stats["failed"] == 2 and stats["timed_out"] == 2 and stats["answered"] == 2
    words = failed_words(stats, tmp_path / "a.jsonl", url)
    assert (f"(2 timed out: the server at {url} is slow under this load; lower --concurrency "
            "or raise --timeout)") in words, words


def test_a_model_listing_that_hangs_is_told_in_short(monkeypatch, tiny_llama_dir) -> None:
    from draftsmith.targets import load_target

    monkeypatch.setattr(R, "LIST_TIMEOUT", 0.3, raising=False)
    t = load_target(tiny_llama_dir)
    release = threading.Event()
    with running(slow_app(models_delay=30, release=release)) as url:
        began = time.monotonic()
        try:
            with pytest.raises(DraftsmithError) as e:  # the client's own timeout is 600 s
                _server_client(t, CFG, Server(url, "m"), lambda s: None)
            took = time.monotonic() - began
        finally:
            release.set()
        assert took < 5, took  # 0.3 s and a loaded machine's slack, not the listing's 30 s
    assert str(e.value).startswith(f"{url}: no server answered (Request timed out.) its model "
                                   "listing within 0.3 s"), str(e.value)


@pytest.mark.parametrize("url, want", [
    ("http://user:s3cret@h:8000/v1", "http://user:***@h:8000/v1"),
    ("http://s3cret@h/v1", "http://***@h/v1"),
    ("http://h/v1?api_key=s3cret&x=1", "http://h/v1?api_key=***&x=1"),
    ("http://h:30000/v1", "http://h:30000/v1"),
])
def test_urls_are_shown_without_credentials(url: str, want: str) -> None:
    assert options.redacted_url(url) == want


def test_the_command_records_no_url_credentials(monkeypatch) -> None:
    for spelling in (["--base-url", "http://u:s3cret@h/v1"], ["--base-url=http://u:s3cret@h/v1"]):
        monkeypatch.setattr(sys, "argv", ["draftsmith", "data", "make", "d", *spelling])
        line = command_line()
        assert "s3cret" not in line and "http://u:***@h/v1" in line, line


def test_the_answers_and_messages_hold_no_url_credentials(target, tmp_path: Path,
                                                          capsys) -> None:
    with running(slow_app(hang_s=SLOW_S)) as url:
        secret = url.replace("http://", "http://u:s3cret@")
        backend = OpenAIBackend(secret, "m", CFG, concurrency=2, retries=0, timeout=FINE_S)
        assert "s3cret" in str(backend.client.base_url)  # the live client keeps them
        assert answerer(backend, CFG)["base_url"] == url.replace("http://", "http://u:***@")
        stats = run(asks(2, "fine") + asks(2, "slow"), tmp_path / "a.jsonl", backend,
                    target.tokenizer)
        assert stats["answered"] == 2
        assert "s3cret" not in failed_words(stats, tmp_path / "a.jsonl", secret)
    assert "s3cret" not in (tmp_path / "a.jsonl").read_text()
    dead = dead_url().replace("http://", "http://u:s3cret@")
    backend = OpenAIBackend(dead, "m", CFG, retries=0, timeout=2)
    with pytest.raises(DraftsmithError) as e:
        R.server_model(backend.client, dead)
    backend.close()
    assert "s3cret" not in str(e.value) and "u:***@" in str(e.value)


def completion(content: str, ids: list[int]) -> ChatCompletion:
    return ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": ids,
                     "message": {"role": "assistant", "content": content}}]})


def test_ids_of_another_vocabulary_are_not_recorded(target) -> None:
    tok = target.tokenizer
    words = tok("a cat sat", add_special_tokens=False)["input_ids"]
    other = [w + 3 for w in words]  # the same answer in another model's vocabulary
    got = reply(completion("a cat sat", other + [10**6]), "m", tok)
    assert got.ids is None and got.foreign_ids and got.text == "a cat sat"
    assert served_ids(other, "stop", tok, "a cat sat") is None
    # the target's own ids, its stop token dropped, are kept as before
    eos = target.eos_ids[0]
    assert reply(completion("a cat sat", words + [eos]), "m", tok).ids == words


def test_ids_of_another_vocabulary_are_warned_once(target, capsys) -> None:
    tok = target.tokenizer
    words = tok("ok", add_special_tokens=False)["input_ids"]
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        body = ok_reply()
        body["choices"][0]["token_ids"] = [w + 5 for w in words]
        return body

    with running(app) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=2, retries=0, tokenizer=tok)
        got = backend.answer([[{"role": "user", "content": f"q{i}"}] for i in range(3)])
        backend.close()
    assert [a.ids for a in got] == [None] * 3 and [a.text for a in got] == ["ok"] * 3
    err = capsys.readouterr().err
    assert err.count("do not decode to its text") == 1, err


def test_a_reply_that_is_not_json_is_a_failed_answer_not_a_traceback(target,
                                                                      tmp_path: Path) -> None:
    from fastapi.responses import Response

    calls: list[int] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        calls.append(1)
        if (await request.json())["messages"][-1]["content"].startswith("cut"):
            return Response('{"choices": [', media_type="application/json")
        return ok_reply()

    with running(app) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=2, retries=1, backoff=0.01)
        stats = run(asks(2, "cut") + asks(2, "fine"), tmp_path / "a.jsonl", backend,
                    target.tokenizer)
    assert stats["failed"] == 2 and stats["answered"] == 2 and stats["refused_by_server"] == 0
    assert len(calls) == 2 * 2 + 2  # each cut reply asked again (--retries 1)


def test_a_429_waits_as_long_as_retry_after_says() -> None:
    from fastapi.responses import JSONResponse

    seen: list[float] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        seen.append(time.monotonic())
        if len(seen) == 1:
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429,
                                headers={"Retry-After": "0.6"})
        return ok_reply()

    with running(app) as url:
        backend = OpenAIBackend(url, "m", CFG, retries=2, backoff=0.01)
        got = backend.one([{"role": "user", "content": "hi"}])
        backend.close()
    assert got.text == "ok" and len(seen) == 2
    assert seen[1] - seen[0] >= 0.55


@pytest.mark.parametrize("url", ["localhost:8000/v1", "http://[::1", "ftp://h/v1", "http:///v1"])
def test_a_base_url_that_is_not_http_is_refused_by_name(url: str) -> None:
    with pytest.raises(DraftsmithError, match=r"^--base-url .* is not an http:// or https:// "
                                              r"URL with a host: give it as http://HOST:PORT/v1"):
        OpenAIBackend(url, "m", CFG)
