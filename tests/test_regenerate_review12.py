"""A server's answers counted as the engine counts its own: vLLM, SGLang and `draftsmith serve`
count the end token that stopped an answer in `usage.completion_tokens` while its text leaves it
out; the engine's count (its decoded ids, stop id excluded) does not."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, Request
from test_data_regenerate import running

from draftsmith.data.prompts import Conversation, read_jsonl_tail_safe
from draftsmith.data.regenerate import EngineBackend, OpenAIBackend, RegenConfig, regenerate

CFG = RegenConfig(max_new_tokens=10, max_len=128, batch_size=2, temperature=0.0)


def engine_app(target: Any, model: Any, with_ids: bool) -> FastAPI:
    """The target's greedy answers served as vLLM serves them: the text without the end token,
    `completion_tokens` (and `token_ids`) with it."""
    from draftsmith.engine.generate import generate

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        prompt = target.chat_ids(body["messages"], True)
        ids = generate(model, [prompt], body["max_tokens"], eos_ids=target.eos_ids)[0]
        cut = len(ids) >= body["max_tokens"]
        said = ids if cut else [*ids, target.tokenizer.eos_token_id]  # its end, special
        choice: dict[str, Any] = {
            "index": 0, "finish_reason": "length" if cut else "stop",
            "message": {"role": "assistant", "content": target.tokenizer.decode(
                ids, skip_special_tokens=True).strip()}}
        if with_ids:
            choice["token_ids"] = said
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [choice], "usage": {"prompt_tokens": len(prompt),
                                                "completion_tokens": len(said),
                                                "total_tokens": len(prompt) + len(said)}}

    return app


def asks() -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"say {w}"}], f"p{i}")
            for i, w in enumerate(["hi", "a long story about cats", "ok", "nothing"])]


def counts(path) -> list[list[int]]:
    return [[a["tokens"] for a in r["meta"]["answers"]] for r in read_jsonl_tail_safe(path)]


@pytest.fixture(params=["stop", "length"])
def ending(request, target, monkeypatch) -> str:
    """How the tiny target's greedy answers end: its random weights write one token over and
    over, made its end token for "stop" (each answer ends at once)."""
    if request.param == "stop":
        monkeypatch.setattr(target, "generation_eos", [*target.generation_eos, 24])
    return request.param


@pytest.mark.parametrize("with_ids", [True, False])
def test_a_servers_answer_tokens_leave_out_its_stop_token_as_the_engines_do(
        target, model, ending, tmp_path, with_ids):
    tok = target.tokenizer
    mine = regenerate(asks(), tmp_path / "e.jsonl", EngineBackend(target, model, CFG), tok, CFG,
                      False, lambda s: None)
    with running(engine_app(target, model, with_ids)) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=1, retries=0, tokenizer=tok)
        try:
            theirs = regenerate(asks(), tmp_path / "s.jsonl", backend, tok, CFG, False,
                                lambda s: None)
        finally:
            backend.close()
    assert theirs["answered"] == mine["answered"] == 4
    finishes = {a["finish"] for r in read_jsonl_tail_safe(tmp_path / "e.jsonl")
                for a in r["meta"]["answers"]}
    assert finishes == {ending}
    assert counts(tmp_path / "s.jsonl") == counts(tmp_path / "e.jsonl")
    assert theirs["answer_tokens"] == mine["answer_tokens"]
    assert theirs["answers_at_max_new"] == mine["answers_at_max_new"]


def words_app(tok: Any, with_ids: bool) -> FastAPI:
    """Answers "said N ..." (N: the request's count) stopped by the eos, counted in
    `completion_tokens` and ending `token_ids`, as vLLM and SGLang count it."""
    app = FastAPI()
    seen: list[int] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.json()
        seen.append(1)
        text = "said " + " ".join(["cats"] * len(seen))
        ids = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": text}}
        if with_ids:
            choice["token_ids"] = ids
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [choice], "usage": {"prompt_tokens": 9, "completion_tokens": len(ids),
                                                "total_tokens": 9 + len(ids)}}

    return app


@pytest.mark.parametrize("with_ids", [True, False])
def test_an_answer_stopped_after_its_words_counts_its_words(target, tmp_path, with_ids):
    tok = target.tokenizer
    said: list[str] = []
    with running(words_app(tok, with_ids)) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=1, retries=0, tokenizer=tok)
        try:
            stats = regenerate(asks()[:3], tmp_path / "w.jsonl", backend, tok, CFG, False,
                               said.append)
        finally:
            backend.close()
    recs = read_jsonl_tail_safe(tmp_path / "w.jsonl")
    want = [len(tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"])
            for r in recs]
    assert [a["tokens"] for r in recs for a in r["meta"]["answers"]] == want
    if with_ids:
        assert [len(a["ids"]) for r in recs for a in r["meta"]["answers"]] == want
    assert stats["answer_tokens"] == sum(want) and f"answer_tokens {sum(want)}" in said[-1]


def test_served_ids_count_the_answer_where_no_usage_comes(target):
    """A reply with the target's ids but no `usage` counted by them (the engine's count), not
    by its text tokenized again."""
    from openai.types.chat import ChatCompletion

    from draftsmith.data.regenerate import reply

    tok = target.tokenizer
    words = tok("a cat sat", add_special_tokens=False)["input_ids"]
    r = ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [*words, tok.eos_token_id],
                     "message": {"role": "assistant", "content": "a cat sat"}}]})
    got = reply(r, "m", tok)
    assert (got.tokens, got.ids) == (len(words), words)


def odd_message_app() -> FastAPI:
    """Answers "ok", but a prompt saying "odd" with a message that is bare text, not an
    object: the openai client passes it on unchecked."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        odd = "odd" in body["messages"][-1]["content"]
        message: Any = "ok" if odd else {"role": "assistant", "content": "ok"}
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop", "message": message}]}

    return app


def test_a_reply_whose_message_is_no_object_fails_its_prompt_not_the_run(target, tmp_path):
    """It raised AttributeError in the request's worker: the run ended in a traceback, the
    answers finished but not yet written lost."""
    tok = target.tokenizer
    convs = [Conversation([{"role": "user", "content": t}], t) for t in ("a", "odd", "b")]
    with running(odd_message_app()) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=2, retries=0, tokenizer=tok)
        try:
            stats = regenerate(convs, tmp_path / "m.jsonl", backend, tok, CFG, False,
                               lambda s: None)
        finally:
            backend.close()
    assert (stats["answered"], stats["failed"]) == (2, 1)
    assert [r["meta"]["prompt_id"] for r in read_jsonl_tail_safe(tmp_path / "m.jsonl")] == [
        "a", "b"]
