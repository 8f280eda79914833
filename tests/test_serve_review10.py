"""`draftsmith serve` under review, round ten: a forced quit that lands after a job completed
counts it once, and a frontend's own "engine process is gone" 503s are counted."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve_frontends import Sched, cut, linked, remote_job, wait_for  # noqa: E402
from test_serve_units import FakeEngine  # noqa: E402

from draftsmith.serve.app import _server, create_app  # noqa: E402
from draftsmith.serve.frontends import GONE  # noqa: E402
from draftsmith.serve.protocol import ApiError, ServeConfig  # noqa: E402
from draftsmith.serve.scheduler import Scheduler  # noqa: E402


def _forced_at_reply(stream: bool, key: str | None = None) -> tuple[dict[str, Any], list[dict]]:
    """A completion served through `_server`'s wrapper whose reply is cut off by a forced quit
    once the job has completed: the cancel lands while the answer goes out."""
    eng = FakeEngine(max_batch=1, max_tokens=3)
    eng.max_len, eng.vocab_size = 64, 50
    app = create_app(eng, ServeConfig("m", max_batch=1, api_key=key))
    sched: Scheduler = app.state.scheduler
    server = _server(app)
    quiet = server.config.app
    body = json.dumps({"prompt": [1], "max_tokens": 3, "stream": stream}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "server": ("t", 80), "client": ("c", 1),
             "headers": [(b"content-type", b"application/json"),
                         (b"authorization", f"Bearer {key}".encode()),
                         (b"content-length", str(len(body)).encode())]}
    sent: list[dict] = []

    async def go() -> None:
        given = asyncio.Event()

        async def receive() -> dict:
            if not given.is_set():
                given.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            last = message.get("body", b"").endswith(b"[DONE]\n\n")
            at = (message["type"] == "http.response.start" and not stream) or last
            if at and not server.force_exit:  # as uvicorn's forced quit: the request's task ends
                server.force_exit = True
                task.cancel()
                await asyncio.sleep(5)

        task = asyncio.ensure_future(quiet(scope, receive, send))
        await task

    sched.start()
    try:
        asyncio.run(go())
    finally:
        sched.stop(1)
    return sched.metrics.snapshot(0), sent


@pytest.mark.parametrize("key", [None, "k"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_quit_after_a_job_completed_counts_it_once(stream: bool, key: str | None) -> None:
    """The job completed (counted), then a forced quit cut its reply off: /metrics counted it
    `stopped` too (2 ends of 1 request). With an API key too (its middleware)."""
    m, sent = _forced_at_reply(stream, key)
    assert m["requests"] == 1
    assert (m["completed"], m["stopped"], m["cancelled"]) == (1, 0, 0), m
    assert any(s["type"] == "http.response.start" for s in sent)


def test_a_frontends_own_engine_gone_503s_are_counted() -> None:
    """The jobs a lost engine link fails and the submits refused after it: a 503 each, which
    /metrics counted nowhere."""
    sched = Sched()
    link, remote, _ = linked(sched)
    events: list = []
    remote.submit(job := remote_job(events))
    wait_for(lambda: sched.jobs)
    assert "engine_gone" not in remote.status()["metrics"]  # none yet: the engine's counters
    cut(link._outs[0].conn)
    assert job.got.wait(10)
    assert events == [("error", 503, GONE, None, "unavailable")]
    with pytest.raises(ApiError):
        remote.submit(remote_job([]))
    assert remote.status()["metrics"]["engine_gone"] == 2


def test_a_one_process_server_shows_engine_gone_at_zero() -> None:
    """The key is in every /metrics, so a dashboard reads it the same with `--frontends`."""
    eng = FakeEngine(max_batch=1, max_tokens=3)
    assert Scheduler(eng).status()["metrics"]["engine_gone"] == 0


def test_engine_gone_adds_to_a_live_engines_metrics() -> None:
    """A submit refused on a failed send while the reader has yet to see the loss: counted on
    top of the engine's own metrics."""
    sched = Sched()
    _, remote, _ = linked(sched)
    sched.status = lambda: {"alive": True, "queued": 0, "metrics": {"engine_gone": 0}}
    sending = remote._try_send
    remote._try_send = lambda msg: msg[0] != "submit" and sending(msg)
    with pytest.raises(ApiError):
        remote.submit(remote_job([]))
    assert remote.status()["metrics"]["engine_gone"] == 1


MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("field", "value"), [
    ("truncate_prompt_tokens", 4), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
    ("logits_processors", ["p"]), ("structured_outputs", {"regex": "a+"}),
    ("documents", [{"title": "t", "text": "x"}]), ("add_special_tokens", True),
    ("regex", "a+"), ("ebnf", "root ::= 'a'"), ("no_stop_trim", True)])
def test_vllm_and_sglang_fields_that_change_the_answer_are_400s(field: str, value: Any) -> None:
    """vLLM's and SGLang's fields that change the prompt or the tokens allowed were ignored: the
    answer came back as if they were absent."""
    from test_serve_units import CFG, FakePrompter

    from draftsmith.serve.protocol import parse_chat

    with pytest.raises(ApiError) as e:
        parse_chat({"messages": MSGS, field: value}, CFG, FakePrompter())
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported")


def test_their_defaults_pass_and_add_special_tokens_follows_the_endpoint() -> None:
    """vLLM's defaults: a chat's special tokens are the template's (False), a text gets its BOS
    (True)."""
    from test_serve_units import CFG, FakePrompter

    from draftsmith.serve.protocol import parse_chat, parse_completion

    quiet = {"truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": [],
             "structured_outputs": None, "documents": None, "no_stop_trim": False}
    parse_chat({"messages": MSGS, "add_special_tokens": False, **quiet}, CFG, FakePrompter())
    parse_completion({"prompt": "a", "add_special_tokens": True, **quiet}, CFG, FakePrompter())
    with pytest.raises(ApiError, match="add_special_tokens"):
        parse_completion({"prompt": "a", "add_special_tokens": False}, CFG, FakePrompter())
