"""`draftsmith serve` under review, round nine: /health says 503 "stopping" while a stop drains
the running batch, and a forced quit's 503s count in /metrics' `stopped` once."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_serve_review6 import blocked_engine, ctrl_c_twice, interrupted, post  # noqa: E402
from test_serve_scheduler_review import stopping, ticked, until  # noqa: E402
from test_serve_units import FakeEngine, job, wait_done  # noqa: E402

from draftsmith.serve import scheduler as serve_scheduler  # noqa: E402
from draftsmith.serve.app import create_app  # noqa: E402
from draftsmith.serve.protocol import ServeConfig  # noqa: E402


def get(app: Any, route: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(route)

    return asyncio.run(go())


def test_health_answers_503_stopping_while_a_stop_drains_the_running_batch() -> None:
    """Every submit gets a 503 once the stop began; /health said "ok" (200) until the batch
    ended, so a balancer kept sending requests there for up to the stop's timeout."""
    eng = FakeEngine(max_batch=1, max_tokens=12)
    eng.max_len = 64
    s = ticked(eng, batch_wait=0.0)
    app = create_app(eng, ServeConfig("m", max_batch=1), s)
    ev: list = []
    try:
        assert get(app, "/health").status_code == 200
        s.submit(job("a", ev, max_tokens=12))
        until(lambda: eng.batches == [1])
        stopper = stopping(s, 5.0)
        r = get(app, "/health")
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "stopping" and "shutting down" in r.json()["reason"]
        assert s.alive  # the batch still decodes: the worker is fine, the server is stopping
    finally:
        eng.ticks.release(100)
        s.stop()
    stopper.join(5)
    wait_done(ev, 1)
    assert get(app, "/health").json()["status"] == "stopping"  # not "the worker is not running"


def test_a_cut_off_job_counts_as_stopped_once_not_also_cancelled() -> None:
    """`Scheduler.cut_off` (the forced quit's 503, sent by the app): counted stopped at once; the
    worker's next look, which sees the job cancelled, counts nothing more."""
    eng = FakeEngine(max_batch=1, max_tokens=12)
    s = ticked(eng, batch_wait=0.0)
    j = job("a", [], max_tokens=12)
    s.submit(j)
    until(lambda: eng.batches == [1])
    s.cut_off(j)
    assert s.metrics.snapshot(0)["stopped"] == 1
    eng.ticks.release(100)
    until(lambda: j.done)
    s.stop()
    m = s.metrics.snapshot(0)
    assert (m["stopped"], m["cancelled"], m["completed"]) == (1, 0, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_quits_503_counts_as_stopped(monkeypatch, stream: bool) -> None:
    """Two ctrl-Cs cut the running request off with a 503 (a stream: its error event); /metrics
    counted it as a client that left ("cancelled") once the worker looked, never as stopped."""
    made: list[serve_scheduler.Scheduler] = []

    class Kept(serve_scheduler.Scheduler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(serve_scheduler, "Scheduler", Kept)
    eng, got = blocked_engine(), {}

    def client(url: str) -> None:
        a = post(url, got, "a", stream)
        until(lambda: eng.batches == [1])
        if stream:
            until(a.head.is_set, 30)  # its 200 is out
        ctrl_c_twice()
        a.join(30)

    interrupted(eng, client)
    eng.ticks.release(100)
    (s,) = made
    until(lambda: not s.alive)
    assert got["a"][0] == (200 if stream else 503), got
    m = s.metrics.snapshot(0)
    assert (m["stopped"], m["cancelled"], m["completed"]) == (1, 0, 0), m


def test_the_stopping_flag_reaches_a_frontends_health() -> None:
    """`EngineLink.status` is what a frontend's /health reads: it carries `stopping`."""
    from draftsmith.serve.frontends import EngineLink

    eng = FakeEngine(max_batch=1, max_tokens=12)
    s = ticked(eng, batch_wait=0.0)
    link = EngineLink(s)
    assert link.status()["stopping"] is False
    t = threading.Thread(target=s.stop, daemon=True)
    t.start()
    t.join(5)
    assert link.status()["stopping"] is True
