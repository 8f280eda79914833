"""Review of `data regenerate` against a server: a ctrl-C stops at once, the answers written
kept, the requests in flight abandoned (they held the exit up to the request timeout)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from test_data_regenerate import ok_reply, running
from test_data_review import recording_app

from draftsmith.data.prompts import Conversation
from draftsmith.data.regenerate import OpenAIBackend, RegenConfig, regenerate_file

# a stalled request's answer comes this late (the real timeout: 600 s), unless released: at 5 s
# a loaded machine answered it before the ctrl-C was sent, the run ended unstopped and the late
# SIGINT killed the test worker
STALL_S = 60.0


def stalling_app(answered: int, stalled: threading.Event, release: threading.Event) -> FastAPI:
    """Answers the first `answered` requests at once, then stalls each until `release` (or
    STALL_S), setting `stalled` when one waits."""
    app = FastAPI()
    calls = {"n": 0}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.json()
        calls["n"] += 1
        if calls["n"] > answered:
            stalled.set()
            end = time.monotonic() + STALL_S
            while not release.is_set() and time.monotonic() < end:
                await asyncio.sleep(0.02)
        return ok_reply()

    return app


def interrupt_when(event: threading.Event, out: Path, lines: int) -> list[float]:
    """Ctrl-C to the main thread once `event` is set and `out` holds `lines` lines (a fixed
    pause raced the client's write on a loaded machine), as a terminal sends it; its time."""
    main, sent = threading.main_thread().ident, []

    def written() -> int:
        return len(out.read_text().splitlines()) if out.exists() else 0

    def go() -> None:
        if event.wait(10):
            end = time.monotonic() + 10
            while written() < lines and time.monotonic() < end:
                time.sleep(0.02)
            time.sleep(0.1)  # the next request of the window sent
            sent.append(time.monotonic())
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=go, daemon=True).start()
    return sent


def test_ctrl_c_stops_at_once_keeping_what_was_written(tmp_path, tiny_llama_dir):
    """The first ctrl-C waited for the requests in flight: ThreadPoolExecutor.shutdown and
    Python's exit join the worker threads, up to the 600 s request timeout."""
    stalled, release = threading.Event(), threading.Event()
    convs = [Conversation([{"role": "user", "content": f"question {i}"}]) for i in range(4)]
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2, temperature=0.0)
    out, said = tmp_path / "answers.jsonl", []
    before = {t for t in threading.enumerate() if not t.daemon}
    with running(stalling_app(2, stalled, release)) as url:
        try:
            sent = interrupt_when(stalled, out, 2)
            with pytest.raises(KeyboardInterrupt):
                regenerate_file(convs, out, cfg, str(tiny_llama_dir), base_url=url, model="m",
                                concurrency=2, retries=0, log=said.append)
            waited = time.monotonic() - sent[0]
            left = {t for t in threading.enumerate() if not t.daemon} - before
        finally:
            release.set()
    assert waited < 2.0, f"the ctrl-C took {waited:.1f} s"
    assert not left, f"threads Python's exit would wait for: {left}"
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in kept] == ["question 0", "question 1"]
    assert any("stopped (ctrl-C)" in s and "keeps the 2 conversations answered before" in s
               and "a rerun resumes after them" in s for s in said), said


def test_a_closed_backend_sends_no_more_requests():
    """After close (a ctrl-C), a worker whose request failed retried it, reaching the server
    after the run had stopped: now it sends nothing more."""
    bodies: list[dict] = []
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=1, temperature=0.0)
    with running(recording_app(bodies)) as url:
        backend = OpenAIBackend(url, "m", cfg, concurrency=1, retries=3, backoff=0.01)
        backend.close()
        ans = backend.one([{"role": "user", "content": "hi"}])
    assert not bodies and ans.finish.startswith("error")
