"""Regenerate with the built-in engine and against a real OpenAI-compatible HTTP server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from draftsmith.data.prompts import Conversation, read_jsonl_tail_safe
from draftsmith.data.regenerate import (
    Answer,
    EngineBackend,
    OpenAIBackend,
    RegenConfig,
    regenerate,
    regenerate_file,
    server_model,
)
from draftsmith.errors import DraftsmithError


def ok_reply() -> dict:
    """A chat completion whose answer is "ok", as an OpenAI-compatible server sends it."""
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

def convs() -> list[Conversation]:
    out = [Conversation([{"role": "user", "content": f"tell me about {i}"}]) for i in range(5)]
    out.append(Conversation([{"role": "system", "content": "be kind"},
                             {"role": "user", "content": "first?"},
                             {"role": "assistant", "content": "an old answer"},
                             {"role": "user", "content": "second?"}]))
    return out




def test_engine_answers_turn_by_turn_and_resumes(target, model, tmp_path):
    cfg = RegenConfig(max_new_tokens=12, max_len=96, batch_size=4, temperature=0.0)
    out = tmp_path / "a.jsonl"
    backend = EngineBackend(target, model, cfg)
    first = regenerate(convs()[:3], out, backend, target.tokenizer, cfg, False, lambda s: None)
    assert first["answered"] == 3
    stats = regenerate(convs(), out, backend, target.tokenizer, cfg, False, lambda s: None)
    assert stats["done_before"] == 3 and stats["answered"] == 3
    recs = read_jsonl_tail_safe(out)
    assert sorted(r["meta"]["prompt_id"] for r in recs) == sorted(c.id for c in convs())
    multi = next(r for r in recs if r["meta"]["prompt_id"] == convs()[5].id)
    roles = [m["role"] for m in multi["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert multi["messages"][2]["content"] != "an old answer"
    a = multi["meta"]["answers"]
    assert [x["turn"] for x in a] == [0, 1] and a[0]["backend"] == "engine"
    assert a[0]["sampling"]["temperature"] == 0.0 and a[0]["model"] == target.source
    # greedy answers are the engine's own greedy continuation of the prompt
    from draftsmith.engine.generate import generate

    ids = target.chat_ids(multi["messages"][:2])
    want = generate(model, [ids], 12, eos_ids=target.eos_ids)[0]
    assert multi["messages"][2]["content"] == target.tokenizer.decode(
        want, skip_special_tokens=True).strip()


def test_too_long_prompts_truncated_or_skipped_and_counted(target, model, tmp_path):
    long = Conversation([{"role": "user", "content": "x" * 200}])
    data = [long, *convs()[:2]]
    for mode in ("skip", "truncate"):
        cfg = RegenConfig(max_new_tokens=8, max_len=72, batch_size=4, temperature=0.0,
                          too_long=mode)
        out = tmp_path / f"{mode}.jsonl"
        stats = regenerate(data, out, EngineBackend(target, model, cfg), target.tokenizer, cfg,
                           False, lambda s: None)
        recs = read_jsonl_tail_safe(out)
        if mode == "skip":
            assert stats["skipped_too_long"] == 1 and stats["answered"] == 2 and len(recs) == 2
        else:
            assert stats["truncated"] == 1 and stats["answered"] == 3
            cut = next(r for r in recs if r["meta"]["prompt_id"] == long.id)
            assert len(target.chat_ids(cut["messages"][:1])) <= 72 - 8
            assert cut["messages"][0]["content"].startswith("xxxx")


def test_sampled_resume_past_a_skipped_prompt_equals_the_uninterrupted_run(target, model,
                                                                           tmp_path):
    """A prompt skipped as too long is never written, so a rerun sees it as left to do: the
    chunks (and their seeds) must not shift around it."""
    asks = [Conversation([{"role": "user", "content": f"question {i} " * (1 + i % 3)}], f"q{i}")
            for i in range(6)]
    asks[1] = Conversation([{"role": "user", "content": "x" * 300}], "long")
    cfg = RegenConfig(max_new_tokens=6, max_len=96, batch_size=2, temperature=1.0,
                      too_long="skip", refill=False)
    backend = EngineBackend(target, model, cfg)
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    regenerate(asks, whole, backend, target.tokenizer, cfg, False, lambda s: None)
    regenerate(asks[:4], part, backend, target.tokenizer, cfg, False, lambda s: None)  # killed
    stats = regenerate(asks, part, backend, target.tokenizer, cfg, False, lambda s: None)
    assert stats["done_before"] == 3 and stats["skipped_too_long"] == 1
    assert part.read_text() == whole.read_text()


# --- a real OpenAI-compatible server on loopback -------------------------------------------


def make_app(seen: list[dict], fail_first: int) -> FastAPI:
    app = FastAPI()
    state = {"calls": 0}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model",
                                             "created": 0, "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["calls"] += 1
        if state["calls"] <= fail_first:
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        seen.append(body)
        last = body["messages"][-1]["content"]
        text = f"echo({len(body['messages'])}): {last}"
        return {
            "id": f"c{state['calls']}", "object": "chat.completion", "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
        }

    return app


@contextmanager
def running(app: FastAPI) -> Iterator[str]:
    """`app` served on loopback; yields its /v1 URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        srv.should_exit = True
        th.join(5)


@pytest.fixture()
def server():
    seen: list[dict] = []
    with running(make_app(seen, fail_first=2)) as url:
        yield url, seen


def test_openai_server_backend(server, target, tmp_path):
    url, seen = server
    cfg = RegenConfig(max_new_tokens=16, max_len=256, batch_size=4, temperature=0.5, seed=3)
    out = tmp_path / "s.jsonl"
    backend = OpenAIBackend(url, "fake-model", cfg, concurrency=3, retries=4, backoff=0.01)
    try:
        stats = regenerate(convs(), out, backend, target.tokenizer, cfg, False, lambda s: None)
    finally:
        backend.close()
    assert stats["answered"] == 6 and stats["failed"] == 0
    assert all(b["model"] == "fake-model" and b["max_tokens"] == 16 and b["temperature"] == 0.5
               for b in seen)
    recs = {r["meta"]["prompt_id"]: r for r in read_jsonl_tail_safe(out)}
    multi = recs[convs()[5].id]
    assert [m["content"] for m in multi["messages"]] == [
        "be kind", "first?", "echo(2): first?", "second?", "echo(4): second?"]
    a = multi["meta"]["answers"][1]
    assert a["backend"] == "openai" and a["model"] == "fake-model" and a["base_url"] == url
    assert a["sampling"]["seed"] == 3 and a["tokens"] == 3 and a["finish"] == "stop"
    # rerun: nothing left to do, nothing duplicated
    logs: list[str] = []
    stats = regenerate_file(convs(), out, cfg, str(target.folder), base_url=url, retries=0,
                            log=logs.append)
    assert stats["done_before"] == 6 and len(read_jsonl_tail_safe(out)) == 6
    assert not [m for m in logs if "default target's tokenizer" in m]


def test_server_errors_are_counted_not_written(tmp_path, target):
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2)
    backend = OpenAIBackend("http://127.0.0.1:9/v1", "m", cfg, retries=1, backoff=0.01,
                            timeout=2)
    stats = regenerate(convs()[:2], tmp_path / "e.jsonl", backend, target.tokenizer, cfg, False,
                       lambda s: None)
    assert stats["failed"] == 2 and stats["answered"] == 0
    assert (tmp_path / "e.jsonl").read_text() == ""
    json.dumps(stats)


def odd_app() -> FastAPI:
    """Replies with no answer in them (by the prompt's text), or with the reasoning apart."""
    app = FastAPI()
    done = {"id": "x", "object": "chat.completion", "created": 0, "model": "m"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        kind = (await request.json())["messages"][-1]["content"]
        if kind == "html":
            return PlainTextResponse("<html>bad gateway</html>")
        if kind == "error":
            return {"error": {"message": "overloaded"}}
        message = {"role": "assistant", "content": "ok"}
        if kind == "think":
            message |= {"reasoning_content": "hm", "content": None}
        choices = [] if kind == "none" else [{"index": 0, "finish_reason": "stop",
                                             "message": None if kind == "null" else message}]
        return done | {"choices": choices}

    return app


def test_replies_without_an_answer_fail_the_prompt_not_the_run(target, tmp_path):
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=8)
    asks = [Conversation([{"role": "user", "content": k}]) for k in
            ("html", "error", "none", "null", "fine")]
    with running(odd_app()) as url:
        backend = OpenAIBackend(url, "m", cfg, retries=0)
        out = tmp_path / "o.jsonl"
        stats = regenerate(asks, out, backend, target.tokenizer, cfg, False, lambda s: None)
        assert stats["failed"] == 4 and stats["answered"] == 1
        assert [r["messages"][0]["content"] for r in read_jsonl_tail_safe(out)] == ["fine"]
        think = [Conversation([{"role": "user", "content": "think"}])]
        with pytest.raises(DraftsmithError, match="reasoning apart from its text"):
            regenerate(think, out, backend, target.tokenizer, cfg, False, lambda s: None)
        backend.close()


class Echo:
    """A backend that answers "ok" at once."""

    name = model_name = "echo"

    def answer(self, batch: list) -> list[Answer]:
        return [Answer("ok", 1, "stop") for _ in batch]


class Recorder(Echo):
    """Echo, keeping each prompt it was sent."""

    def __init__(self) -> None:
        self.sent: list = []

    def answer(self, batch: list) -> list[Answer]:
        self.sent += batch
        return super().answer(batch)


def test_a_rerun_by_another_model_or_sampling_is_refused(target, tmp_path):
    """Prompts answered before are skipped: a rerun by another target (or sampling) would have
    passed the first one's answers off as its own."""
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2)
    out = tmp_path / "a.jsonl"
    regenerate(convs()[:2], out, Echo(), target.tokenizer, cfg, False, lambda s: None)
    before = out.read_bytes()
    other = Echo()
    other.model_name = "other-model"
    with pytest.raises(DraftsmithError, match="a.jsonl:1: holds answers by 'echo'.*'other-model'"):
        regenerate(convs(), out, other, target.tokenizer, cfg, False, lambda s: None)
    hotter = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2, temperature=1.0)
    with pytest.raises(DraftsmithError, match="write to another file .regenerate --out, or "
                       "another `data make` folder."):
        regenerate(convs(), out, Echo(), target.tokenizer, hotter, False, lambda s: None)
    assert out.read_bytes() == before
    assert regenerate(convs(), out, Echo(), target.tokenizer, cfg, False,
                      lambda s: None)["done_before"] == 2


def test_every_leading_system_message_is_sent_and_kept(target, tmp_path):
    """Both system prompts count against the limit, so both are sent (only the first was)."""
    lead = [{"role": "system", "content": "be kind"}, {"role": "system", "content": "be brief"}]
    conv = Conversation([*lead, {"role": "user", "content": "first?"},
                         {"role": "assistant", "content": "old"},
                         {"role": "user", "content": "second?"}])
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2)
    rec = Recorder()
    regenerate([conv], tmp_path / "o.jsonl", rec, target.tokenizer, cfg, False, lambda s: None)
    assert rec.sent[0] == [*lead, {"role": "user", "content": "first?"}]
    assert rec.sent[1][:2] == lead and rec.sent[1][-1]["content"] == "second?"
    [out] = read_jsonl_tail_safe(tmp_path / "o.jsonl")
    assert [m["role"] for m in out["messages"]] == ["system", "system", "user", "assistant",
                                                    "user", "assistant"]


def test_settings_are_checked_before_any_work(tmp_path):
    with pytest.raises(DraftsmithError, match="--batch-size must be >= 1, got -1"):
        RegenConfig(batch_size=-1)
    with pytest.raises(DraftsmithError, match="--max-new-tokens 64 leaves no room .* --max-len 8"):
        RegenConfig(max_new_tokens=64, max_len=8)
    out = tmp_path / "o.jsonl"
    with pytest.raises(DraftsmithError, match="--retries must be >= 0, got -1"):
        regenerate_file(convs(), out, RegenConfig(8, 64), str(tmp_path / "no-target"),
                        base_url="http://127.0.0.1:9/v1", retries=-1)
    assert not out.exists()


def test_existing_output_is_read_whole_before_anything_is_cut(target, tmp_path):
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2)
    out = tmp_path / "notes.txt"
    cases = {"line one\nline two": "notes.txt:1: not valid JSON",
             "[1,2]": "notes.txt:1: expected a JSON object, got list",
             '{"prompt": "x"}\n': "notes.txt:1: not an answer `regenerate` wrote"}
    for text, why in cases.items():
        out.write_text(text)
        with pytest.raises(DraftsmithError, match=why):
            regenerate(convs(), out, Echo(), target.tokenizer, cfg, False, lambda s: None)
        assert out.read_text() == text
    # a last record without its newline is kept, and the next one starts a line of its own
    out = tmp_path / "a.jsonl"
    regenerate(convs()[:2], out, Echo(), target.tokenizer, cfg, False, lambda s: None)
    out.write_bytes(out.read_bytes().rstrip(b"\n"))
    stats = regenerate(convs()[:3], out, Echo(), target.tokenizer, cfg, False, lambda s: None)
    assert stats["done_before"] == 2 and stats["answered"] == 1
    ids = [r["meta"]["prompt_id"] for r in read_jsonl_tail_safe(out)]
    assert ids == [c.id for c in convs()[:3]]


def refusing_app(status: dict) -> FastAPI:
    """Answers while status["code"] is 200, then refuses every request with that code."""
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return JSONResponse({"error": {"message": "no"}}, status_code=status["code"])

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        status["calls"] = status.get("calls", 0) + 1
        if status["code"] != 200:
            return JSONResponse({"error": {"message": "no"}}, status_code=status["code"])
        return ok_reply()

    return app


def test_a_bad_key_or_model_stops_the_run_keeping_what_was_written(target, tmp_path):
    """401/403/404 to one request is the same to all: one clear error, not a warning a prompt."""
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2)
    status = {"code": 200}
    out = tmp_path / "a.jsonl"
    with running(refusing_app(status)) as url:
        def run(asks: list[Conversation]) -> None:
            backend = OpenAIBackend(url, "m", cfg, concurrency=1, retries=0)
            try:
                regenerate(asks, out, backend, target.tokenizer, cfg, False, lambda s: None)
            finally:
                backend.close()  # its workers end after a request in flight: wait for that,
                for t in backend.pool.threads:  # or it lands in the next code's count
                    t.join(10)

        run(convs()[:2])
        before = out.read_text()
        for code, fix in ((401, "--api-key"), (403, "--api-key"), (404, "--model")):
            status |= {"code": code, "calls": 0}
            with pytest.raises(DraftsmithError, match=(
                    rf"{url}: HTTP {code} for model 'm'.*{fix}.*keeps the 2 conversations")):
                run(convs())
            assert out.read_text() == before and status["calls"] <= cfg.batch_size
        status["code"] = 401  # and without --model, listing the models says the same
        backend = OpenAIBackend(url, "", cfg)
        with pytest.raises(DraftsmithError, match=r"models \(.*401.*\); check --api-key"):
            server_model(backend.client, url)
        backend.close()


def test_a_reply_without_usage_counts_the_answer_in_target_tokens(target, tmp_path):
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2)
    with running(odd_app()) as url:  # its replies give no `usage`
        backend = OpenAIBackend(url, "m", cfg, retries=0)
        stats = regenerate([Conversation([{"role": "user", "content": "fine"}])],
                           tmp_path / "o.jsonl", backend, target.tokenizer, cfg, False,
                           lambda s: None)
        backend.close()
    want = len(target.tokenizer("ok", add_special_tokens=False)["input_ids"])
    [rec] = read_jsonl_tail_safe(tmp_path / "o.jsonl")
    assert want > 0 and rec["meta"]["answers"][0]["tokens"] == want == stats["answer_tokens"]


def test_a_server_without_target_is_warned_of_the_default_tokenizer(server, target, tmp_path,
                                                                   monkeypatch):
    from draftsmith.data import regenerate as regen

    monkeypatch.setattr(regen, "load_tokenizer", lambda name: target.tokenizer)
    logs: list[str] = []
    regenerate_file(convs()[:1], tmp_path / "d.jsonl", RegenConfig(8, 128), "default",
                    base_url=server[0], model="fake-model", retries=0, log=logs.append)
    assert [m for m in logs if "default target's tokenizer (SmolLM2)" in m]
