"""`draftsmith serve` under review, round twenty, through the real `openai` client: a burst past
the server's rows (chat and text, streamed or not, n 1 or 2) answered each once as when sent
alone, greedy, beside sampled requests too; a full queue's 429s, each request answered or
refused once (and the client's retries all answered); clients that leave mid-stream or while
queued free their rows; /v1/models and /health; a speculative server answering a greedy burst
as the plain one; and a signal's stop under load (`app._server`: the one a user's ctrl-C
reaches), graceful or forced, answering every request once. The review found no fault: these
hold what it checked."""

from __future__ import annotations

import signal
import socket
import threading
import time
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

from test_serve import drafter_dir, engine, live, served, tiny_dir  # noqa: E402

from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402

__all__ = ["drafter_dir", "engine", "tiny_dir"]  # fixtures
TWO = dict(max_batch=2, max_prompt_tokens=64, max_tokens=400)
TEXTS = ["hello", "What is 2+2?", "Tell me a story", "xyz", "abc def", "Why?", "ok", "12345"]
REFUSED = ("503 unavailable", "event unavailable")  # a stop's 503, or its event in a stream


@pytest.fixture(scope="module")
def two(tiny_dir: Path) -> ServeEngine:
    """A server of two rows: most of a burst waits in the queue."""
    return load_engine(str(tiny_dir), None, "cpu", torch.float32, EngineConfig(**TWO))


@pytest.fixture(scope="module")
def srv2(two: ServeEngine, tiny_dir: Path) -> Iterator[dict]:
    with live(two, str(tiny_dir)) as s:
        yield s


def metrics(s: dict) -> dict[str, Any]:
    return httpx.get(s["url"] + "/metrics", timeout=30).json()


def request(i: int) -> dict[str, Any]:
    """The i-th request of a mixed burst: chat or text, streamed or not, n 1 or 2."""
    return {"chat": i % 2 == 0, "stream": i % 3 == 0, "n": 1 + (i % 4 == 1),
            "text": TEXTS[i % len(TEXTS)] + "!" * (i // len(TEXTS)), "max_tokens": 6 + 3 * (i % 5)}


def answer(s: dict, r: dict[str, Any], **sampling: float) -> list[str]:
    """The request's choices' texts through the client: greedy unless `sampling` says."""
    c = s["client"]
    kw = dict(model=s["model"], max_tokens=r["max_tokens"], n=r["n"], stream=r["stream"],
              **(sampling or {"temperature": 0}))
    if r["chat"]:
        got = c.chat.completions.create(messages=[{"role": "user", "content": r["text"]}], **kw)
    else:
        got = c.completions.create(prompt=r["text"], **kw)
    out = [""] * r["n"]
    for part in got if r["stream"] else [got]:
        for ch in part.choices:
            if not r["chat"]:
                out[ch.index] += ch.text or ""
            else:
                out[ch.index] += (ch.delta.content if r["stream"] else ch.message.content) or ""
    return out


def outcome(s: dict, r: dict[str, Any]) -> list[str] | str:
    """The request's answer, or how the server refused it."""
    try:
        return answer(s, r)
    except openai.APIStatusError as e:
        return f"{e.status_code} {e.code}"
    except openai.APIError as e:  # an error event inside a stream
        return f"event {e.code}"


# ---- many clients, one queue -------------------------------------------------------------------


def test_a_burst_past_the_rows_is_each_answered_once_as_alone(srv2: dict) -> None:
    reqs = [request(i) for i in range(14)]
    alone = [answer(srv2, r) for r in reqs]
    before = metrics(srv2)
    with ThreadPoolExecutor(14) as pool:
        got = list(pool.map(lambda r: answer(srv2, r), reqs))
    after = metrics(srv2)
    assert got == alone
    for k in ("completed", "requests"):
        assert after[k] - before[k] == 14, k
    assert after["queued"] == 0 and after["failed"] == before["failed"]
    assert after["joined_rows"] > before["joined_rows"]  # rows that ended took queued requests


@pytest.mark.parametrize("drafted", [False, True])
def test_greedy_requests_beside_sampled_ones_answer_as_alone(
        srv2: dict, tiny_dir: Path, drafter_dir: Path, drafted: bool) -> None:
    """A batch widens to the sampled kind its requests need; its greedy rows take the argmax."""
    cfg = EngineConfig(**{**TWO, "max_batch": 4}, steps=3, topk=1)
    eng = load_engine(str(tiny_dir), drafter_dir if drafted else None, "cpu", torch.float32, cfg)
    greedy = [request(i) for i in range(8)]
    plain = [answer(srv2, r) for r in greedy]
    hot = [{**request(i), "stream": False, "n": 1} for i in range(8)]
    with live(eng, str(tiny_dir)) as s, ThreadPoolExecutor(16) as pool:
        sampled = [pool.submit(answer, s, r, temperature=1.0, top_p=0.9 if i % 2 else 1.0)
                   for i, r in enumerate(hot)]
        got = list(pool.map(lambda r: answer(s, r), greedy))
        assert all(len(f.result()) == 1 for f in sampled)
        assert metrics(s)["completed"] == 16
    assert got == plain


@pytest.mark.parametrize(("topk", "ndt"), [(1, None), (2, 6)])
def test_a_speculative_server_answers_a_greedy_burst_as_the_plain_one(
        srv2: dict, tiny_dir: Path, drafter_dir: Path, topk: int, ndt: int | None) -> None:
    cfg = EngineConfig(**{**TWO, "max_batch": 4}, steps=3, topk=topk, num_draft_tokens=ndt)
    spec = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    reqs = [request(i) for i in range(12)]
    plain = [answer(srv2, r) for r in reqs]
    with live(spec, str(tiny_dir)) as s, ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda r: answer(s, r), reqs))
        m = metrics(s)
    assert got == plain
    assert m["completed"] == 12 and m["joined_rows"] > 0 and m["mean_accept_length"] >= 1


def test_a_full_queue_refuses_with_429_and_the_clients_retries_are_each_answered_once(
        two: ServeEngine, tiny_dir: Path) -> None:
    from draftsmith.serve.app import create_app
    from draftsmith.serve.cli import server_config

    cfg = server_config(two, str(tiny_dir), None, None, 2)  # two queued requests at most
    reqs = [{**request(i), "max_tokens": 60} for i in range(10)]
    with served(create_app(two, cfg)) as url:
        s = {"url": url, "model": cfg.model_name,
             "client": openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)}
        alone = [answer(s, r) for r in reqs]
        before = metrics(s)
        with ThreadPoolExecutor(10) as pool:
            got = list(pool.map(lambda r: outcome(s, r), reqs))
        m = metrics(s)
        assert "429 queue_full" in got
        assert all(g == a or g == "429 queue_full" for g, a in zip(got, alone, strict=True))
        took = sum(g != "429 queue_full" for g in got)
        assert (m["completed"] - before["completed"], m["rejected"] - before["rejected"]) == (
            took, 10 - took)
        retrying = {**s, "client": s["client"].with_options(max_retries=8)}  # honours 429
        with ThreadPoolExecutor(10) as pool:
            assert list(pool.map(lambda r: answer(retrying, r), reqs)) == alone


def test_models_and_health(srv2: dict) -> None:
    c = srv2["client"]
    assert [m.id for m in c.models.list()] == [srv2["model"]]
    assert c.models.retrieve(srv2["model"]).id == srv2["model"]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
    h = httpx.get(srv2["url"] + "/health").json()
    assert h["status"] == "ok" and h["queued"] == 0


# ---- clients that leave --------------------------------------------------------------------------


def stream(s: dict, text: str, n: int = 1) -> Any:
    return s["client"].chat.completions.create(
        model=s["model"], temperature=0, max_tokens=400, stream=True, n=n,
        messages=[{"role": "user", "content": text}])


def until(check: Any, seconds: float = 20) -> None:
    deadline = time.time() + seconds
    while not check():
        assert time.time() < deadline, f"timed out: {check.__doc__ or ''}"
        time.sleep(0.02)


def test_clients_leaving_mid_stream_free_their_rows(srv2: dict) -> None:
    """Both rows hold 400-token streams; once their clients leave, a request runs at once."""
    before = metrics(srv2)
    streams = [stream(srv2, "hello") for _ in range(2)]  # 400 tokens, no eos before
    for s in streams:
        it = iter(s)
        next(it), next(it)
        s.close()
    until(lambda: metrics(srv2)["cancelled"] - before["cancelled"] == 2)
    r = request(3)
    assert answer(srv2, r) == answer(srv2, r)
    after = metrics(srv2)
    assert after["completed"] - before["completed"] == 2
    assert after["completion_tokens"] - before["completion_tokens"] < 100  # not 800 run out


def test_a_queued_stream_whose_client_leaves_is_never_run(srv2: dict) -> None:
    before = metrics(srv2)
    running = stream(srv2, "hello", 2)  # both rows
    next(iter(running))
    queued = stream(srv2, "xyz")
    health = srv2["url"] + "/health"
    until(lambda: httpx.get(health).json()["queued"] == 1)
    queued.close()
    until(lambda: httpx.get(health).json()["queued"] == 0)
    running.close()
    r = request(2)
    assert answer(srv2, r) == answer(srv2, r)
    after = metrics(srv2)
    assert after["cancelled"] - before["cancelled"] == 2
    assert after["completed"] - before["completed"] == 2
    rows = sum(after[k] - before[k] for k in ("batch_rows", "joined_rows"))
    assert rows == 4  # the running two, r twice: the one that left took none


# ---- stopping under load -------------------------------------------------------------------------


@contextmanager
def signalled(eng: ServeEngine, target: str) -> Iterator[tuple[dict, Any, threading.Thread]]:
    """`eng` under the server a user's ctrl-C stops (`app._server`), on a free port."""
    from draftsmith.serve.app import _server, create_app
    from draftsmith.serve.cli import server_config

    cfg = server_config(eng, target, None, None, 64)
    app = create_app(eng, cfg)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = _server(app, host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        yield {"url": url, "model": cfg.model_name, "client": client, "app": app}, server, thread
    finally:
        server.should_exit = server.force_exit = True
        thread.join(30)


@pytest.mark.parametrize("forced", [False, True])
def test_a_stop_under_load_answers_each_request_once(two: ServeEngine, tiny_dir: Path,
                                                     srv2: dict, forced: bool) -> None:
    """Queued requests get a 503 (a stream's started 200: an error event), running ones their
    whole answer, or with a second ctrl-C a 503 too; the server ends within seconds."""
    with signalled(two, str(tiny_dir)) as (s, server, thread):
        reqs = [{**request(i), "max_tokens": 400 if forced else 120} for i in range(10)]
        before = metrics(s)
        with ThreadPoolExecutor(10) as pool:
            futs = [pool.submit(outcome, s, r) for r in reqs]
            until(lambda: metrics(s)["requests"] - before["requests"] == 10)  # all queued
            server.handle_exit(signal.SIGINT, None)
            if forced:
                time.sleep(0.2)
                server.handle_exit(signal.SIGINT, None)
            got = [f.result() for f in futs]
        thread.join(30)
        assert not thread.is_alive()
        m = s["app"].state.scheduler.metrics.snapshot(0)
    whole = [(g, r) for g, r in zip(got, reqs, strict=True) if not isinstance(g, str)]
    assert [g for g, _ in whole] == [answer(srv2, r) for _, r in whole]  # as alone
    assert all(g in REFUSED for g in got if isinstance(g, str)) and len(whole) < 10
    done = {k: m[k] - before[k] for k in ("completed", "stopped", "cancelled", "failed")}
    assert done == {"completed": len(whole), "stopped": 10 - len(whole), "cancelled": 0,
                    "failed": 0}
