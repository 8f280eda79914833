"""Regenerate leftovers: a later turn's error in window mode names what the file keeps, as chunk
mode's does; a reply without a finish reason is not recorded as a clean stop."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI, Request
from test_data_regenerate import Echo, ok_reply, running

from draftsmith.data.prompts import Conversation, read_jsonl_tail_safe
from draftsmith.data.regenerate import OpenAIBackend, RegenConfig, closing_line, regenerate, reply
from draftsmith.errors import DraftsmithError

CFG = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2, temperature=0.0)


class NoSecondTurn:
    """The target's tokenizer with a chat template that refuses any conversation holding an
    answer: a first prompt renders, a later turn does not."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.tok(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def apply_chat_template(self, msgs: list[dict], **kw: Any) -> Any:
        if any(m["role"] == "assistant" for m in msgs):
            raise ValueError("no second turn")
        return self.tok.apply_chat_template(msgs, **kw)


def two_chunks() -> list[Conversation]:
    """A first chunk of two one-turn conversations, then one of two turns."""
    one = [Conversation([{"role": "user", "content": f"q{i}"}]) for i in range(2)]
    return [*one, Conversation([{"role": "user", "content": "a"},
                                {"role": "assistant", "content": "old"},
                                {"role": "user", "content": "b"}])]


def later_turn_error(backend: Any, tok: Any, out) -> str:
    with pytest.raises(DraftsmithError) as e:
        regenerate(two_chunks(), out, backend, NoSecondTurn(tok), CFG, False, lambda s: None)
    return str(e.value)


def test_a_later_turns_error_in_window_mode_names_what_the_file_keeps(target, tmp_path):
    """Chunk mode's error ends "(OUT keeps the 2 conversations answered before; ...)"; the
    window's had no such ending."""
    chunked = later_turn_error(Echo(), target.tokenizer, tmp_path / "c.jsonl")
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return ok_reply()

    with running(app) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=1, retries=0)
        try:
            windowed = later_turn_error(backend, target.tokenizer, tmp_path / "w.jsonl")
        finally:
            backend.close()
    assert "chat template failed" in windowed
    assert len(read_jsonl_tail_safe(tmp_path / "w.jsonl")) == 2
    kept = "keeps the 2 conversations answered before; a rerun resumes after them)"
    assert chunked.endswith(f"c.jsonl {kept}"), chunked
    assert windowed.endswith(f"w.jsonl {kept}"), windowed


def finishing_app() -> FastAPI:
    """Answers by the prompt: "null" with finish_reason null, "absent" with none at all and all
    its max_tokens used, "ok" with "stop"."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        kind = body["messages"][-1]["content"]
        out = ok_reply()
        choice = out["choices"][0]
        if kind == "null":
            choice["finish_reason"] = None
        if kind == "absent":
            del choice["finish_reason"]
            out["usage"]["completion_tokens"] = body["max_tokens"]
        return out

    return app


def test_a_reply_without_a_finish_reason_is_not_a_clean_stop(target, tmp_path):
    """Both were recorded "stop": capture trained the end of turn after an answer the server
    may have cut at max_tokens."""
    asks = [Conversation([{"role": "user", "content": k}]) for k in ("null", "absent", "ok")]
    out, lines = tmp_path / "f.jsonl", []
    with running(finishing_app()) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=1, retries=0)
        try:
            stats = regenerate(asks, out, backend, target.tokenizer, CFG, False, lines.append)
        finally:
            backend.close()
    finish = {r["messages"][0]["content"]: r["meta"]["answers"][0]["finish"]
              for r in read_jsonl_tail_safe(out)}
    assert finish == {"null": "unknown", "absent": "length", "ok": "stop"}
    assert stats["answers_at_max_new"] == 1 and stats["finish_unknown"] == 1
    assert "answers without a finish reason 1" in lines[-1]


def test_a_missing_finish_reason_keeps_the_stop_token_off_the_ids(target):
    """A short answer that ended on a special token ended there: its ids are the engine's,
    without it, as for "stop"; a full one is "length" whatever its last token."""
    tok = target.tokenizer
    words = tok("a cat sat", add_special_tokens=False)["input_ids"]
    eos = target.eos_ids[0]

    def completion(ids: list[int], used: int) -> SimpleNamespace:
        msg = SimpleNamespace(content="a cat sat", tool_calls=None)
        return SimpleNamespace(model="m", usage=SimpleNamespace(completion_tokens=used),
                               choices=[SimpleNamespace(message=msg, finish_reason=None,
                                                        token_ids=ids)])

    short = reply(completion(words + [eos], len(words) + 1), "m", tok, len(words) + 5)
    assert (short.finish, short.ids) == ("unknown", words)
    full = reply(completion(words, len(words)), "m", tok, len(words))
    assert (full.finish, full.ids) == ("length", words)
    assert reply(completion(words, len(words)), "m", tok).finish == "unknown"


def test_the_closing_line_names_unknown_finishes_only_where_some_came() -> None:
    clean = {"answered": 3, "answers_at_max_new": 0, "finish_unknown": 0}
    assert closing_line(clean) == "regenerate: answered 3, answered ones cut at " \
                                  "--max-new-tokens 0"
    assert closing_line({**clean, "finish_unknown": 2}).endswith(
        ", answers without a finish reason 2")
