"""Regenerate against what vLLM and SGLang send: an answer whose end token is written out in its
text (`skip_special_tokens` off, or an end token the tokenizer does not mark special) is
recorded without it, its ids still the target's, and the next turn is asked with it so."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from test_data_regenerate import running

from draftsmith.data.prompts import Conversation, read_jsonl_tail_safe
from draftsmith.data.regenerate import OpenAIBackend, RegenConfig, regenerate, request_seed

CFG = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2, temperature=0.0)
END = "<|im_end|>"  # the tiny target's ChatML closing marker and eos token


def end_left_in_app(tok: Any, bodies: list[dict], with_ids: bool) -> FastAPI:
    """Answers "said N" (N: the request's count) with the end token written after it, as vLLM
    does with skip_special_tokens off; its ids (vLLM's `token_ids`) end with the end id."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        bodies.append(await request.json())
        text = f"said {len(bodies)}"
        words = tok(text, add_special_tokens=False)["input_ids"]
        ids = words + [tok.convert_tokens_to_ids(END)]
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "stop_reason": None,
                                  "message": {"role": "assistant", "content": text + END}}
        if with_ids:
            choice["token_ids"] = ids
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [choice], "usage": {"prompt_tokens": 9, "completion_tokens": len(ids),
                                                "total_tokens": 9 + len(ids)}}

    return app


def two_turns() -> list[Conversation]:
    return [Conversation([{"role": "user", "content": "a"},
                          {"role": "assistant", "content": "old"},
                          {"role": "user", "content": "b"}], "two")]


def answered(tok: Any, tmp_path, with_ids: bool) -> tuple[dict, list[dict], list[str]]:
    bodies: list[dict] = []
    said: list[str] = []
    with running(end_left_in_app(tok, bodies, with_ids)) as url:
        backend = OpenAIBackend(url, "m", CFG, concurrency=1, retries=0, tokenizer=tok)
        try:
            stats = regenerate(two_turns(), tmp_path / "o.jsonl", backend, tok, CFG, False,
                               said.append)
        finally:
            backend.close()
    assert stats["answered"] == 1 and stats["failed"] == 0
    return read_jsonl_tail_safe(tmp_path / "o.jsonl")[0], bodies, said


def test_an_end_token_written_out_is_not_kept_in_the_answer(target, tmp_path, capsys):
    """The text kept "said 1<|im_end|>", which capture tokenizes as the end id followed by the
    template's own: the drafter learnt a doubled end of turn; the ids were dropped as another
    model's, with a warning saying so."""
    tok = target.tokenizer
    rec, bodies, _ = answered(tok, tmp_path, with_ids=True)
    assert [m["content"] for m in rec["messages"]] == ["a", "said 1", "b", "said 2"]
    words = [tok(f"said {n}", add_special_tokens=False)["input_ids"] for n in (1, 2)]
    assert [a["ids"] for a in rec["meta"]["answers"]] == words
    assert "do not decode" not in capsys.readouterr().err
    # the second turn is asked with the first answer as kept, in order
    assert [m["content"] for m in bodies[1]["messages"]] == ["a", "said 1", "b"]
    assert bodies[1]["seed"] == request_seed(CFG.seed, bodies[1]["messages"])


def test_an_end_token_written_out_without_ids_is_not_kept_either(target, tmp_path):
    rec, _, _ = answered(target.tokenizer, tmp_path, with_ids=False)
    assert [m["content"] for m in rec["messages"]] == ["a", "said 1", "b", "said 2"]
    assert all("ids" not in a for a in rec["meta"]["answers"])
