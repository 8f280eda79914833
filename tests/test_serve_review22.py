"""The server's batch loop under review, round twenty-two: a request whose own text fails to
decode (its tokenizer, its stop-string watch) fails alone, its rows freed at once, while the
streams beside it, which have already sent their first tokens, answer whole."""

from __future__ import annotations

import threading
import time

from test_serve_units import FakeEngine, job, until, wait_done

from draftsmith.serve.scheduler import Scheduler


class BadTextEngine(FakeEngine):
    """FakeEngine whose detokenizer raises on token 24 ("x"): one request's own text fails."""

    def decode(self, ids: list[int]) -> str:
        if 24 in ids:
            raise ValueError("cannot decode token 24")
        return super().decode(ids)


def _streaming(eng: BadTextEngine, max_tokens: int) -> tuple[Scheduler, dict[str, list]]:
    """A started scheduler over `eng`, held at its gate, with streams a and x queued and taken
    into one batch."""
    eng.gate.clear()
    s = Scheduler(eng, max_queue=8, batch_wait=0.3)
    s.start()
    ev: dict[str, list] = {t: [] for t in "ax"}
    for t in "ax":
        s.submit(job(t, ev[t], max_tokens=max_tokens, stream=True))
    until(lambda: s.queued() == 0)
    return s, ev


def test_a_request_whose_text_fails_to_decode_fails_alone() -> None:
    """Streams a and x in one batch; x's text raises at its first token. x gets one 500 and a
    counts as completed with its whole answer (the whole batch once failed: a, having sent a
    delta, got a 500 for x's fault)."""
    eng = BadTextEngine(max_batch=4, max_tokens=6)
    s, ev = _streaming(eng, 6)
    eng.gate.set()
    for t in "ax":
        wait_done(ev[t], 1)
    s.stop()
    assert eng.batches == [2]  # one batch, no rerun
    assert ev["a"][-1] == ("done", 6), ev["a"]
    assert "".join(e[2] for e in ev["a"] if e[0] == "delta") == "a" * 6
    errors = [e for e in ev["x"] if e[0] == "error"]
    assert len(errors) == 1 and errors[0][1] == 500 and "cannot decode" in errors[0][2]
    m = s.metrics.snapshot(0)
    assert (m["completed"], m["failed"], m["completion_tokens"]) == (1, 1, 6)


def test_a_failed_requests_rows_take_the_next_job_while_the_batch_decodes() -> None:
    """max_batch 2: x fails at its first token beside a long a; the queued b joins x's freed
    row while a still decodes, and both answer whole."""
    eng = BadTextEngine(max_batch=2, max_tokens=8)
    s, ev = _streaming(eng, 8)
    ev["b"] = []
    s.submit(job("b", ev["b"], max_tokens=4))
    eng.gate.set()
    for t in "axb":
        wait_done(ev[t], 1)
    s.stop()
    assert eng.batches == [2] and [a[1] for a in eng.adds] == [[0, 1], [1]]
    assert ev["a"][-1] == ("done", 8) and ev["b"][-1] == ("done", 4)
    assert ev["x"][-1][:2] == ("error", 500)


class SlowPrefillEngine(FakeEngine):
    """FakeEngine whose prompt pass takes `PREFILL_S`: an opening batch's prefill is engine
    time as a joiner's is."""

    PREFILL_S = 0.2

    def open(self, rows: int, params):
        live = super().open(rows, params)
        add = live.add

        def slow_add(slots, prompts, params) -> None:
            time.sleep(self.PREFILL_S)
            add(slots, prompts, params)

        live.add = slow_add
        return live


def test_engine_time_counts_the_prompt_pass_a_batch_opens_with() -> None:
    """Two one-token answers, each its own batch: all the engine did was two prompt passes, so
    engine_busy_s covers them and tokens_per_s is tokens over that time (the opening prefill was
    left out: busy ~0 s, tokens_per_s in the thousands)."""
    eng = SlowPrefillEngine(max_batch=1, max_tokens=1)
    s = Scheduler(eng, max_queue=8, batch_wait=0.0)
    s.start()
    ev: list = []
    for t in "ab":
        s.submit(job(t, ev, max_tokens=1))
        wait_done(ev, 1 if t == "a" else 2)
    m = s.metrics.snapshot(s.queued())
    s.stop()
    assert m["completion_tokens"] == 2 and m["batches"] == 2
    assert m["engine_busy_s"] >= 2 * SlowPrefillEngine.PREFILL_S
    assert m["tokens_per_s"] <= 2 / (2 * SlowPrefillEngine.PREFILL_S)


def test_a_non_streamed_request_whose_client_leaves_frees_its_row_at_the_next_step() -> None:
    """max_batch 2 with a and b decoding 30 tokens unstreamed (the loop then looks every 16
    steps) and c queued: a's client leaves, and c takes a's row within two steps, not at the
    next look 16 steps on; a's partial tokens count nowhere."""
    eng = FakeEngine(max_batch=2, max_tokens=30)
    eng.gate.clear()
    eng.ticks = threading.Semaphore(0)
    s = Scheduler(eng, max_queue=8, batch_wait=0.3)
    s.start()
    ev: dict[str, list] = {t: [] for t in "abc"}
    jobs = {t: job(t, ev[t], max_tokens=30) for t in "ab"}
    for j in jobs.values():
        s.submit(j)
    until(lambda: s.queued() == 0)
    eng.gate.set()
    until(lambda: eng.batches == [2])
    s.submit(job("c", ev["c"], max_tokens=3))
    Scheduler.cancel(jobs["a"])
    eng.ticks.release(2)
    until(lambda: len(eng.adds) == 2, timeout=3)
    joined = list(eng.adds)
    eng.ticks.release(200)
    for t in "abc":
        wait_done(ev[t], 1)
    s.stop()
    assert joined == [(1, [0, 1]), (1, [0])], joined
    m = s.metrics.snapshot(0)
    assert (m["completed"], m["cancelled"], m["completion_tokens"]) == (2, 1, 33)
