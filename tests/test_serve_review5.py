"""`draftsmith serve` as a demanding client meets it: usage counts the eos that ended an answer,
a stop string frees its row at the step that completes it, a queued stream answers 200 at once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import write_tiny_folder  # noqa: E402
from test_serve import live  # noqa: E402
from test_serve_review4 import Text  # noqa: E402
from test_serve_units import FakeEngine, job  # noqa: E402

from draftsmith.engine.generate import generate  # noqa: E402
from draftsmith.engine.runtime import Runtime  # noqa: E402
from draftsmith.serve import engine as serve_engine  # noqa: E402
from draftsmith.serve.cli import server_config  # noqa: E402
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402
from draftsmith.serve.jobs import Job  # noqa: E402
from draftsmith.serve.protocol import ServeConfig, parse_completion  # noqa: E402
from draftsmith.serve.scheduler import Row, Scheduler  # noqa: E402

LIMITS = dict(max_batch=8, max_prompt_tokens=96, max_tokens=40)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> ServeEngine:
    folder = write_tiny_folder(tmp_path_factory.mktemp("serve5"), "llama", seed=2)
    return load_engine(str(folder), None, "cpu", torch.float32, EngineConfig(**LIMITS))


@pytest.fixture(scope="module")
def srv(engine: ServeEngine) -> Iterator[dict]:
    with live(engine, "tiny") as s:
        yield s


def generated(engine: ServeEngine, ids: list[int], n: int) -> int:
    """The tokens the target generates for `ids` up to and with its first eos (greedy)."""
    eager = Runtime(engine.rt.model, 1, len(ids) + n + 1, graphs=False)
    toks = generate(eager, [ids], n, eos_ids=[])[0]
    ends = [i for i, t in enumerate(toks) if t in engine.eos]
    assert ends, "the helper needs a prompt whose greedy answer ends on eos"
    return ends[0] + 1


# ---- usage ---------------------------------------------------------------------------------------


def test_a_rows_usage_counts_the_eos_that_ended_it_and_nothing_past_a_stop() -> None:
    """vLLM and SGLang count the eos they generated in completion_tokens (vLLM:
    len(output.token_ids)); draftsmith left it out, so an answer that ended on eos at once
    reported 0 tokens."""
    for raw, stop, want, reason in (([1, 2, 0, 5], [], 3, "stop"),  # "ab" + eos
                                    ([0], [], 1, "stop"),  # eos at once
                                    ([1, 2, 3, 0], ["b"], 2, "stop"),  # the stop string first
                                    ([1, 2, 3, 4, 5], [], 4, "length")):
        events: list = []
        j = job("a", events, max_tokens=4)
        j.req.stop = stop
        j.rows = [row := Row(j, 0, [1], [0], FakeEngine().decode)]
        row.feed(raw, True)
        (finish,) = [e[2] for e in events if e[0] == "finish"]
        assert (finish.tokens, finish.finish_reason) == (want, reason), raw


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_usage_counts_the_eos_streamed_or_not(srv: dict, engine: ServeEngine, kind: str,
                                              stream: bool) -> None:
    client, model = srv["client"], srv["model"]
    if kind == "chat":
        msgs = [{"role": "user", "content": "hi"}]
        want = generated(engine, engine.target.chat_ids(msgs), 40)
        call = client.chat.completions.create
        kw = {"messages": msgs}
    else:
        want = generated(engine, engine.text_ids("hello"), 40)
        call, kw = client.completions.create, {"prompt": "hello"}
    kw.update(model=model, max_tokens=40, temperature=0)
    if stream:
        chunks = list(call(stream=True, stream_options={"include_usage": True}, **kw))
        usage = chunks[-1].usage
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "stop"
    else:
        r = call(**kw)
        usage = r.usage
        assert r.choices[0].finish_reason == "stop"
    assert usage.completion_tokens == want
    assert usage.total_tokens == usage.prompt_tokens + want


# ---- stop strings ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_frees_its_row_at_the_step_that_completes_it(engine: ServeEngine,
                                                                   monkeypatch, stream) -> None:
    """A non-streamed row was looked at every 16 steps: one whose stop string came at its 8th
    token decoded 16 steps (8 past it) before its answer went out and its slot freed."""
    cfg = server_config(engine, "tiny", None, None, 8)
    steps: list[int] = []
    step = serve_engine._BaselineRows.step
    monkeypatch.setattr(serve_engine._BaselineRows, "step",
                        lambda self, n: (steps.append(n), step(self, n))[1])
    s = Scheduler(engine, 8)
    s.start()
    try:
        def ask(**kw) -> list:
            events: list = []
            body = {"prompt": "What is 2+2?", "max_tokens": 40, "temperature": 0, **kw}
            s.submit(Job(parse_completion(body, cfg, engine), events.append))
            deadline = time.time() + 30
            while not events or events[-1][0] not in ("done", "error"):
                assert time.time() < deadline
                time.sleep(0.01)
            return events

        full = next(e[2] for e in ask() if e[0] == "finish").text
        assert "_" in full[4:12] and "_" not in full[:4], full  # the helper's premise
        steps.clear()
        (finish,) = [e[2] for e in ask(stop="_", stream=stream) if e[0] == "finish"]
    finally:
        s.stop()
    assert finish.finish_reason == "stop"
    if not stream:
        assert finish.text == full[: full.index("_")]
    assert sum(steps) == finish.tokens - 1  # the first token came from the prompt pass


# ---- a stream answers 200 while queued ---------------------------------------------------------


@pytest.fixture
def gated() -> Iterator[tuple[str, FakeEngine, Scheduler]]:
    """A real server and scheduler over an engine whose first batch waits at a gate."""
    import uvicorn

    from draftsmith.serve.app import create_app

    eng = FakeEngine(max_batch=4, max_tokens=3)
    eng.gate.clear()
    cfg = ServeConfig("tiny", max_tokens=3, max_prompt_tokens=20, max_batch=4, max_queue=1)
    sched = Scheduler(eng, 1, batch_wait=0)
    app = create_app(Text(), cfg, sched)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", eng, sched
    finally:
        eng.gate.set()
        server.should_exit = True
        thread.join(10)


def test_a_queued_stream_gets_its_200_at_once_and_its_role_with_its_first_token(gated) -> None:
    """The stream's headers waited for its first token: a client behind a long queue saw no 200
    (and its read timeout ran) until then. vLLM returns the stream at once; a refusal (400, 429)
    keeps its status. The role chunk comes with the first output, as vLLM and SGLang send it:
    sent while queued, vLLM's benchmark_serving read it as the first token."""
    url, eng, sched = gated
    body = {"messages": [{"role": "user", "content": "a"}], "stream": True, "max_tokens": 3}
    got: dict = {}

    def read() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as r:
            got["status"] = r.status_code
            lines = r.iter_lines()
            got["first"] = next(line for line in lines if line)
            got["rest"] = [line for line in lines if line]

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.time() + 10
    while "status" not in got and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # a role chunk sent while queued would be read by now
    assert got.get("status") == 200 and "first" not in got
    assert eng.batches == []  # no batch has opened yet: the job waits at the gate
    while sched.queued():  # the worker took it (and waits at the gate)
        assert time.time() < deadline
        time.sleep(0.02)
    bad = httpx.post(url + "/v1/chat/completions", json={**body, "temperature": 9}, timeout=5)
    assert bad.status_code == 400
    waiting = threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                               kwargs={"json": {"prompt": "b", "max_tokens": 1}, "timeout": 20})
    waiting.start()  # fills the queue of one behind the gated batch
    deadline = time.time() + 10
    while not sched.queued():
        assert time.time() < deadline
        time.sleep(0.02)
    full = httpx.post(url + "/v1/chat/completions", json=body, timeout=5)
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    eng.gate.set()
    reader.join(20)
    waiting.join(20)
    assert '"role": "assistant"' in got["first"] and '"content": "' in got["rest"][0]
    assert got["rest"][-1] == "data: [DONE]"


def test_an_accepted_job_says_so_through_a_frontends_link() -> None:
    """A frontend process learns that the engine queued its job (its stream's 200 goes out) or
    refused it (a 429 keeps its status), in that order before any token."""
    from test_serve_frontends import linked, remote_job, wait_for

    eng = FakeEngine(max_batch=4)
    eng.gate.clear()
    sched = Scheduler(eng, 1, batch_wait=0)
    sched.start()
    try:
        _, remote, _ = linked(sched)
        events: dict[str, list] = {k: [] for k in ("first", "second", "third")}
        for k in events:
            remote.submit(remote_job(events[k]))
            wait_for(lambda k=k: events[k])
            if k == "first":  # the worker took it (and waits at the gate): the queue is empty
                wait_for(lambda: not sched.queued())
        assert events["first"] == [("accepted",)] and events["second"] == [("accepted",)]
        assert events["third"][0][:2] == ("error", 429)
    finally:
        eng.gate.set()
        sched.stop()

