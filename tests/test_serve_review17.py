"""`draftsmith serve` as benchmark clients stream from it (SGLang's `bench_serving`, vLLM's
`benchmark_serving.py`, the `openai` client): OpenAI's SSE framing, each token's chunk flushed as
it is made (TTFT and inter-token latency read from chunk arrival), a speculative cycle's tokens as
one chunk, characters split across tokens never sent broken, a client leaving mid-stream freeing
its row, and many streams over a small batch answered whole, in the order they asked."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import engine, live, served, tiny_dir  # noqa: E402

from draftsmith.engine.params import KINDS  # noqa: E402
from draftsmith.serve.app import create_app  # noqa: E402
from draftsmith.serve.engine import ServeEngine  # noqa: E402
from draftsmith.serve.protocol import ServeConfig  # noqa: E402
from draftsmith.serve.text import ChoiceText  # noqa: E402

__all__ = ["engine", "tiny_dir"]  # fixtures
MSG = [{"role": "user", "content": "hello"}]
# each script's text: prompt [k] answers SCRIPTS[k - 1], one UTF-8 byte a token
SCRIPTS = ["héllo wörld", "漢字かな", "a😀b🎉c", "plain"]


# ---- a scripted engine: one byte a token, `per` tokens a step, `delay` s a step ---------------


class ScriptLive:
    def __init__(self, eng: ScriptEngine, rows: int) -> None:
        self.eng, self.rows = eng, [None] * rows
        self.tokens_per_step = eng.per
        self.hist = None

    def add(self, slots: list[int], prompts: list[list[int]], params: Any) -> None:
        self.eng.admitted += [p[0] for p in prompts]
        for i, p in zip(slots, prompts, strict=True):
            self.rows[i] = (list(self.eng.answer(p[0])), [])

    def step(self, n: int) -> None:
        for _ in range(n):
            time.sleep(self.eng.delay)
            self.eng.steps += 1
            for r in self.rows:
                if r is not None:
                    want, got = r
                    got += want[len(got): len(got) + self.eng.per]

    def read(self, slots: list[int]) -> tuple[list[list[int]], list[bool]]:
        rows = [list(self.rows[i][1]) for i in slots]
        return rows, [len(r) >= len(self.rows[i][0]) for r, i in zip(rows, slots, strict=True)]

    def drop(self, slots: list[int]) -> None:
        for i in slots:
            self.rows[i] = None


class ScriptEngine:
    """Answers prompt [k] with SCRIPTS[k - 1]'s UTF-8 bytes as token ids (a longer text where
    `long` is set), `per` tokens each step, each step taking `delay` seconds."""

    vocab_size, max_len, speculative, eos = 256, 512, False, [0]

    def __init__(self, max_batch: int = 4, delay: float = 0.0, per: int = 1) -> None:
        self.cfg = SimpleNamespace(max_batch=max_batch, max_tokens=256, fixed_rows=False)
        self.delay, self.per = delay, per
        self.admitted: list[int] = []
        self.steps = 0

    def answer(self, k: int) -> bytes:
        return (SCRIPTS[(k - 1) % len(SCRIPTS)] * (1 + (k - 1) // len(SCRIPTS))).encode()

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def text_ids(self, text: str, most: int | None = None) -> list[int]:
        return list(text.encode())

    def chat_ids(self, messages: list[dict], most: int | None = None) -> list[int]:
        return [int(messages[-1]["content"])]

    @staticmethod
    def batch_key(params: Any) -> str:
        return params.kind

    merged = staticmethod(ServeEngine.merged)
    template = staticmethod(ServeEngine.template)

    def open(self, rows: int, params: Any) -> ScriptLive:
        assert params.kind in KINDS
        return ScriptLive(self, rows)


@contextmanager
def serving(eng: ScriptEngine) -> Iterator[dict]:
    app = create_app(eng, ServeConfig("m", max_batch=eng.cfg.max_batch, max_tokens=256))
    with served(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        yield {"url": url, "client": client, "app": app}


def events(raw: str) -> list[Any]:
    """The SSE body's events, checked framed as OpenAI frames them."""
    assert raw.endswith("\n\n")
    out = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def timed_chunks(url: str, path: str, body: dict) -> list[tuple[float, Any]]:
    """(arrival time, event) of each SSE event, read as a benchmark client reads them."""
    got = []
    with httpx.stream("POST", url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                got.append((time.perf_counter(), data if data == "[DONE]" else json.loads(data)))
    return got


# ---- (1) SSE framing --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(engine: ServeEngine, tiny_dir: Path) -> Iterator[dict]:
    with live(engine, str(tiny_dir)) as s:
        yield s


def _heads_agree(chunks: list[dict], obj: str) -> None:
    heads = {(c["id"], c["created"], c["model"], c["object"]) for c in chunks}
    assert len(heads) == 1 and heads.pop()[3] == obj


def test_a_chat_stream_is_framed_as_openai_sends_it(srv: dict) -> None:
    body = {"model": srv["model"], "messages": MSG, "temperature": 0, "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(srv["url"] + "/v1/chat/completions", json=body, timeout=30)
    assert r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert evs[-1] == "[DONE]" and "[DONE]" not in evs[:-1]
    chunks = evs[:-1]
    _heads_agree(chunks, "chat.completion.chunk")
    first, *middle, finish, use = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert middle and all(set(c["choices"][0]["delta"]) == {"content"} for c in middle)
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None
               for c in [first, *middle])
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"] is None
    assert use["choices"] == [] and use["usage"]["completion_tokens"] == 6


def test_a_text_completion_stream_is_framed_as_openai_sends_it(srv: dict) -> None:
    body = {"model": srv["model"], "prompt": "Tell me a story", "temperature": 0, "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}}
    evs = events(httpx.post(srv["url"] + "/v1/completions", json=body, timeout=30).text)
    chunks = evs[:-1]
    assert evs[-1] == "[DONE]"
    _heads_agree(chunks, "text_completion")
    *texts, finish, use = chunks
    assert texts and all(c["choices"][0]["text"] for c in texts)
    assert finish["choices"][0]["finish_reason"] == "length" and use["choices"] == []
    whole = srv["client"].completions.create(model=srv["model"], prompt="Tell me a story",
                                             temperature=0, max_tokens=5)
    assert "".join(c["choices"][0]["text"] for c in texts) == whole.choices[0].text


# ---- (1) characters split across tokens, (2) flushing, speculative chunks ---------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_characters_split_across_tokens_are_never_sent_broken(k: int) -> None:
    with serving(ScriptEngine()) as s:
        parts = [ck.choices[0].delta.content for ck in s["client"].chat.completions.create(
            model="m", messages=[{"role": "user", "content": str(k)}], stream=True,
            temperature=0) if ck.choices and ck.choices[0].delta.content]
    assert "".join(parts) == SCRIPTS[k - 1]
    assert not any("\ufffd" in p for p in parts) and len(parts) == len(SCRIPTS[k - 1])


def test_each_tokens_chunk_is_flushed_as_it_is_made() -> None:
    """A benchmark's TTFT and ITL are chunk arrival times: a batched-up stream would show
    a late first token and near-zero gaps."""
    delay = 0.15
    with serving(ScriptEngine(delay=delay)) as s:
        got = timed_chunks(s["url"], "/v1/completions",
                           {"prompt": [4], "max_tokens": 64, "stream": True, "temperature": 0})
    texts = [(t, e) for t, e in got if e != "[DONE]" and e["choices"][0]["text"]]
    assert "".join(e["choices"][0]["text"] for _, e in texts) == "plain"
    gaps = [b - a for (a, _), (b, _) in zip(texts, texts[1:], strict=False)]
    assert len(texts) == 5 and min(gaps) > delay / 2, gaps


def test_a_speculative_cycle_streams_as_one_chunk() -> None:
    """One chunk a cycle: each carries the accepted run's text (3 tokens here), as vLLM."""
    with serving(ScriptEngine(per=3)) as s:
        got = timed_chunks(s["url"], "/v1/completions",
                           {"prompt": [1], "max_tokens": 64, "stream": True, "temperature": 0})
    texts = [e["choices"][0]["text"] for _, e in got if e != "[DONE]" and e["choices"][0]["text"]]
    assert "".join(texts) == SCRIPTS[0]
    raw = SCRIPTS[0].encode()
    # "héllo wörld" in bytes by 3: "hé" | "ll" | "o w" | "ö" (held for its byte) ...
    want, sent, cut = [], 0, 0
    while cut < len(raw):
        cut = min(cut + 3, len(raw))
        text = raw[:cut].decode("utf-8", errors="ignore")
        if len(text) > sent:
            want.append(text[sent:])
            sent = len(text)
    assert texts == want


def test_a_run_ending_mid_character_sends_the_text_before_it() -> None:
    """A cycle whose accepted run ends inside a character sent nothing (" w" waited a whole
    cycle for the next run to complete "ö"); its ids still come with the text they make."""
    ct = ChoiceText(ScriptEngine().decode, [], stream=True)
    raw = list("hé wö!".encode())
    assert ct.feed(raw[:3]) == "hé" and ct.feed(raw[:6]) == " w"  # "ö" is half here
    assert ct.partial and ct.feed(raw[:8]) == "ö!" and not ct.partial


def test_a_split_characters_ids_come_with_its_text() -> None:
    """With return_token_ids: " w" goes out before the half "ö" its last id holds; its ids
    wait for the text that completes it (a guard: they did before the fix too)."""
    with serving(ScriptEngine(per=3)) as s:
        got = timed_chunks(s["url"], "/v1/completions",
                           {"prompt": [1], "max_tokens": 64, "stream": True,
                            "return_token_ids": True})
    pairs = [(e["choices"][0]["text"], e["choices"][0]["token_ids"]) for _, e in got
             if e != "[DONE]"]
    assert sum((ids for _, ids in pairs), []) == list(SCRIPTS[0].encode())
    text, ids = "", []
    for t, i in pairs:  # ids never run ahead of the text they make
        text, ids = text + t, ids + i
        assert text.startswith(bytes(ids).decode())


# ---- (3) a client leaving mid-stream ----------------------------------------------------------


def _metrics(url: str) -> dict:
    return httpx.get(url + "/metrics", timeout=10).json()


def _until(cond: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)


def test_a_client_leaving_mid_stream_frees_its_row() -> None:
    """One row: the next request runs only once the stream that left frees it (its answer
    has 40 steps of 50 ms to go)."""
    eng = ScriptEngine(max_batch=1, delay=0.05)
    with serving(eng) as s:
        body = {"prompt": [8 * len(SCRIPTS) + 4], "max_tokens": 256, "stream": True}
        with httpx.stream("POST", s["url"] + "/v1/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines), next(lines)  # two tokens in, the client leaves
        t0 = time.perf_counter()
        r = s["client"].completions.create(model="m", prompt=[4], max_tokens=16, temperature=0)
        assert r.choices[0].text == "plain" and time.perf_counter() - t0 < 1.5
        _until(lambda: _metrics(s["url"])["cancelled"] == 1)
        assert _metrics(s["url"])["cancelled"] == 1 and eng.steps < 30


def test_a_stream_that_leaves_while_queued_is_dropped() -> None:
    eng = ScriptEngine(max_batch=1, delay=0.05)
    with serving(eng) as s:
        body = {"prompt": [4 * len(SCRIPTS) + 4], "max_tokens": 256, "stream": True}
        first = threading.Thread(target=lambda: timed_chunks(s["url"], "/v1/completions", body))
        first.start()
        _until(lambda: eng.admitted)
        with httpx.stream("POST", s["url"] + "/v1/completions", timeout=30,
                          json={"prompt": [3], "max_tokens": 64, "stream": True}) as r:
            assert r.status_code == 200
            _until(lambda: httpx.get(s["url"] + "/health").json()["queued"] == 1)
        _until(lambda: httpx.get(s["url"] + "/health").json()["queued"] == 0, 2.0)
        assert httpx.get(s["url"] + "/health").json()["queued"] == 0
        first.join(30)
        assert eng.admitted == [4 * len(SCRIPTS) + 4]


# ---- (4) many streams over a small batch ------------------------------------------------------


def test_sixteen_streams_over_four_rows_answer_whole_in_order() -> None:
    eng = ScriptEngine(max_batch=4, delay=0.01)
    n = 16
    texts: dict[int, str] = {}
    with serving(eng) as s:
        def read(k: int, stream: Any) -> None:
            texts[k] = "".join(ck.choices[0].delta.content or "" for ck in stream if ck.choices)

        threads = []
        for k in range(1, n + 1):  # create returns at the 200: the job is queued
            stream = s["client"].chat.completions.create(
                model="m", messages=[{"role": "user", "content": str(k)}], stream=True,
                temperature=0)
            threads.append(threading.Thread(target=read, args=(k, stream)))
            threads[-1].start()
        for t in threads:
            t.join(30)
    assert texts == {k: eng.answer(k).decode() for k in range(1, n + 1)}
    assert eng.admitted == list(range(1, n + 1))
