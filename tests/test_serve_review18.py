"""`draftsmith serve` under review, round eighteen: a streaming client that closes its stream
early frees its row (running) or its place (queued), and the next request completes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve import served as serve_app  # noqa: E402
from test_serve_units import FakeEngine  # noqa: E402

from draftsmith.serve.app import create_app  # noqa: E402
from draftsmith.serve.protocol import ServeConfig  # noqa: E402

LONG = 1000  # a stream's max_tokens: far more steps than any test releases


def gated_engine() -> FakeEngine:
    """One row; every step waits for a release of `ticks`; room for a LONG answer."""
    eng = FakeEngine(max_batch=1, max_tokens=LONG)
    eng.ticks = threading.Semaphore(0)
    eng.max_len, eng.vocab_size = 4 * LONG, 50
    return eng


@contextmanager
def served(eng: FakeEngine) -> Iterator[tuple[str, Any]]:
    """The app over `eng` under uvicorn in a thread; yields its URL and scheduler."""
    app = create_app(eng, ServeConfig("m", max_batch=1))
    with serve_app(app) as url:
        try:
            yield url, app.state.scheduler
        finally:
            eng.ticks.release(10 * LONG)


def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def body(stream: bool, max_tokens: int) -> dict[str, Any]:
    return {"prompt": [1], "max_tokens": max_tokens, "stream": stream}


def stream_then_close(url: str, chunks: int = 1) -> list[str]:
    """A stream read up to its first `chunks` data lines (0: its 200 only), then closed, as a
    client that gives up."""
    lines: list[str] = []
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", url + "/v1/completions", json=body(True, LONG)) as r:
        assert r.status_code == 200
        if not chunks:
            return lines
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == chunks:
                    return lines
    raise AssertionError(f"the stream ended before {chunks} chunk(s): {lines}")


def tick_until(eng: FakeEngine, cond: Callable[[], bool], most: int = 200) -> None:
    """Steps released one at a time until `cond` (the worker looks after each step)."""
    for _ in range(most):
        if cond():
            return
        eng.ticks.release()
        time.sleep(0.02)
    assert cond(), "timed out"


def metric(sched: Any, name: str) -> int:
    return sched.metrics.snapshot(0)[name]


def test_a_stream_closed_mid_answer_frees_its_row_for_the_next_request() -> None:
    """The client reads one chunk and closes: the stream's generator ends, its job is cancelled
    at the worker's next look and the only row is free: the next request completes long before
    the first answer's LONG steps could have run."""
    eng = gated_engine()
    with served(eng) as (url, sched):
        (line,) = stream_then_close(url)
        assert line.startswith('data: {"id"'), line
        tick_until(eng, lambda: metric(sched, "cancelled") == 1)
        assert eng.steps < LONG // 4
        eng.ticks.release(100)
        r = httpx.post(url + "/v1/completions", json=body(False, 6), timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a" * 6, r.text
        assert eng.batches == [1, 1]
        assert (metric(sched, "completed"), metric(sched, "cancelled")) == (1, 1)


def test_a_stream_closed_while_queued_never_runs() -> None:
    """A queued stream whose client leaves after its 200 is dropped: /health stops counting it,
    and when the running request ends the next one runs, never the stream."""
    eng = gated_engine()
    with served(eng) as (url, sched):
        got: dict[str, httpx.Response] = {}

        def post(name: str, tokens: int) -> threading.Thread:
            def go() -> None:
                got[name] = httpx.post(url + "/v1/completions", json=body(False, tokens),
                                       timeout=60)

            t = threading.Thread(target=go, daemon=True)
            t.start()
            return t

        a = post("a", 6)
        until(lambda: eng.batches == [1])
        assert stream_then_close(url, 0) == []
        until(lambda: sched.queued() == 0)  # its cancel reached the queue
        c = post("c", 3)
        until(lambda: sched.queued() == 1)
        eng.ticks.release(100)
        a.join(30)
        c.join(30)
        assert got["a"].json()["choices"][0]["text"] == "a" * 6, got["a"].text
        assert got["c"].json()["choices"][0]["text"] == "a" * 3, got["c"].text
        assert len(eng.adds) == 2 and eng.steps < 20  # a and c prefilled, never the stream
        assert (metric(sched, "completed"), metric(sched, "cancelled")) == (2, 1)


def test_a_frontends_stream_closed_mid_answer_frees_its_row(monkeypatch) -> None:
    """`serve --frontends`: the frontend's stream ends, its cancel crosses the pipe, and the
    engine's only row is free for the next request."""
    import os

    from test_serve_review4 import Text

    from draftsmith.serve.frontends import Frontends

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))  # Text, in the frontend
    eng = gated_engine()
    eng.text_side = Text()
    f = Frontends(eng, ServeConfig("m", max_batch=1), 1).start()
    try:
        (line,) = stream_then_close(f.url)
        assert line.startswith('data: {"id"'), line
        tick_until(eng, lambda: metric(f.sched, "cancelled") == 1)
        assert eng.steps < LONG // 4
        eng.ticks.release(100)
        r = httpx.post(f.url + "/v1/completions", json=body(False, 6), timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a" * 6, r.text
        assert (metric(f.sched, "completed"), metric(f.sched, "cancelled")) == (1, 1)
    finally:
        eng.ticks.release(10 * LONG)
        f.stop()
