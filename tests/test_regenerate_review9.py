"""`data regenerate` against a server keeps --concurrency conversations in flight: the next is
begun as soon as one ends (chunks waited for their slowest answer, idling the other slots), and
the answers are still written in input order, a chunk at a time, so a resumed run's file is an
uninterrupted run's."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from test_data_regenerate import ok_reply, running
from test_regenerate_review4 import asks

from draftsmith.data.prompts import Conversation, read_jsonl_tail_safe
from draftsmith.data.regenerate import BUFFERED, OpenAIBackend, RegenConfig, regenerate
from draftsmith.errors import DraftsmithError

pytest.importorskip("openai")


class Seen:
    """What the fake server saw: requests in flight (most at once), each one's start and end."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.starts: dict[str, float] = {}
        self.ends: dict[str, float] = {}


def timed_app(seen: Seen, delay: dict[str, float], hold: threading.Event | None = None,
              ) -> FastAPI:
    """Answers "re: <last message>" after `delay` of it (0.01 s else); "held" prompts wait for
    `hold` too."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        text = (await request.json())["messages"][-1]["content"]
        seen.now += 1
        seen.most = max(seen.most, seen.now)
        seen.starts[text] = time.monotonic()
        await asyncio.sleep(delay.get(text, 0.01))
        while hold is not None and text.startswith("held") and not hold.is_set():
            await asyncio.sleep(0.01)
        seen.now -= 1
        seen.ends[text] = time.monotonic()
        body = ok_reply()
        body["choices"][0]["message"]["content"] = f"re: {text}"
        return body

    return app


def cfg(chunk: int) -> RegenConfig:
    return RegenConfig(max_new_tokens=8, max_len=256, batch_size=chunk, temperature=0.0)


def answer(url: str, convs: list[Conversation], out: Path, tok: Any, concurrency: int,
           said: list[str] | None = None, wrap: Any = None) -> dict[str, int]:
    backend = OpenAIBackend(url, "m", cfg(concurrency), concurrency, retries=1, backoff=0.01,
                            timeout=5)
    if wrap is not None:
        backend.one = wrap(backend.one)  # type: ignore[method-assign]
    try:
        return regenerate(convs, out, backend, tok, cfg(concurrency), False,
                          (said if said is not None else []).append)
    finally:
        backend.close()


def talks(n: int) -> list[Conversation]:
    """`n` conversations, every third of two user turns."""
    return [Conversation([{"role": "user", "content": f"q {i}"}]
                         + ([{"role": "assistant", "content": "old"},
                             {"role": "user", "content": f"and {i}?"}] if i % 3 == 0 else []))
            for i in range(n)]


def ids(out: Path) -> list[str]:
    return [r["meta"]["prompt_id"] for r in read_jsonl_tail_safe(out)]


def test_answers_are_written_in_input_order_whatever_order_they_finish(target,
                                                                      tmp_path: Path) -> None:
    convs, rng = talks(24), random.Random(0)
    delay = {f"q {i}": rng.choice([0.0, 0.05, 0.15]) for i in range(24)}
    seen, out = Seen(), tmp_path / "a.jsonl"
    with running(timed_app(seen, delay)) as url:
        stats = answer(url, convs, out, target.tokenizer, 4)
    assert stats["answered"] == 24 and ids(out) == [c.id for c in convs]
    second = [r["messages"] for r in read_jsonl_tail_safe(out)][0]
    assert [m["content"] for m in second[-3:]] == ["re: q 0", "and 0?", "re: and 0?"]
    assert seen.starts["and 0?"] >= seen.ends["q 0"]  # a conversation's turns in turn
    marks = [r["meta"]["write"] for r in read_jsonl_tail_safe(out)]
    assert marks == [[i % 4, 4] for i in range(24)]  # a write per chunk of --concurrency


def test_a_slow_conversation_does_not_idle_the_other_slots(target, tmp_path: Path) -> None:
    seen = Seen()
    with running(timed_app(seen, {"q 1": 1.5})) as url:
        answer(url, asks(16), tmp_path / "a.jsonl", target.tokenizer, 4)
    assert seen.most == 4
    before = [k for k in range(4, 16) if seen.starts[f"q {k}"] < seen.ends["q 1"]]
    assert len(before) >= 8, before  # later chunks begun while the slow one was answered
    assert ids(tmp_path / "a.jsonl") == [c.id for c in asks(16)]


def stop_after(n: int, error: type[BaseException]) -> Any:
    """A wrapper of `one` raising `error` in place of the request after `n` requests."""
    sent, lock = [0], threading.Lock()

    def wrap(one: Any) -> Any:
        def stopping(messages: Any) -> Any:
            with lock:
                sent[0] += 1
                if sent[0] > n:
                    raise error("stop")
            return one(messages)
        return stopping

    return wrap


@pytest.mark.parametrize("error", [KeyboardInterrupt, DraftsmithError])
def test_a_run_stopped_midway_then_rerun_is_the_uninterrupted_run(target, tmp_path: Path,
                                                                  error: type) -> None:
    convs, rng = talks(30), random.Random(1)
    delay = {f"q {i}": rng.choice([0.0, 0.03, 0.1]) for i in range(30)}
    cut, whole, said = tmp_path / "cut.jsonl", tmp_path / "whole.jsonl", []
    with running(timed_app(Seen(), delay)) as url:
        with pytest.raises(error):
            answer(url, convs, cut, target.tokenizer, 3, said, stop_after(17, error))
        kept = ids(cut)
        assert 0 < len(kept) < 30 and kept == [c.id for c in convs[: len(kept)]]
        again = answer(url, convs, cut, target.tokenizer, 3)
        answer(url, convs, whole, target.tokenizer, 3)
    assert again["done_before"] == len(kept) and again["answered"] == 30 - len(kept)
    assert cut.read_bytes() == whole.read_bytes()
    if error is KeyboardInterrupt:
        line = next(s for s in said if "stopped (ctrl-C)" in s)
        assert f"keeps the {len(kept)} conversations answered before" in line
        assert "in flight or finished but not yet written are asked again" in line, line


def test_finished_conversations_held_for_a_slow_one_are_bounded(target,
                                                                 tmp_path: Path) -> None:
    hold, seen = threading.Event(), Seen()
    convs = [Conversation([{"role": "user", "content": "held 0"}]), *asks(29)]
    with running(timed_app(seen, {}, hold)) as url:
        waiter = threading.Thread(target=answer, args=(url, convs, tmp_path / "a.jsonl",
                                                       target.tokenizer, 2))
        waiter.start()
        deadline = time.monotonic() + 10
        while len(seen.starts) < BUFFERED * 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # time for any more to begin
        begun = len(seen.starts)
        hold.set()
        waiter.join(20)
    assert begun == BUFFERED * 2  # the slow one and 7 finished behind it, no more
    assert ids(tmp_path / "a.jsonl") == [c.id for c in convs]


def test_a_server_that_stops_mid_run_stops_it_keeping_the_answers(target,
                                                                 tmp_path: Path) -> None:
    out, sent, lock = tmp_path / "a.jsonl", [0], threading.Lock()
    with ExitStack() as server:
        url = server.enter_context(running(timed_app(Seen(), {})))

        def wrap(one: Any) -> Any:
            def closing(messages: Any) -> Any:
                with lock:  # the server goes away after 4 requests
                    sent[0] += 1
                    if sent[0] == 5:
                        server.close()
                return one(messages)
            return closing

        with pytest.raises(DraftsmithError) as e:
            answer(url, asks(20), out, target.tokenizer, 2, wrap=wrap)
    msg = str(e.value)
    assert msg.startswith(f"regenerate: the server at {url} stopped answering: "), msg
    assert f"14 conversations left unasked ({out} keeps the 4 conversations" in msg
    assert sent[0] == 6 and ids(out) == [c.id for c in asks(4)]
