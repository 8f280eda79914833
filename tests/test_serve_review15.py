"""`draftsmith serve` after top_n_sigma landed: through the real `openai` client (and raw JSON, as
SGLang's clients post it), a top_n_sigma request streams what it answers whole, repeats under a
seed, batches with greedy and temperature-only requests (each row by its own setting) and joins a
running continuous batch only where that batch holds its kind."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import engine, live, reference, tiny_dir  # noqa: E402

from draftsmith.engine.sampling import SamplingParams  # noqa: E402
from draftsmith.serve.engine import ServeEngine  # noqa: E402
from draftsmith.serve.jobs import Job  # noqa: E402
from draftsmith.serve.protocol import ServeConfig, parse_completion  # noqa: E402
from draftsmith.serve.scheduler import Scheduler  # noqa: E402

__all__ = ["engine", "tiny_dir"]  # fixtures
MSG = [{"role": "user", "content": "hello"}]
SHARP = 1e-6  # a top_n_sigma that keeps the largest logit alone: the row decodes as greedy


@pytest.fixture(scope="module")
def srv(engine: ServeEngine, tiny_dir: Path) -> Iterator[dict]:
    with live(engine, str(tiny_dir)) as s:
        yield s


@contextmanager
def _live(engine: ServeEngine, tiny_dir: Path, sched: Scheduler) -> Iterator[dict]:
    """`test_serve.live` over a scheduler of the test's own (a longer batch wait)."""
    from draftsmith.serve import app

    real = app.create_app
    app_of = lambda e, cfg, _=None: real(e, cfg, sched)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(app, "create_app", app_of)
        with live(engine, str(tiny_dir)) as s:
            yield s


def _chat(srv: dict, stream: bool = False, **kw: Any) -> str:
    r = srv["client"].chat.completions.create(model=srv["model"], messages=MSG, stream=stream,
                                              **{"max_tokens": 16, **kw})
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    return r.choices[0].message.content


def _text(srv: dict, prompt: str, stream: bool = False, **kw: Any) -> str:
    r = srv["client"].completions.create(model=srv["model"], prompt=prompt, stream=stream,
                                         **{"max_tokens": 16, **kw})
    if stream:
        return "".join(c.choices[0].text for c in r if c.choices)
    return r.choices[0].text


def _metrics(srv: dict) -> dict:
    return httpx.get(srv["url"] + "/metrics").json()


@pytest.mark.parametrize("chat", [True, False])
def test_a_seeded_top_n_sigma_streams_what_it_answers_whole(srv: dict, chat: bool) -> None:
    kw = {"temperature": 1.5, "seed": 11, "extra_body": {"top_n_sigma": 2.0}}
    ask = (lambda s: _chat(srv, s, **kw)) if chat else (lambda s: _text(srv, "hello", s, **kw))
    whole = ask(False)
    assert ask(True) == whole
    assert ask(False) == whole  # and it repeats


def test_top_n_sigma_in_the_body_as_sglang_posts_it(srv: dict) -> None:
    """SGLang's clients post it as a plain field, vLLM's through the openai client's extra_body:
    one answer either way."""
    body = {"model": srv["model"], "prompt": "hello", "max_tokens": 12, "temperature": 1.2,
            "seed": 5, "top_n_sigma": 1.5}
    r = httpx.post(srv["url"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    via_extra = _text(srv, "hello", max_tokens=12, temperature=1.2, seed=5,
                      extra_body={"top_n_sigma": 1.5})
    assert r.json()["choices"][0]["text"] == via_extra


def test_models_and_metrics_still_count_top_n_sigma_requests(srv: dict) -> None:
    before = _metrics(srv)
    r = srv["client"].completions.create(model=srv["model"], prompt="hello", max_tokens=6,
                                         temperature=1.0, extra_body={"top_n_sigma": 1.0})
    after = _metrics(srv)
    assert after["requests"] - before["requests"] == 1
    assert after["completed"] - before["completed"] == 1
    assert after["completion_tokens"] - before["completion_tokens"] == r.usage.completion_tokens
    assert after["prompt_tokens"] - before["prompt_tokens"] == r.usage.prompt_tokens
    assert after["rejected"] == before["rejected"]
    assert [m.id for m in srv["client"].models.list()] == [srv["model"]]


def test_a_batch_of_greedy_temperature_and_top_n_sigma_rows(engine: ServeEngine,
                                                            tiny_dir: Path) -> None:
    """Three requests opened as one batch (of the widest kind, filtered): the greedy row is
    plain greedy output, the top_n_sigma row at T 2 with a sharp n is greedy too (its own floor),
    and the temperature-only row is not filtered by its neighbour's settings."""
    with _live(engine, tiny_dir, Scheduler(engine, batch_wait=0.5)) as s:
        prompts = ["hello", "Why?", "abc def"]
        kws = [{"temperature": 0}, {"temperature": 2.0, "extra_body": {"top_n_sigma": SHARP}},
               {"temperature": 2.0}]
        with ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(_text, s, p, max_tokens=12, **kw)
                    for p, kw in zip(prompts, kws, strict=True)]
            got = [f.result() for f in futs]
        m = _metrics(s)
        assert m["batches"] == 1 and m["batch_rows"] == 3, m
    greedy = [reference(engine, engine.text_ids(p), 12) for p in prompts]
    assert got[0] == greedy[0]
    assert got[1] == greedy[1]
    assert got[2] != greedy[2]  # drawn at T 2 over the whole vocabulary


# ---- continuous batching: a top_n_sigma job arriving while a batch decodes -------------------

CFG = ServeConfig("tiny", (), max_tokens=40, max_prompt_tokens=96, max_batch=8)


def _job(engine: ServeEngine, events: list, sink: Any = None, **body: Any) -> Job:
    req = parse_completion({"prompt": "hello", **body}, CFG, engine.text_side)
    return Job(req, sink or events.append)


def _wait(events: list, timeout: float = 30.0) -> None:
    done = threading.Event()
    deadline = threading.Timer(timeout, done.set)
    deadline.start()
    try:
        while not done.is_set() and not any(e[0] in ("done", "error") for e in events):
            done.wait(0.01)
    finally:
        deadline.cancel()
    assert events and events[-1][0] == "done", events


@pytest.mark.parametrize(("running", "joins"), [
    ({"temperature": 1.0}, False),  # a wider kind: waits for the batch to drain
    ({"temperature": 1.0, "top_p": 0.95}, True),  # the batch's own kind: joins it
])
def test_a_top_n_sigma_job_arriving_while_a_batch_decodes(engine: ServeEngine, running: dict,
                                                          joins: bool) -> None:
    sched = Scheduler(engine, batch_wait=0.0)
    first: list = []
    late: list = []
    joiner = _job(engine, late, max_tokens=10, temperature=2.0, top_n_sigma=SHARP)

    sent = threading.Event()

    def sink(ev: tuple) -> None:  # the running batch's first delta sends the late job
        first.append(ev)
        if ev[0] == "delta" and not sent.is_set():
            sent.set()
            sched.submit(joiner)

    running_job = _job(engine, first, sink, max_tokens=40, n=3, stream=True, **running)
    sched.start()
    try:
        torch.manual_seed(0)
        sched.submit(running_job)
        _wait(first)
        _wait(late)
    finally:
        sched.stop()
    m = sched.metrics.snapshot(0)
    assert m["joined_rows"] == (1 if joins else 0), m
    assert m["batches"] == (1 if joins else 2), m
    text = next(e[2].text for e in late if e[0] == "finish")
    assert text == reference(engine, engine.text_ids("hello"), 10)
    assert SamplingParams(2.0, top_n_sigma=SHARP).kind == "filtered"


# ---- error responses -----------------------------------------------------------------------


def test_a_405_names_the_methods_the_route_takes(srv: dict) -> None:
    """RFC 9110: a 405 carries Allow (Starlette sets it; the JSON error handler dropped it)."""
    r = httpx.get(srv["url"] + "/v1/chat/completions")
    assert r.status_code == 405
    assert r.headers.get("allow") == "POST"
    assert r.json()["error"]["message"] == "Method Not Allowed"
    assert httpx.post(srv["url"] + "/health").headers.get("allow") == "GET"
