"""`serve --frontends N`: HTTP in processes of its own, the engine's scheduler in this one.

The pipe's two ends first, in one process (a stand-in scheduler, no HTTP); then real frontend
processes on one socket with the real `openai` client, whose answers must be the one-process
server's; then `draftsmith serve --frontends 2` as a user starts and stops it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import LIMITS, PROMPTS, chat_ids, reference  # noqa: E402

from draftsmith.serve import protocol as P  # noqa: E402
from draftsmith.serve.cli import server_config  # noqa: E402
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402
from draftsmith.serve.frontends import GONE, EngineLink, Frontends, RemoteScheduler  # noqa: E402
from draftsmith.serve.scheduler import Job  # noqa: E402
from draftsmith.serve.text import TextSide  # noqa: E402


class Sched:
    """A stand-in scheduler: keeps what is submitted, or refuses it as a full queue does."""

    def __init__(self, refuse: bool = False) -> None:
        self.jobs: list[Job] = []
        self.refuse, self.broken = refuse, False
        self.counted: dict[str, int] = {}

    def submit(self, job: Job) -> None:
        if self.broken:
            self.broken = False
            raise RuntimeError("a bug in the scheduler")
        if self.refuse:
            raise P.ApiError(429, "the queue is full (1 requests); retry later",
                             code="queue_full", kind="rate_limit_error")
        self.jobs.append(job)

    def count(self, **kv: int) -> None:
        for k, v in kv.items():
            self.counted[k] = self.counted.get(k, 0) + v

    def status(self) -> dict:
        return {"alive": True, "queued": len(self.jobs), "metrics": {"requests": len(self.jobs)}}


def linked(sched: Sched) -> tuple[EngineLink, RemoteScheduler, list[bool]]:
    """Both ends over a real pipe, in this process."""
    mine, theirs = multiprocessing.Pipe()
    link, lost = EngineLink(sched), []
    link.attach(0, mine)
    remote = RemoteScheduler(theirs, on_lost=lambda: lost.append(True))
    remote.start()
    assert link.wait_ready({0}, 10)
    return link, remote, lost


def remote_job(events: list) -> Job:
    got = threading.Event()

    def sink(ev: tuple) -> None:
        events.append(ev)
        got.set()

    job = Job(P.GenRequest("chat", "m", [[1, 2, 3]], 8), sink)
    job.got = got
    return job


def cut(conn) -> None:
    """One end of a pipe goes away as when its process dies (a plain close would wait for this
    process's own thread blocked reading it)."""
    import socket

    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        s.shutdown(socket.SHUT_RDWR)


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_events_cross_in_order_and_the_job_is_forgotten_when_done() -> None:
    sched = Sched()
    link, remote, _ = linked(sched)
    events: list = []
    job = remote_job(events)
    remote.submit(job)
    wait_for(lambda: sched.jobs)
    there = sched.jobs[0]
    assert there.req.prompts == [[1, 2, 3]] and there.req.id == job.req.id
    sent = [("delta", 0, "a"), ("delta", 0, "b"), ("finish", 0, P.Choice("ab", "stop", 2)),
            ("done", 2), ("delta", 0, "late")]
    for ev in sent:
        there.emit(ev)
    wait_for(lambda: len(events) >= 4)
    time.sleep(0.1)
    assert events == sent[:4]  # in order; nothing after "done"
    assert not link._jobs and not remote._jobs and not remote._jid


def test_a_refused_submit_keeps_its_status_code_and_type() -> None:
    _, remote, _ = linked(Sched(refuse=True))
    events: list = []
    remote.submit(job := remote_job(events))
    assert job.got.wait(10)
    body = P.ApiError(*events[0][1:]).body()["error"]
    assert events[0][:2] == ("error", 429)
    assert body["code"] == "queue_full" and body["type"] == "rate_limit_error"


def test_cancel_counts_and_status_reach_the_engine() -> None:
    sched = Sched()
    link, remote, _ = linked(sched)
    remote.submit(job := remote_job([]))
    wait_for(lambda: sched.jobs)
    assert not sched.jobs[0].cancelled
    remote.cancel(job)
    wait_for(lambda: sched.jobs[0].cancelled)
    assert not link._jobs  # a queued job the scheduler drops sends nothing: not kept here
    remote.count(rejected=2)
    wait_for(lambda: sched.counted == {"rejected": 2})
    assert remote.status() == {"alive": True, "queued": 1,
                               "metrics": {"requests": 1, "frontend_requests": [1]}}


def test_a_lost_engine_fails_the_waiting_jobs_and_says_so() -> None:
    sched = Sched()
    link, remote, lost = linked(sched)
    events: list = []
    remote.submit(job := remote_job(events))
    wait_for(lambda: sched.jobs)
    cut(link._outs[0].conn)  # the engine process's end of the pipe
    assert job.got.wait(10)
    assert events == [("error", 503, GONE, None, "unavailable")] and lost == [True]
    assert remote.status()["alive"] is False
    with pytest.raises(P.ApiError) as e:
        remote.submit(remote_job([]))
    assert e.value.status == 503


def test_a_lost_frontend_cancels_its_jobs_at_the_engine() -> None:
    sched = Sched()
    link, remote, _ = linked(sched)
    for _ in range(3):
        remote.submit(remote_job([]))
    wait_for(lambda: len(sched.jobs) == 3)
    cut(remote.conn)
    wait_for(lambda: 0 in link.gone)
    assert all(j.cancelled for j in sched.jobs) and not link._jobs


def test_an_engine_side_bug_fails_that_request_and_the_link_serves_on() -> None:
    sched = Sched()
    link, remote, lost = linked(sched)
    sched.broken = True
    events: list = []
    remote.submit(job := remote_job(events))
    assert job.got.wait(10)
    assert events[0][:2] == ("error", 500) and "a bug in the scheduler" in events[0][2]
    assert not link._jobs and not remote._jobs
    remote.submit(remote_job([]))
    wait_for(lambda: sched.jobs)
    assert not lost and remote.status()["alive"]


def test_the_text_side_tokenizes_as_the_target_after_a_pickle(engine: ServeEngine) -> None:
    import pickle

    texts = pickle.loads(pickle.dumps(engine.text_side))
    assert isinstance(texts, TextSide) and texts.lock is not engine.text_side.lock
    assert (texts.vocab_size, texts.max_len) == (engine.vocab_size, engine.max_len)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert texts.chat_ids(msgs) == engine.target.chat_ids(msgs) == engine.chat_ids(msgs)
    want = engine.target.tokenizer("abc def")["input_ids"]
    assert texts.text_ids("abc def") == want == engine.text_ids("abc def")


# ---- real frontend processes -------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> ServeEngine:
    return load_engine(str(tiny_dir), None, "cpu", torch.float32, EngineConfig(**LIMITS))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from conftest import write_tiny_folder

    return write_tiny_folder(tmp_path_factory.mktemp("frontends_target"), "llama", seed=2)


@pytest.fixture(scope="module")
def fe(engine: ServeEngine, tiny_dir: Path) -> Iterator[Frontends]:
    cfg = server_config(engine, str(tiny_dir), None, None, 64)
    with Frontends(engine, cfg, 2) as f:
        yield f


def client(fe: Frontends) -> openai.OpenAI:
    return openai.OpenAI(base_url=fe.url + "/v1", api_key="x", max_retries=0, timeout=60)


def ask(fe: Frontends, text: str, n: int = 24, **kw):
    return client(fe).chat.completions.create(
        model=fe.cfg.model_name, messages=[{"role": "user", "content": text}], max_tokens=n,
        temperature=0, **kw)


def test_frontends_answer_as_generate_does_many_at_once(fe: Frontends,
                                                        engine: ServeEngine) -> None:
    def one(job: tuple[str, bool]) -> str:
        text, stream = job
        if stream:
            return "".join(c.choices[0].delta.content or ""
                           for c in ask(fe, text, stream=True) if c.choices)
        return ask(fe, text).choices[0].message.content

    jobs = [(t, k % 2 == 1) for k in range(2) for t in PROMPTS]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, jobs))
    want = {t: reference(engine, chat_ids(engine, t), 24) for t in PROMPTS}
    assert got == [want[t] for t, _ in jobs]
    m = httpx.get(fe.url + "/metrics").json()
    assert m["completed"] >= 16 and m["frontends"] == 2 and m["completion_tokens"] > 0


def test_every_frontend_takes_requests_and_metrics_count_them(fe: Frontends) -> None:
    def took() -> list[int]:
        return httpx.get(fe.url + "/metrics").json()["frontend_requests"]

    before = took()
    for _ in range(8):  # the kernel picks the process that accepts: rounds until both have
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda t: ask(fe, t, 4), PROMPTS[:8]))
        now = took()
        if all(n > b for n, b in zip(now, before, strict=True)):
            break
    assert len(now) == 2 and all(n > b for n, b in zip(now, before, strict=True)), (before, now)
    assert sum(now) - sum(before) == 8 * (_ + 1)


def test_completions_errors_and_metrics_through_a_frontend(fe: Frontends,
                                                           engine: ServeEngine) -> None:
    ids = chat_ids(engine, "hello")
    r = client(fe).completions.create(model=fe.cfg.model_name, prompt=ids, max_tokens=24,
                                      temperature=0)
    assert r.choices[0].text == reference(engine, ids, 24)
    before = httpx.get(fe.url + "/metrics").json()["rejected"]
    bad = httpx.post(fe.url + "/v1/chat/completions", json={"model": fe.cfg.model_name})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "messages"
    wait_for(lambda: httpx.get(fe.url + "/metrics").json()["rejected"] == before + 1)
    assert httpx.get(fe.url + "/health").json()["status"] == "ok"


def test_the_others_serve_on_when_a_frontend_dies(engine: ServeEngine, tiny_dir: Path) -> None:
    cfg = server_config(engine, str(tiny_dir), None, None, 64)
    with Frontends(engine, cfg, 2) as f:
        victim = f.procs[0]
        victim.kill()
        victim.wait(10)
        wait_for(lambda: 0 in f.link.gone)
        want = reference(engine, chat_ids(engine, "Why?"), 24)
        for _ in range(4):  # fresh connections: each lands on the one left
            assert ask(f, "Why?").choices[0].message.content == want
    assert victim.returncode == -signal.SIGKILL and not f.procs and not f.sched.alive


def serve_cli(tiny_dir: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftsmith", "serve", "--target", str(tiny_dir), "--device",
         "cpu", "--max-batch", "2", "--max-tokens-limit", "16", "--max-prompt-tokens", "64",
         "--port", str(port), "--frontends", "2", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def session_left(proc: subprocess.Popen) -> str:
    """The processes left in the server's session (its frontends, if any outlived it)."""
    return subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True,
                          text=True).stdout.strip()


def test_serve_cli_stops_cleanly_on_sigterm_while_its_frontends_start(tiny_dir: Path) -> None:
    proc, _ = serve_cli(tiny_dir)
    try:
        time.sleep(1.5)  # the engine is loaded or loading; frontends not all up
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode in (0, -signal.SIGTERM), out  # -15: before its handlers were set
    assert "Traceback" not in out and "terminate called" not in out, out
    wait_for(lambda: not session_left(proc), 20)


@pytest.mark.slow  # > 5 s: the default suite stays under 10 minutes on 2 cores
def test_serve_cli_with_frontends_starts_answers_and_stops_on_sigterm(tiny_dir: Path) -> None:
    proc, url = serve_cli(tiny_dir)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": [1, 2, 3],
                                                      "max_tokens": 4}, timeout=30)
        assert r.status_code == 404  # the model's name is checked in the frontend
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": [1, 2, 3],
                                                      "max_tokens": 4, "temperature": 0},
                       timeout=30)  # greedy: a sampled first token may be EOS (0 tokens)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "2 HTTP processes" in out
    wait_for(lambda: not session_left(proc), 20)


def test_a_frontend_process_imports_no_torch() -> None:
    """Its start costs what FastAPI and the tokenizer cost, not torch's ~2-5 s and memory."""
    code = ("import sys\nimport draftsmith.serve.frontends, draftsmith.serve.app\n"
            "assert 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m][:5]\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
