"""Serve pieces without a server: text streaming, request parsing, the scheduler, the CLI."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.engine.sampling import KINDS, SamplingParams
from draftsmith.serve.engine import ServeEngine
from draftsmith.serve.protocol import ApiError, ServeConfig, parse_chat, parse_completion
from draftsmith.serve.scheduler import Job, Row, Scheduler
from draftsmith.serve.text import ChoiceText

# ---- text ------------------------------------------------------------------------------------


def utf8_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def stream_all(ct: ChoiceText, ids: list[int]) -> str:
    out = "".join(ct.feed(ids[:i]) for i in range(1, len(ids) + 1))
    return out + ct.feed(ids, final=True)


def test_stream_never_splits_a_character() -> None:
    ids = list("héllo wörld ✓".encode())
    ct = ChoiceText(utf8_decode, [], stream=True)
    pieces = [ct.feed(ids[:i]) for i in range(1, len(ids) + 1)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + ct.feed(ids, True) == "héllo wörld ✓"


def test_stop_string_held_back_and_cut() -> None:
    ids = list(b"abc STOP def")
    ct = ChoiceText(utf8_decode, ["STOP", "zz"], stream=True)
    sent = ""
    for i in range(1, len(ids) + 1):
        sent += ct.feed(ids[:i])
        assert "S" not in sent
        if ct.stopped:
            break
    assert sent == "abc " and ct.stopped
    whole = ChoiceText(utf8_decode, ["STOP"], stream=False)
    assert whole.feed(ids, True) == "abc " and whole.stopped


def test_whole_text_decoded_once_unless_a_stop_string_is_watched() -> None:
    ids = list(b"abc STOP def")
    calls: list[int] = []

    def counting(toks: list[int]) -> str:
        calls.append(len(toks))
        return utf8_decode(toks)

    plain = ChoiceText(counting, [], stream=False)
    assert all(plain.feed(ids[:i]) == "" for i in range(1, len(ids)))
    assert plain.feed(ids, True) == "abc STOP def" and calls == [len(ids)]
    watched = ChoiceText(counting, ["STOP"], stream=False)
    looks = [watched.feed(ids[:i]) for i in range(1, len(ids))]
    assert watched.stopped and "".join(looks) == "abc " and len(calls) > 2


def test_a_stop_character_split_across_looks_is_found_whether_streamed_or_not() -> None:
    """A one-character stop string whose UTF-8 bytes straddle two looks: the look that sees a
    partial character does not move past it, so the next finds the whole one."""
    ids = list("ab。cd".encode())
    for stream in (False, True):
        ct = ChoiceText(utf8_decode, ["。"], stream=stream)
        got = "".join(ct.feed(ids[:k]) for k in (3, 7))
        assert ct.stopped and ct.text == "ab" and (got == "ab" or not stream)


def test_the_stop_string_completed_first_wins_whatever_the_looks() -> None:
    """["Q:\n", ":"]: ":" is complete one character before "Q:\n", so token by token or all at
    once the text stops before ":", and the usage counts the tokens up to it only."""
    ids = list(b"hi Q:\nmore")
    one = ChoiceText(utf8_decode, ["Q:\n", ":"], stream=False)
    one.feed(ids, True)
    each = ChoiceText(utf8_decode, ["Q:\n", ":"], stream=True)
    streamed = stream_all(each, ids)
    assert one.text == each.text == streamed == "hi Q" and one.stop_end == 5
    assert one.tokens_used(ids) == each.tokens_used(ids) == 5  # b"hi Q:" and no more
    both = ChoiceText(utf8_decode, [":", "Q:"], stream=False)  # end together: the longer
    both.feed(ids, True)
    assert both.text == "hi " and both.tokens_used(ids) == 5


def test_usage_counts_the_tokens_up_to_the_stop_string_not_the_look_after_it() -> None:
    """A non-streamed row looks every few steps: the tokens it read past the stop string are
    neither in its text nor in its completion_tokens."""
    events: list = []
    j = job("a", events, max_tokens=12)
    j.req.stop = ["c"]
    row = Row(j, 0, [1], [0], FakeEngine().decode)
    j.rows = [row]
    row.feed([1, 2, 3, 4, 5, 6, 7], False)  # "abcdefg": "c" was the 3rd token
    (finish,) = [e for e in events if e[0] == "finish"]
    assert finish[2].text == "ab" and finish[2].tokens == 3 and row.tokens == [1, 2, 3]


def test_no_stop_streams_everything() -> None:
    ids = list(b"plain text")
    assert stream_all(ChoiceText(utf8_decode, [], True), ids) == "plain text"
    assert stream_all(ChoiceText(utf8_decode, ["xyz"], True), ids) == "plain text"


# ---- parsing ---------------------------------------------------------------------------------


class FakePrompter:
    vocab_size = 256

    def chat_ids(self, messages: list[dict[str, str]], most: int | None = None) -> list[int]:
        if [m["role"] for m in messages][-1:] == ["assistant"]:
            raise ValueError("the last message must not be the assistant's")
        return list("".join(m["content"] for m in messages).encode())

    def text_ids(self, text: str, most: int | None = None) -> list[int]:
        return list(text.encode())


CFG = ServeConfig("tiny", ("alias",), max_tokens=32, max_prompt_tokens=20, max_batch=4)


def test_parse_chat_defaults_and_fields() -> None:
    r = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                    "model": "alias", "temperature": 0, "max_completion_tokens": 5, "n": 2,
                    "stop": "x", "stream": True, "stream_options": {"include_usage": True}},
                   CFG, FakePrompter())
    assert r.model == "tiny" and r.max_tokens == 5 and r.n == 2 and r.rows == 2
    assert r.params == SamplingParams() and r.stop == ["x"] and r.stream and r.include_usage
    assert r.prompts == [list(b"be briefhi")]
    d = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, CFG, FakePrompter())
    assert d.max_tokens == 32 and d.params.temperature == 1.0 and not d.stream


def test_parse_errors_name_the_field() -> None:
    with pytest.raises(ApiError, match="chat template") as e:
        parse_chat({"messages": [{"role": "assistant", "content": "x"}]}, CFG, FakePrompter())
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(ApiError, match="image|text parts"):
        parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, CFG,
                   FakePrompter())
    with pytest.raises(ApiError, match="seed"):
        parse_completion({"prompt": "a", "seed": 1.5}, CFG, FakePrompter())
    with pytest.raises(ApiError, match="empty"):
        parse_completion({"prompt": ""}, CFG, FakePrompter())
    c = parse_completion({"prompt": [[1, 2], [3]]}, CFG, FakePrompter())
    assert c.prompts == [[1, 2], [3]] and c.max_tokens == 16


# ---- scheduler -------------------------------------------------------------------------------


class FakeLive:
    """Rows whose every step appends the prompt's first token; a row ends at max_tokens."""

    tokens_per_step = 1

    def __init__(self, eng: FakeEngine, rows: int, kind: str) -> None:
        self.eng, self.rows, self.kind = eng, [None] * rows, kind
        self.hist = None

    def add(self, slots, prompts, params) -> None:
        if self.eng.bad in prompts:
            raise RuntimeError("bad row")
        assert all(KINDS.index(p.kind) <= KINDS.index(self.kind) for p in params)
        self.eng.adds.append((len(self.eng.batches), list(slots)))
        self.eng.temps.extend(p.temperature for p in params)
        for i, p in zip(slots, prompts, strict=True):
            self.rows[i] = [p[0]]

    def step(self, n: int) -> None:
        for _ in range(n):
            self.eng.gate.wait(10)
            if self.eng.ticks is not None:
                assert self.eng.ticks.acquire(timeout=10)
            self.eng.steps += 1
            for r in self.rows:
                if r is not None and len(r) < self.eng.cfg.max_tokens:
                    r.append(r[0])

    def read(self, slots):
        rows = [list(self.rows[i]) for i in slots]
        return rows, [len(r) >= self.eng.cfg.max_tokens for r in rows]

    def drop(self, slots) -> None:
        for i in slots:
            self.rows[i] = None


class FakeEngine:
    """Echoes each prompt's first token as the whole completion; records batches (their rows)
    and which slots each prefill filled."""

    def __init__(self, max_batch: int = 4, max_tokens: int = 3, fixed_rows: bool = False) -> None:
        self.cfg = SimpleNamespace(max_batch=max_batch, max_tokens=max_tokens,
                                   fixed_rows=fixed_rows)
        self.speculative, self.eos = False, [0]
        self.batches: list[int] = []
        self.adds: list[tuple[int, list[int]]] = []
        self.steps = 0
        self.ticks: threading.Semaphore | None = None  # set: each step waits for a release
        self.bad: list[int] | None = None  # a prompt whose prefill raises
        self.gate = threading.Event()
        self.gate.set()
        self.temps: list[float] = []  # each admitted row's temperature, in order
        self.kinds: list[str] = []  # each batch's kind of sampling

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(96 + i) for i in ids)

    @staticmethod
    def batch_key(params):
        return params.kind

    merged = staticmethod(ServeEngine.merged)
    template = staticmethod(ServeEngine.template)

    def open(self, rows: int, params) -> FakeLive:
        self.gate.wait(10)
        self.batches.append(rows)
        self.kinds.append(params.kind)
        return FakeLive(self, rows, params.kind)


def job(text: str, events: list, temperature: float = 0.0, n: int = 1,
        max_tokens: int = 3, stream: bool = False, seed: int | None = None) -> Job:
    body = {"prompt": text, "max_tokens": max_tokens, "stream": stream,
            "temperature": temperature, "n": n, **({"seed": seed} if seed is not None else {})}
    req = parse_completion(body, CFG, FakePrompter())
    req.prompts = [[ord(text[0]) - 96]]
    return Job(req, events.append)


def until(cond, timeout: float = 10.0) -> None:
    """Waits for the worker to reach the state `cond` sees (fixed pauses raced it on a loaded
    machine); after the deadline the test goes on and its assertions fail honestly."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


def wait_done(events: list, count: int) -> None:
    deadline = time.time() + 10
    while sum(e[0] in ("done", "error") for e in events) < count:
        assert time.time() < deadline
        time.sleep(0.01)


def test_scheduler_batches_same_settings_fifo() -> None:
    eng = FakeEngine(max_batch=4)
    s = Scheduler(eng, max_queue=8)
    with pytest.raises(ApiError) as e:
        s.submit(job("a", []))
    assert e.value.status == 503  # not started
    s.start()
    eng.gate.clear()
    events: list = []
    s.submit(job("a", events))
    until(lambda: not s.queued())  # the worker holds "a" at the gate
    for text, temp in [("b", 0.0), ("c", 0.7), ("d", 0.0), ("e", 0.0), ("f", 0.0), ("g", 0.0)]:
        s.submit(job(text, events, temp))
    with pytest.raises(ApiError) as e:
        for _ in range(8):
            s.submit(job("z", []))
    assert e.value.status == 429
    with s._cv:
        s._queue = type(s._queue)(j for j in s._queue if j.req.prompts != [[26]])
    eng.gate.set()
    wait_done(events, 7)
    s.stop()
    # a, and b joining a's row when it ends | c d e f, g joining: the first batch opened with a
    # alone, one row, greedy; b, next in the queue and greedy, took that row (batch 1, slot 0);
    # c, sampled, then held the queue until a's batch drained (a greedy batch has no sampling
    # code), and opened a sampled batch that the greedy jobs behind it shared
    assert eng.batches == [1, 4] and eng.kinds == ["greedy", "temperature"]
    assert eng.adds[:2] == [(1, [0]), (1, [0])]
    texts = [e[2].text for e in events if e[0] == "finish"]
    assert sorted(texts) == sorted(c * 3 for c in "abcdefg")


def test_jobs_of_any_settings_share_a_batch_of_the_widest_kind_each_with_its_own() -> None:
    """Sampled jobs at three temperatures and a top-p one open one batch, of the widest kind
    among them (filtered: one sort a step serves them all), each row admitted with its own
    job's setting; a greedy job queued behind joins it when a row frees (a batch's kind holds
    the kinds before it)."""
    eng = FakeEngine(max_batch=4)
    s = Scheduler(eng, max_queue=8, batch_wait=0.5)
    s.start()
    eng.gate.clear()
    events: list = []
    for text, temp in [("a", 0.5), ("b", 0.9), ("c", 1.3)]:
        s.submit(job(text, events, temp))
    filtered = job("d", events, 0.7)
    filtered.req.params = SamplingParams(0.7, top_p=0.9)
    s.submit(filtered)
    s.submit(job("e", events))
    eng.gate.set()
    wait_done(events, 5)
    s.stop()
    assert eng.batches == [4] and eng.kinds == ["filtered"]  # a b c d, then e joining
    assert eng.temps == [0.5, 0.9, 1.3, 0.7, 0.0]
    assert s.metrics.snapshot(0)["joined_rows"] == 1


@pytest.mark.parametrize("fixed", [False, True])
def test_fixed_rows_opens_every_batch_at_max_batch(fixed: bool) -> None:
    """--fixed-rows: a lone job's batch opens with all max_batch rows (one row count, so one set
    of kernels whatever the load), a seeded sampled job's too; otherwise at the next power of
    two of the rows it needs, and a seeded job at exactly its own."""
    eng = FakeEngine(max_batch=4, fixed_rows=fixed)
    s = Scheduler(eng, max_queue=8)
    s.start()
    events: list = []
    s.submit(job("a", events))
    wait_done(events, 1)
    s.submit(job("b", events, n=3))
    wait_done(events, 2)
    s.submit(job("c", events, temperature=0.7, n=3, seed=5))
    wait_done(events, 3)
    s.stop()
    assert eng.batches == ([4, 4, 4] if fixed else [1, 4, 3])
    texts = sorted(e[2].text for e in events if e[0] == "finish")
    assert texts == ["aaa"] + ["bbb"] * 3 + ["ccc"] * 3


def scenario(continuous: bool) -> tuple[FakeEngine, Scheduler, dict[str, list], list[str]]:
    """A long streamed job A beside a short B; then C (A's settings), D (other settings), E
    (A's settings) queue while they decode. Returns the engine, the scheduler, each job's events
    and the order the jobs ended in."""
    eng = FakeEngine(max_batch=4, max_tokens=12)
    eng.ticks = threading.Semaphore(0)
    s = Scheduler(eng, max_queue=8, batch_wait=0.5, continuous=continuous)
    s.start()
    ev: dict[str, list] = {t: [] for t in "ABCDE"}
    order: list[str] = []

    def submit(t: str, **kw) -> None:
        j = job(t.lower(), [], **kw)
        j._sink = lambda e, t=t: (ev[t].append(e), e[0] == "done" and order.append(t))
        s.submit(j)

    submit("A", max_tokens=12, stream=True)
    submit("B", max_tokens=2)
    until(lambda: eng.batches == [2])  # the batch opened with A and B: two rows
    submit("C", max_tokens=3)
    submit("D", temperature=0.7)
    submit("E", max_tokens=3)
    eng.ticks.release(100)
    for t in "ABCDE":
        wait_done(ev[t], 1)
    s.stop()
    return eng, s, ev, order


def test_rows_that_end_take_the_next_jobs_of_their_settings_in_queue_order() -> None:
    """Continuous batching: a long job keeps decoding while a short one beside it ends and the
    next queued job the batch holds (greedy, as it) takes its row and finishes first; a sampled
    job at the head of the queue, which a greedy batch does not hold, stops further joins, and
    the greedy job behind it waits for its turn (FIFO, no starvation), then shares the sampled
    job's batch."""
    eng, s, ev, order = scenario(continuous=True)
    assert eng.batches == [2, 2]  # A B, C joining | D E
    assert eng.kinds == ["greedy", "temperature"]
    assert eng.adds[:2] == [(1, [0, 1]), (1, [1])]  # C took B's row in the first batch
    assert order == ["B", "C", "A", "D", "E"]
    assert "".join(e[2] for e in ev["A"] if e[0] == "delta") == "a" * 12
    assert [e[2].text for e in ev["C"] if e[0] == "finish"] == ["ccc"]
    m = s.metrics.snapshot(0)
    assert m["batches"] == 2 and m["batch_rows"] == 4 and m["completed"] == 5
    assert m["joined_rows"] == 1


def test_a_small_batch_drains_rather_than_take_a_queue_one_row_at_a_time() -> None:
    """A batch opened with one row, and three jobs of its settings queued meanwhile: when its
    row ends it takes none of them (they do not all fit), so the next batch opens with all three
    in four rows, where a fifth job later joins a freed row."""
    eng = FakeEngine(max_batch=4, max_tokens=12)
    eng.ticks = threading.Semaphore(0)
    s = Scheduler(eng, max_queue=8, batch_wait=0.2)
    s.start()
    events: list = []
    s.submit(job("a", events, max_tokens=4))
    until(lambda: eng.batches == [1])  # a's batch opened alone
    for t, n in (("b", 2), ("c", 6), ("d", 6)):
        s.submit(job(t, events, max_tokens=n))
    time.sleep(0.3)
    eng.ticks.release(3)  # a ends (4 tokens); b c d wait
    deadline = time.time() + 10
    while len(eng.batches) < 2:
        assert time.time() < deadline
        time.sleep(0.01)
    s.submit(job("e", events, max_tokens=3))
    time.sleep(0.3)
    eng.ticks.release(100)
    wait_done(events, 5)
    s.stop()
    assert eng.batches == [1, 4]
    assert eng.adds == [(1, [0]), (2, [0, 1, 2]), (2, [0])]  # e took b's row, ended first
    assert s.metrics.snapshot(0)["joined_rows"] == 1


def test_a_joiner_that_fails_leaves_the_running_rows_decoding() -> None:
    """A job whose prefill fails as it joins gets its 500; the streamed job already running
    beside it goes on to the end, and /metrics shows the running batch's engine time before it
    drains."""
    eng = FakeEngine(max_batch=4, max_tokens=12)
    eng.ticks, eng.bad = threading.Semaphore(0), [3]  # "c" fails to prefill
    s = Scheduler(eng, max_queue=8, batch_wait=0.3)
    s.start()
    ev: dict[str, list] = {t: [] for t in "abc"}
    for t, n, stream in (("a", 12, True), ("b", 2, False)):
        s.submit(job(t, ev[t], max_tokens=n, stream=stream))
    until(lambda: eng.batches == [2])
    s.submit(job("c", ev["c"], max_tokens=3))
    eng.ticks.release(3)
    wait_done(ev["c"], 1)
    m = s.metrics.snapshot(0)
    assert m["engine_busy_s"] > 0 and m["completed"] == 1 and m["batches"] == 1  # b, mid-batch
    eng.ticks.release(100)
    wait_done(ev["a"], 1)
    s.stop()
    assert ev["c"][-1][:2] == ("error", 500) and "bad row" in ev["c"][-1][2]
    assert ev["a"][-1][0] == "done"
    assert "".join(e[2] for e in ev["a"] if e[0] == "delta") == "a" * 12


def test_an_eos_past_the_limit_is_a_length_finish_and_steps_stop_near_it() -> None:
    """A speculative cycle can run a row past its max_tokens: an eos found only past the limit
    does not make the finish a "stop". And the worker looks again once the nearest row can have
    reached its limit at the most tokens a step emits."""
    events: list = []
    j = job("e", events, max_tokens=4)
    row = Row(j, 0, [5], [0], FakeEngine().decode)
    j.rows = [row]
    row.feed([5, 5, 5, 5, 5, 5, 0], True)
    (finish,) = [e for e in events if e[0] == "finish"]
    assert finish[2].finish_reason == "length" and finish[2].text == "eeee"
    long = Row(job("f", [], max_tokens=30), 0, [6], [0], FakeEngine().decode)
    long.tokens = [6]
    assert Scheduler._steps([long], 1) == 16  # CHECK_EVERY
    assert Scheduler._steps([long], 4) == 8  # 29 left, 4 a cycle
    long.tokens = [6] * 29
    assert Scheduler._steps([long, None], 4) == 1


def test_static_batches_run_until_their_last_row_ends() -> None:
    """`serve --static-batches`: no job joins a running batch; C waits for A, then runs with D
    and E (the next batch gathers every job it can hold from the queue: greedy C and E with
    sampled D, a batch of temperature sampling)."""
    eng, s, ev, order = scenario(continuous=False)
    assert eng.batches == [2, 4] and eng.kinds == ["greedy", "temperature"]
    assert order == ["B", "A", "C", "D", "E"]
    assert [e[2].text for e in ev["C"] if e[0] == "finish"] == ["ccc"]
    assert s.metrics.snapshot(0)["joined_rows"] == 0


def test_scheduler_isolates_engine_errors() -> None:
    eng = FakeEngine(max_batch=4)
    eng.bad = [2]  # "b": its prefill raises
    s = Scheduler(eng, max_queue=8)
    s.start()
    eng.gate.clear()
    events: dict[str, list] = {t: [] for t in "xabc"}
    s.submit(job("x", events["x"]))
    until(lambda: not s.queued())  # the worker holds "x" at the gate
    for t in "abc":
        s.submit(job(t, events[t]))
    eng.gate.set()
    for ev in events.values():
        wait_done(ev, 1)
    s.stop()
    assert events["b"][-1][:2] == ("error", 500) and "bad row" in events["b"][-1][2]
    assert all(events[t][-1][0] == "done" for t in "xac")
    assert s.metrics.snapshot(0)["failed"] == 1


# ---- CLI -------------------------------------------------------------------------------------


def test_draftsmith_imports_without_fastapi() -> None:
    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None\n"
            "import draftsmith.cli, draftsmith.serve.cli, draftsmith.serve.scheduler\n"
            "from typer.testing import CliRunner\n"
            "import typer\n"
            "app = typer.Typer(); app.command()(draftsmith.serve.cli.serve)\n"
            "r = CliRunner().invoke(app, [])\n"
            "assert 'fastapi' in str(r.exception), r.exception\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_serve_command_wiring(tiny_llama_dir: Path, monkeypatch) -> None:
    import typer
    from typer.testing import CliRunner

    import draftsmith.serve.app as app_mod
    from draftsmith.serve.cli import serve

    seen = {}
    def run_server(engine, cfg, host, port, level, frontends, sock=None) -> None:
        seen.update(engine=engine, cfg=cfg, host=host, port=port, frontends=frontends)

    monkeypatch.setattr(app_mod, "run_server", run_server)
    app = typer.Typer()
    app.command()(serve)
    r = CliRunner().invoke(app, ["--target", str(tiny_llama_dir), "--device", "cpu",
                                 "--max-batch", "2", "--max-tokens-limit", "16",
                                 "--max-prompt-tokens", "32", "--port", "8123",
                                 "--frontends", "2"])
    assert r.exit_code == 0, r.output
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123 and seen["frontends"] == 2
    r = CliRunner().invoke(app, ["--target", str(tiny_llama_dir), "--device", "cpu",
                                 "--max-batch", "2", "--max-tokens-limit", "16",
                                 "--max-prompt-tokens", "32"])
    assert r.exit_code == 0 and seen["frontends"] == 0  # the default on a CPU device
    assert seen["cfg"].model_name == tiny_llama_dir.name and seen["cfg"].max_tokens == 16
    assert seen["engine"].rt.max_batch == 2 and not seen["engine"].speculative
    bad = CliRunner().invoke(app, ["--target", str(tiny_llama_dir), "--device", "cpu",
                                   "--max-prompt-tokens", "600"])
    assert "max_position_embeddings" in str(bad.exception)
    loads = []
    monkeypatch.setattr("draftsmith.serve.engine.load_engine", lambda *a, **k: loads.append(a))
    typo = CliRunner().invoke(app, ["--target", str(tiny_llama_dir), "--device", "cpu",
                                    "--warm-sampling", "temperature,topp"])
    assert "unknown kind(s) ['topp']" in str(typo.exception) and not loads  # before the load
    for flags, says in ((["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
                        (["--max-tokens-limit", "0"], "--max-tokens-limit must be >= 1"),
                        (["--log-level", "banana"], "--log-level 'banana': use one of")):
        r = CliRunner().invoke(app, ["--target", str(tiny_llama_dir), "--device", "cpu", *flags])
        assert says in str(r.exception) and not loads, (flags, r.exception)


def test_serve_refuses_a_bad_or_taken_port_before_loading_the_model(tmp_path) -> None:
    """A port out of range, or one another socket holds, is a one-line error before the model
    loads (it used to be uvicorn's traceback after the load)."""
    import socket
    import subprocess
    import sys

    from draftsmith.errors import DraftsmithError
    from draftsmith.serve.cli import check_bindable

    with pytest.raises(DraftsmithError, match="--port 70000: use 0-65535"):
        check_bindable("127.0.0.1", 70000)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(DraftsmithError, match=f"cannot bind 127.0.0.1:{port}"):
            check_bindable("127.0.0.1", port)
    check_bindable("127.0.0.1", 0)  # a free port passes
    r = subprocess.run([sys.executable, "-m", "draftsmith", "serve", "--target",
                        str(tmp_path / "never-loaded"), "--port", "-1", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--port -1: use 0-65535" in r.stderr, r.stderr


def test_speculative_settings_without_a_drafter_are_refused(tmp_path) -> None:
    """`serve --topk 4 --num-draft-tokens 8` without --drafter served plainly, its settings
    ignored without a word."""
    import typer
    from typer.testing import CliRunner

    from draftsmith.errors import DraftsmithError
    from draftsmith.serve.cli import serve

    app = typer.Typer()
    app.command()(serve)
    app.command("other")(lambda: None)
    for flags in (["--steps", "5"], ["--topk", "4", "--num-draft-tokens", "8"]):
        r = CliRunner().invoke(app, ["serve", "--target", str(tmp_path / "never-loaded"),
                                     "--device", "cpu", *flags])
        assert isinstance(r.exception, DraftsmithError), r.output
        assert "give --drafter with them" in str(r.exception)


def test_auto_frontends_only_on_a_gpu_host_with_cores_to_spare() -> None:
    from draftsmith.serve.cli import AUTO_FRONTENDS, auto_frontends

    assert auto_frontends("cuda", 16) == AUTO_FRONTENDS > 0
    assert auto_frontends("cuda", 4) == 0 and auto_frontends("cpu", 64) == 0


@pytest.mark.parametrize("join_at, join_wait", [(1, 10.0), (2, 10.0), (4, 0.0)])
def test_a_continuous_batch_joins_once_enough_rows_are_free(join_at: int,
                                                              join_wait: float) -> None:
    """Four rows ending after 2, 3, 12 and 12 tokens, two jobs queued: joining at one free row
    admits each job as a row ends; at two, both together when the second row ends; at four,
    with the head's wait already past, as at one."""
    eng = FakeEngine(max_batch=4, max_tokens=12)
    eng.ticks = threading.Semaphore(0)
    s = Scheduler(eng, max_queue=8, batch_wait=0.2, join_at=join_at, join_wait=join_wait)
    s.start()
    events: list = []
    for t, n in (("a", 2), ("b", 3), ("c", 12), ("d", 12)):
        s.submit(job(t, events, max_tokens=n))
    until(lambda: eng.batches == [4])  # the batch opened with four rows
    for t in "ef":
        s.submit(job(t, events, max_tokens=8))
    eng.ticks.release(100)
    wait_done(events, 6)
    s.stop()
    joins = eng.adds[1:]
    if join_at == 2:
        assert joins == [(1, [0, 1])]  # e and f together, in a's and b's rows
    else:
        assert joins == [(1, [0]), (1, [1])]  # e in a's row, f in b's
    assert s.metrics.snapshot(0)["joined_rows"] == 2


def test_a_job_cancelled_while_it_decodes_counts_as_cancelled_not_completed() -> None:
    eng = FakeEngine(max_batch=2, max_tokens=12)
    eng.ticks = threading.Semaphore(0)
    s = Scheduler(eng, max_queue=4, batch_wait=0.0)
    s.start()
    events: list = []
    j = job("a", events, max_tokens=12, stream=True)
    s.submit(j)
    eng.ticks.release(2)
    deadline = time.time() + 10
    while not any(e[0] == "delta" for e in events):
        assert time.time() < deadline
        time.sleep(0.01)
    s.cancel(j)
    eng.ticks.release(100)
    wait_done(events, 1)
    s.stop()
    m = s.metrics.snapshot(0)
    assert (m["completed"], m["cancelled"], m["completion_tokens"]) == (0, 1, 0)
