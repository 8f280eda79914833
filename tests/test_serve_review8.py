"""The server's batch loop under review, round eight: a job that joins a running batch streams
its first token at its prefill, /health's queue counts live clients, a stop's 503s are counted."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import write_tiny_folder
from test_serve_scheduler_review import stopping, tick_until, ticked, until
from test_serve_units import FakeEngine, job, wait_done

from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine
from draftsmith.serve.jobs import Job
from draftsmith.serve.protocol import ApiError, ServeConfig, parse_completion
from draftsmith.serve.scheduler import Scheduler


def deltas(events: list) -> list[str]:
    return [e[2] for e in events if e[0] == "delta"]


def two_row_batch() -> tuple[FakeEngine, Scheduler, dict[str, list]]:
    """A batch of two rows decoding, a1 of 12 tokens and a2 of 2 (its slot frees after one
    step), each step waiting for a tick; "b" is the events' list for a joiner."""
    eng = FakeEngine(max_batch=2, max_tokens=12)
    eng.gate.clear()
    s = ticked(eng, batch_wait=0.3, join_wait=0.0)
    ev: dict[str, list] = {t: [] for t in ("a1", "a2", "b")}
    s.submit(job("a", ev["a1"], max_tokens=12))
    s.submit(job("c", ev["a2"], max_tokens=2))
    eng.gate.set()
    until(lambda: eng.batches == [2])
    return eng, s, ev


def test_a_joining_stream_gets_its_first_token_before_the_next_step() -> None:
    """b joins the slot a2 frees; its prefill's token goes out while the batch waits for its
    next step (it once waited for that step)."""
    eng, s, ev = two_row_batch()
    s.submit(job("b", ev["b"], max_tokens=3, stream=True))
    eng.ticks.release(1)  # a2 ends at this step; b joins its slot
    until(lambda: len(eng.adds) == 2)
    try:
        until(lambda: deltas(ev["b"]))  # the next step never comes until the ticks' release
        assert eng.steps == 1 and deltas(ev["b"]) == ["b"]
    finally:
        eng.ticks.release(100)
        wait_done(ev["b"], 1)
        s.stop()
    assert "".join(deltas(ev["b"])) == "bbb"


def test_a_joiner_that_ends_at_its_prefill_frees_its_slot_without_a_step() -> None:
    eng, s, ev = two_row_batch()
    s.submit(job("b", ev["b"], max_tokens=1))
    eng.ticks.release(1)
    try:
        wait_done(ev["b"], 1)
        assert eng.steps == 1 and [e[2].text for e in ev["b"] if e[0] == "finish"] == ["b"]
    finally:
        eng.ticks.release(100)
        s.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> ServeEngine:
    d = write_tiny_folder(tmp_path_factory.mktemp("serve_review8"), "llama", seed=3)
    return load_engine(str(d), None, "cpu", torch.float32,
                       EngineConfig(max_batch=2, max_prompt_tokens=64, max_tokens=24))


def test_the_cpu_engine_streams_a_joiners_first_token_at_its_prefill(engine) -> None:
    """On the tiny CPU engine: the joiner's first delta goes out before any step after its
    prefill, and its streamed answer is the one it gets alone."""
    cfg = ServeConfig("tiny", (), max_tokens=24, max_prompt_tokens=64, max_batch=2)
    steps: list[int] = []  # each step call's count, in order
    added: list[int] = []  # the steps taken before each prefill
    opened = engine.open

    def counting(rows, params):
        live = opened(rows, params)
        step, add = live.step, live.add
        live.step = lambda n: (steps.append(n), step(n))[1]
        live.add = lambda *a: (added.append(sum(steps)), add(*a))[1]
        return live

    def request(prompt: str, n: int, stream: bool, sink) -> Job:
        body = {"prompt": prompt, "max_tokens": n, "stream": stream, "temperature": 0}
        return Job(parse_completion(body, cfg, engine.text_side), sink)

    ev: dict[str, list] = {t: [] for t in ("alone", "long", "short", "b")}
    at: list[int] = []  # the steps taken when the joiner's first delta went out

    def joiner(e: tuple) -> None:
        if e[0] == "delta" and not at:
            at.append(sum(steps))
        ev["b"].append(e)

    def short(e: tuple) -> None:  # the joiner queued as the short row ends: it takes its slot
        ev["short"].append(e)
        if e[0] == "done":
            s.submit(request("hello", 6, True, joiner))

    s = Scheduler(engine, batch_wait=0.3, join_wait=0.0)
    s.start()
    try:
        s.submit(request("hello", 6, True, ev["alone"].append))
        wait_done(ev["alone"], 1)
        engine.open = counting
        s.submit(request("hello there", 20, False, ev["long"].append))
        s.submit(request("ab", 2, False, short))
        wait_done(ev["b"], 1)
        wait_done(ev["long"], 1)
    finally:
        engine.open = opened
        s.stop()
    assert s.metrics.snapshot(0)["joined_rows"] == 1 and len(added) == 2
    assert deltas(ev["b"]) and deltas(ev["b"]) == deltas(ev["alone"])
    assert at == [added[1]]  # its first delta before any step after its prefill


def test_health_counts_only_queued_clients_still_waiting() -> None:
    eng = FakeEngine(max_batch=1, max_tokens=6)
    s = ticked(eng, batch_wait=0.0)
    try:
        s.submit(job("a", [], max_tokens=6))
        until(lambda: eng.batches == [1])
        queued = [job(t, []) for t in "bcd"]
        for j in queued:
            s.submit(j)
        s.cancel(queued[0])
        s.cancel(queued[2])
        assert s.queued() == 1
        st = s.status()
        assert st["queued"] == 1 and st["metrics"]["queued"] == 1
    finally:
        eng.ticks.release(100)
        s.stop()


def test_a_stops_503s_are_counted_in_metrics() -> None:
    """A job decoding past the stop's timeout, one queued, one queued whose client left (no
    answer: counted cancelled) and a submit refused afterwards: three 503s counted "stopped"."""
    eng = FakeEngine(max_batch=1, max_tokens=12)
    s = ticked(eng, batch_wait=0.0)
    ev: dict[str, list] = {t: [] for t in "abc"}
    for t in "abc":
        s.submit(job(t, ev[t], max_tokens=12, stream=True))
    until(lambda: eng.batches == [1] and len(s._queue) == 2)
    s.cancel(s._queue[1])
    stopper = stopping(s, 0.2)
    wait_done(ev["b"], 1)
    done = threading.Event()
    tick_until(eng, done, 0.05)
    stopper.join(10)
    done.set()
    with pytest.raises(ApiError):
        s.submit(job("z", []))
    for t in "ab":
        assert ev[t][-1][:2] == ("error", 503), ev[t]
    assert [e for e in ev["c"] if e[0] == "error"] == []
    m = s.metrics.snapshot(s.queued())
    assert (m["stopped"], m["cancelled"], m["completed"], m["requests"]) == (3, 1, 0, 3)


def test_503s_of_a_failed_batch_during_a_stop_are_counted() -> None:
    from test_serve_scheduler_review import boom_batch

    eng, s, ev, _ = boom_batch(12)
    stopper = stopping(s, 5.0)
    eng.boom.set()
    eng.ticks.release(100)
    stopper.join(10)
    for t in "ab":
        wait_done(ev[t], 1)
    until(lambda: s.metrics.snapshot(0)["stopped"] >= 2)  # counted by the worker, maybe later
    time.sleep(0.05)
    assert s.metrics.snapshot(0)["stopped"] == 2
