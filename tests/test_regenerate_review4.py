"""A server that is down: listing its models advised `--model` (with which every request then
failed), and a run against it (or one that stops mid-run) asked every later chunk, each request
with --retries backoff, minutes in all to fail alike. A chunk none of whose requests reached
the server now stops the run with one error; ordinary per-request failures do not."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_data_regenerate import ok_reply, running

from draftsmith.data.prompts import Conversation
from draftsmith.data.regenerate import OpenAIBackend, RegenConfig, regenerate, server_model
from draftsmith.errors import DraftsmithError

CFG = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2, temperature=0.0)


def dead_url() -> str:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def asks(n: int, word: str = "q") -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"{word} {i}"}]) for i in range(n)]


def counted(backend: OpenAIBackend) -> list[int]:
    """The requests `backend` sends, counted (retries included)."""
    sent: list[int] = []
    create = backend.create

    def count(messages: Any) -> Any:
        sent.append(1)
        return create(messages)

    backend.create = count  # type: ignore[method-assign]
    return sent


def run(convs: list[Conversation], out: Path, backend: OpenAIBackend, tok: Any) -> dict:
    try:
        return regenerate(convs, out, backend, tok, CFG, False, lambda s: None)
    finally:
        backend.close()


def slow_models_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        await asyncio.sleep(0.5)
        return {"object": "list", "data": []}

    return app


def test_listing_models_of_no_server_says_so_not_pass_model() -> None:
    url = dead_url()
    backend = OpenAIBackend(url, "", CFG, timeout=2)
    with pytest.raises(DraftsmithError) as e:
        server_model(backend.client, url)
    backend.close()
    msg = str(e.value)
    assert msg.startswith(f"{url}: no server answered (Connection error.)"), msg
    assert "is it running" in msg and "/v1" in msg and "--model" not in msg
    with running(slow_models_app()) as url:  # a timeout: no answer either
        backend = OpenAIBackend(url, "", CFG, timeout=0.2)
        with pytest.raises(DraftsmithError, match=r"no server answered \(Request timed out"):
            server_model(backend.client, url)
        backend.close()


def test_a_dead_server_stops_the_run_after_one_chunk(target, tmp_path: Path) -> None:
    url, out = dead_url(), tmp_path / "a.jsonl"
    backend = OpenAIBackend(url, "m", CFG, concurrency=2, retries=1, backoff=0.01, timeout=2)
    sent = counted(backend)
    began = time.monotonic()
    with pytest.raises(DraftsmithError) as e:
        run(asks(40), out, backend, target.tokenizer)
    assert time.monotonic() - began < 3
    assert len(sent) == 2 * 2  # one chunk of 2, each tried twice; not 20 chunks of it
    msg = str(e.value)
    assert msg.startswith(f"regenerate: no server answered at {url}: none of the 2 requests"), msg
    assert "--retries 1; 38 conversations left unasked" in msg
    assert f"({out} keeps the 0 conversations answered before; a rerun resumes" in msg
    assert out.read_text() == ""


FINE_S, SLOW_S = 2.0, 2.5  # a timeout answers meet on a loaded machine (0.2 s: not always)


def picky_app(calls: list[str]) -> FastAPI:
    """A 400 for "bad" prompts, slower than the client waits for "slow" ones, else an answer."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        text = (await request.json())["messages"][-1]["content"]
        calls.append(text)
        if text.startswith("bad"):
            return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)
        if text.startswith("slow"):
            await asyncio.sleep(SLOW_S)
        return ok_reply()

    return app


def test_per_request_failures_do_not_stop_the_run(target, tmp_path: Path) -> None:
    """A chunk of a 400 and a timeout, one of a timeout among answers, one of 400s alone: the
    server answered, so every chunk is asked and the failures counted."""
    convs = [Conversation([{"role": "user", "content": w}]) for w in
             ("bad 0", "slow 0", "slow 1", "fine 0", "bad 1", "bad 2", "fine 1", "fine 2")]
    calls: list[str] = []
    with running(picky_app(calls)) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=2, retries=0, timeout=FINE_S)
        stats = run(convs, tmp_path / "a.jsonl", backend, target.tokenizer)
    assert len(calls) == 8 and stats["failed"] == 5 and stats["answered"] == 3
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 3
    json.dumps(stats)
