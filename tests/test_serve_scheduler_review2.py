"""The server's batch loop under review, round two: the 503s of a stop carry OpenAI's code."""

from __future__ import annotations

import threading

import pytest
from test_serve_scheduler_review import boom_batch, stopping, tick_until, ticked, until
from test_serve_units import FakeEngine, job, wait_done

from draftsmith.serve.protocol import ApiError
from draftsmith.serve.scheduler import Scheduler


def body(event: tuple) -> tuple[int, dict]:
    """What the app answers for an error event (`ApiError(*event[1:])`)."""
    e = ApiError(*event[1:])
    return e.status, e.body()


def refused(s: Scheduler) -> tuple[int, dict]:
    with pytest.raises(ApiError) as e:
        s.submit(job("z", []))
    return e.value.status, e.value.body()


def test_a_stop_answers_queued_and_running_jobs_as_it_refuses_a_submit() -> None:
    """stop() with a job decoding past its timeout and one queued: both 503s are the refusal a
    submit then gets, code "unavailable" (they once carried no code)."""
    eng = FakeEngine(max_batch=1, max_tokens=12)
    s = ticked(eng, batch_wait=0.0)
    ev: dict[str, list] = {t: [] for t in "ab"}
    for t in "ab":  # a streams: the batch looks at its stop flag every step
        s.submit(job(t, ev[t], max_tokens=12, stream=True))
    until(lambda: eng.batches == [1] and s.queued() == 1)
    stopper = stopping(s, 0.2)
    wait_done(ev["b"], 1)
    done = threading.Event()

    tick_until(eng, done, 0.05)
    stopper.join(10)
    done.set()
    want = refused(s)
    assert want[0] == 503 and want[1]["error"]["code"] == "unavailable"
    for t in "ab":
        assert body(ev[t][-1]) == want, ev[t]


def test_jobs_an_engine_error_cannot_rerun_during_a_stop_get_the_same_503() -> None:
    eng, s, ev, _ = boom_batch(12)
    stopper = stopping(s, 5.0)
    eng.boom.set()
    eng.ticks.release(100)
    stopper.join(10)
    want = refused(s)
    for t in "ab":
        wait_done(ev[t], 1)
        assert body(ev[t][-1]) == want, ev[t]
