"""`draftsmith serve` under review: ctrl-C answers every request and ends without a traceback,
once (queued requests 503 at once, the running batch may end) or twice (a forced quit)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve_units import FakeEngine  # noqa: E402

from draftsmith.serve.app import run_server  # noqa: E402
from draftsmith.serve.frontends import listen  # noqa: E402
from draftsmith.serve.protocol import ServeConfig  # noqa: E402


def blocked_engine() -> FakeEngine:
    """One row; every step waits for a release of `ticks`."""
    eng = FakeEngine(max_batch=1, max_tokens=6)
    eng.ticks = threading.Semaphore(0)
    eng.max_len, eng.vocab_size = 64, 50
    return eng


def interrupted(eng: FakeEngine, client: Callable[[str], None]) -> None:
    """Serve `eng` in this (the main) thread, as `draftsmith serve` does, while `client(url)`
    runs in another; whatever it leaves running is cut off by two SIGINTs."""
    sock = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    failed: list[BaseException] = []
    served = threading.Event()

    def run() -> None:
        try:
            deadline = time.time() + 10
            while time.time() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.05)
            client(url)
        except BaseException as e:  # noqa: BLE001 (raised again in the test's thread)
            failed.append(e)
            eng.ticks.release(1000)
            for _ in range(2):  # the server ends whatever the state it was left in
                if not served.wait(1):
                    os.kill(os.getpid(), signal.SIGINT)

    helper = threading.Thread(target=run, daemon=True)
    helper.start()
    try:
        run_server(eng, ServeConfig("m", max_batch=1), "127.0.0.1", 0, "warning", sock=sock)
    finally:
        served.set()
    helper.join(10)
    if failed:
        raise failed[0]


class Posted(threading.Thread):
    """A request in a thread of its own; `head` is set once its response's status line came."""

    head: threading.Event


def post(url: str, out: dict, name: str, stream: bool = False) -> Posted:
    body = {"prompt": [1], "max_tokens": 6, "stream": stream}

    def go() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as r:
                t.head.set()
                r.read()
            out[name] = (r.status_code, r.text)
        except httpx.HTTPError as e:
            out[name] = (0, repr(e))

    t = Posted(target=go, daemon=True)
    t.head = threading.Event()
    t.start()
    return t


def ctrl_c_twice() -> None:
    """Two SIGINTs, the second once the server has reacted to the first (its stop thread runs):
    two sent a fixed pause apart could both arrive before the handler ran, which then ran once."""
    before = set(threading.enumerate())
    os.kill(os.getpid(), signal.SIGINT)
    until(lambda: any(t.name == "draftsmith-stop" for t in set(threading.enumerate()) - before),
          30)
    os.kill(os.getpid(), signal.SIGINT)


def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline
        time.sleep(0.02)


def queued(url: str) -> int:
    return httpx.get(url + "/health", timeout=2).json()["queued"]


def test_ctrl_c_answers_queued_requests_at_once_and_lets_the_running_one_end(capfd) -> None:
    """A ctrl-C with one request decoding and one queued: uvicorn waited for both connections,
    so the queue ran to its end (or until a second ctrl-C cut everything off); the queued one
    gets its 503 now, the running one its answer, and the server ends with no traceback."""
    eng, got = blocked_engine(), {}

    def client(url: str) -> None:
        a = post(url, got, "a")
        until(lambda: eng.batches == [1])
        b = post(url, got, "b")
        until(lambda: queued(url) == 1)
        os.kill(os.getpid(), signal.SIGINT)
        b.join(10)  # at once, or never while "a" holds the batch: load may delay it
        assert got.get("b", (None,))[0] == 503, got  # while "a" still decodes
        assert "shutting down" in got["b"][1]
        eng.ticks.release(100)
        a.join(5)

    interrupted(eng, client)
    assert got["a"][0] == 200 and json.loads(got["a"][1])["choices"][0]["text"] == "a" * 6
    err = capfd.readouterr().err
    assert "1 queued request(s) answered 503" in err and "Traceback" not in err


@pytest.mark.parametrize("stream", [False, True])
def test_ctrl_c_twice_cuts_the_running_request_off_with_an_answer(capfd, stream: bool) -> None:
    """A second ctrl-C forces the quit: each cancelled request once printed a traceback, the
    lifespan another, and the client met a dropped connection; now it gets a 503 (a stream: an
    error event and [DONE]) and the server says it was forced."""
    eng, got = blocked_engine(), {}

    def client(url: str) -> None:
        a = post(url, got, "a", stream)
        until(lambda: eng.steps == 0 and eng.batches == [1])
        if stream:
            until(a.head.is_set, 30)  # its 200 is out
        ctrl_c_twice()
        a.join(30)

    interrupted(eng, client)
    eng.ticks.release(100)
    status, text = got["a"]
    if stream:
        assert status == 200 and text.endswith("data: [DONE]\n\n"), text
        assert '"message": "the server was stopped (forced quit)"' in text
    else:
        assert status == 503 and "forced quit" in json.loads(text)["error"]["message"]
        assert json.loads(text)["error"]["code"] == "unavailable"  # as every stopping 503
    err = capfd.readouterr().err
    assert "forced quit" in err and "Traceback" not in err, err


def test_stopping_the_frontends_answers_queued_requests_at_once(monkeypatch) -> None:
    """`serve --frontends`: its stop (ctrl-C) asked the frontends to end first, and they waited
    for their connections, so the engine ran its whole queue (up to their 15 s, then a dropped
    connection); the queued request gets its 503 now, the running one its answer."""
    from test_serve_review4 import Text

    from draftsmith.serve.frontends import Frontends

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))  # Text, in the frontend
    eng, got = blocked_engine(), {}
    eng.text_side = Text()
    f = Frontends(eng, ServeConfig("m", max_batch=1), 1).start()
    try:
        a = post(f.url, got, "a")
        until(lambda: eng.batches == [1])
        b = post(f.url, got, "b")
        until(lambda: f.sched.queued() == 1)
        stopper = threading.Thread(target=f.stop, daemon=True)
        stopper.start()
        b.join(10)  # at once, or never while "a" holds the batch: load may delay it
        assert got.get("b", (None,))[0] == 503, got  # while "a" still decodes
        eng.ticks.release(100)
        a.join(5)
        stopper.join(10)
        assert got["a"][0] == 200 and not stopper.is_alive()
    finally:
        eng.ticks.release(1000)
        f.stop()
