"""The server's batch loop under review: shutdown while jobs run or fail, cancelled jobs and the
queue's bound, an engine error's count, starvation of a wider kind, seeded jobs and the RNG."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import write_tiny_folder
from test_serve_units import FakeEngine, FakeLive, job, wait_done

from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine
from draftsmith.serve.jobs import Job
from draftsmith.serve.protocol import ApiError, ServeConfig, parse_completion
from draftsmith.serve.scheduler import Scheduler


class BoomLive(FakeLive):
    def step(self, n: int) -> None:
        super().step(n)
        if self.eng.boom.is_set():
            self.eng.boom.clear()
            raise RuntimeError("boom")


class BoomEngine(FakeEngine):
    """FakeEngine whose next step raises once `boom` is set."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.boom = threading.Event()

    def open(self, rows: int, params) -> BoomLive:
        self.gate.wait(10)
        self.batches.append(rows)
        self.kinds.append(params.kind)
        return BoomLive(self, rows, params.kind)


def until(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline
        time.sleep(0.01)


def ticked(eng: FakeEngine, **kw) -> Scheduler:
    """A started scheduler over `eng`, whose steps wait for `eng.ticks` releases."""
    eng.ticks = threading.Semaphore(0)
    s = Scheduler(eng, max_queue=kw.pop("max_queue", 8), **kw)
    s.start()
    return s


def boom_batch(max_tokens: int) -> tuple[BoomEngine, Scheduler, dict[str, list], dict[str, Job]]:
    """Jobs a and b of `max_tokens` in one running batch of a BoomEngine."""
    eng = BoomEngine(max_batch=4, max_tokens=max_tokens)
    eng.gate.clear()
    s = ticked(eng, batch_wait=0.3)
    ev: dict[str, list] = {t: [] for t in "ab"}
    jobs = {t: job(t, ev[t], max_tokens=max_tokens) for t in "ab"}
    for j in jobs.values():
        s.submit(j)
    eng.gate.set()
    until(lambda: eng.batches == [2])
    return eng, s, ev, jobs


def stopping(s: Scheduler, timeout: float) -> threading.Thread:
    t = threading.Thread(target=s.stop, args=(timeout,), daemon=True)
    t.start()
    until(lambda: s._stopping)
    return t


def test_a_shutdown_answers_the_jobs_of_a_batch_that_outlasts_it() -> None:
    """stop() while a batch decodes slower than its timeout: the running jobs get a 503 at the
    next look and the worker ends (they once kept decoding unanswered past stop(), the engine
    still busy under whatever came next)."""
    eng = FakeEngine(max_batch=4, max_tokens=12)
    s = ticked(eng, batch_wait=0.0)
    ev: dict[str, list] = {t: [] for t in "ab"}
    for t, stream in (("a", True), ("b", False)):
        s.submit(job(t, ev[t], max_tokens=12, stream=stream))
    until(lambda: eng.batches)
    eng.ticks.release(1)
    stopper = stopping(s, 0.3)
    done = threading.Event()

    tick_until(eng, done, 0.1)  # a step every 0.1 s: the batch needs 1 s more
    stopper.join(10)
    done.set()
    assert not stopper.is_alive() and not s.alive
    for t in "ab":
        assert ev[t][-1][:2] == ("error", 503), ev[t]
        assert sum(e[0] in ("done", "error") for e in ev[t]) == 1


def test_jobs_an_engine_error_would_rerun_during_a_shutdown_get_a_503() -> None:
    """An engine error while stopping: the jobs it would rerun alone get a 503 (they were once
    queued after the queue was cleared and never answered)."""
    eng, s, ev, _ = boom_batch(12)
    stopper = stopping(s, 5.0)
    eng.boom.set()
    eng.ticks.release(100)
    stopper.join(10)
    assert not stopper.is_alive() and not s.alive
    for t in "ab":
        wait_done(ev[t], 1)
        assert ev[t][-1][:2] == ("error", 503), ev[t]


def test_an_engine_error_counts_a_cancelled_job_as_cancelled_and_reruns_the_other() -> None:
    eng, s, ev, jobs = boom_batch(6)
    s.cancel(jobs["a"])
    eng.boom.set()
    eng.ticks.release(100)
    wait_done(ev["b"], 1)
    s.stop()
    assert ev["b"][-1][0] == "done" and [e[2].text for e in ev["b"] if e[0] == "finish"] == [
        "bbbbbb"]
    m = s.metrics.snapshot(0)
    assert (m["completed"], m["cancelled"], m["failed"]) == (1, 1, 0)


def test_cancelled_queued_jobs_do_not_hold_the_queue_full() -> None:
    """Clients that left while queued behind a batch that cannot take their jobs: a new request
    is queued, not refused with a 429 for a queue of jobs nobody waits for."""
    eng = FakeEngine(max_batch=2, max_tokens=12)
    s = ticked(eng, max_queue=2, batch_wait=0.0)
    ev: list = []
    s.submit(job("a", ev, max_tokens=12))
    until(lambda: eng.batches)
    gone = [job("s", [], temperature=0.7), job("t", [], temperature=0.7)]
    for j in gone:
        s.submit(j)
    with pytest.raises(ApiError):
        s.submit(job("x", []))
    for j in gone:
        s.cancel(j)
    s.submit(job("c", ev, max_tokens=2))
    assert s.queued() == 1
    eng.ticks.release(100)
    wait_done(ev, 2)
    s.stop()
    m = s.metrics.snapshot(0)
    assert (m["completed"], m["cancelled"]) == (2, 2)


def test_a_stream_of_greedy_jobs_never_starves_a_sampled_one() -> None:
    """A batch kept full of greedy jobs, one sampled job queued among them: no greedy job
    queued after it joins the greedy batch, so it runs once that batch drains (within two
    max_tokens of steps), with the greedy jobs queued behind it in its own batch."""
    eng = FakeEngine(max_batch=4, max_tokens=8)
    s = Scheduler(eng, max_queue=64, batch_wait=0.0)
    s.start()
    ev: list = []
    stop = threading.Event()
    order: list[str] = []

    def feed() -> None:
        k = 0
        while not stop.is_set():
            if s.queued() < 4:
                j = job("g", [], max_tokens=8)
                j._sink = lambda e, k=k: (ev.append(e), e[0] == "done" and order.append(f"g{k}"))
                s.submit(j)
                k += 1
            time.sleep(0.001)

    eng.ticks = threading.Semaphore(0)
    threading.Thread(target=feed, daemon=True).start()
    until(lambda: len(eng.batches) == 1 and s.queued() >= 4)
    eng.ticks.release(20)
    until(lambda: eng.steps == 20)
    sampled: list = []
    ended: list[int] = []
    j = job("s", [], temperature=0.9, max_tokens=8)
    j._sink = lambda e: (sampled.append(e), e[0] == "done" and ended.append(eng.steps))
    s.submit(j)
    at = eng.steps

    def tick() -> None:  # slow enough for the feeder to keep the queue full
        while not stop.is_set():
            eng.ticks.release(1)
            time.sleep(0.002)

    threading.Thread(target=tick, daemon=True).start()
    wait_done(sampled, 1)
    stop.set()
    eng.ticks.release(10_000)
    s.stop()
    assert sampled[-1][0] == "done" and "temperature" in eng.kinds
    assert ended[0] - at <= 2 * 8 + 1


# ---- the tiny CPU engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> ServeEngine:
    d = write_tiny_folder(tmp_path_factory.mktemp("sched_review"), "llama", seed=2)
    return load_engine(str(d), None, "cpu", torch.float32,
                       EngineConfig(max_batch=4, max_prompt_tokens=96, max_tokens=40))


def run(s: Scheduler, engine: ServeEngine, prompt: str, **body) -> list[str]:
    cfg = ServeConfig("tiny", (), max_tokens=40, max_prompt_tokens=96, max_batch=4)
    ev: list = []
    body = {"prompt": prompt, "max_tokens": 12, **body}
    s.submit(Job(parse_completion(body, cfg, engine.text_side), ev.append))
    wait_done(ev, 1)
    assert ev[-1][0] == "done", ev
    return [e[2].text for e in ev if e[0] == "finish"]


def test_seeded_jobs_repeat_and_do_not_fix_the_draws_of_unseeded_ones(engine) -> None:
    """A seeded job draws the same whatever ran before it; an unseeded job that runs after it
    is not a function of that seed (two such once drew alike, token for token)."""
    s = Scheduler(engine, batch_wait=0.0)
    s.start()
    try:
        seeded = run(s, engine, "hello", temperature=1.5, seed=7, n=2)
        after = [run(s, engine, "xyz", temperature=2.0, max_tokens=16)]
        assert run(s, engine, "hello", temperature=1.5, seed=7, n=2) == seeded
        after.append(run(s, engine, "xyz", temperature=2.0, max_tokens=16))
        assert run(s, engine, "hello", temperature=1.5, seed=7, n=2) == seeded
    finally:
        s.stop()
    assert after[0] != after[1]


def tick_until(eng, done: threading.Event, every: float) -> None:
    """A fake engine's decode step every `every` seconds, in a thread, until `done` is set."""

    def ticks() -> None:
        while not done.is_set():
            eng.ticks.release(1)
            time.sleep(every)

    threading.Thread(target=ticks, daemon=True).start()
