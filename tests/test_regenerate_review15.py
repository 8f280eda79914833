"""Regenerate review 15: MT-bench's user turns answered in order with the earlier answers in
context (engine and server), a resumed multi-turn run equal to an uninterrupted one, and a later
turn a server refuses as past its context ending the conversation there, as regenerate's own
count does, not losing the turns answered before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_data_regenerate import running

from draftsmith.data.prompts import Conversation, parse_record, read_jsonl_tail_safe
from draftsmith.data.regenerate import EngineBackend, OpenAIBackend, RegenConfig, regenerate

CFG = RegenConfig(max_new_tokens=5, max_len=256, batch_size=2, temperature=0.0)


def questions(n: int = 3) -> list[Conversation]:
    """MT-bench question records: user turns, no answers."""
    return [parse_record({"turns": [f"first {i}?", f"second {i}?", f"third {i}?"]})
            for i in range(n)]


def quiet(_: str) -> None:
    pass


def echo_app(seen: list[Any], refuse_after: int | None = None) -> FastAPI:
    """Answers "re: LAST n" (n: the messages sent); past `refuse_after` user turns, vLLM's 400
    for a request past its context."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        msgs = (await request.json())["messages"]
        seen.append(msgs)
        if refuse_after is not None and sum(m["role"] == "user" for m in msgs) > refuse_after:
            said = ("This model's maximum context length is 4096 tokens. However, you "
                    "requested 4100 tokens (4095 in the messages, 5 in the completion).")
            return JSONResponse({"object": "error", "message": said, "type": "BadRequestError",
                                 "param": None, "code": 400}, status_code=400)
        text = f"re: {msgs[-1]['content']} {len(msgs)}"
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}

    return app


def served(app: FastAPI, convs: list[Conversation], out: Path, tok: Any,
           cfg: RegenConfig = CFG) -> dict[str, int]:
    with running(app) as url:
        backend = OpenAIBackend(url, "m", cfg, concurrency=2, retries=0, tokenizer=tok)
        try:
            return regenerate(convs, out, backend, tok, cfg, False, quiet)
        finally:
            backend.close()


def test_the_engine_answers_each_user_turn_after_the_answers_before(target, model, tmp_path):
    from draftsmith.engine.generate import generate

    out = tmp_path / "a.jsonl"
    regenerate(questions(), out, EngineBackend(target, model, CFG), target.tokenizer, CFG,
               False, quiet)
    recs = read_jsonl_tail_safe(out)
    assert len(recs) == 3
    for r in recs:
        msgs = r["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * 3
        assert [a["turn"] for a in r["meta"]["answers"]] == [0, 1, 2]
        for k in (1, 3, 5):  # greedy: the target's own continuation of all that came before
            want = generate(model, [target.chat_ids(msgs[:k], True)], 5,
                            eos_ids=target.eos_ids)[0]
            assert msgs[k]["content"] == target.tokenizer.decode(
                want, skip_special_tokens=True).strip()


def test_a_server_is_asked_each_user_turn_after_the_answers_before(target, tmp_path):
    seen: list[Any] = []
    out = tmp_path / "s.jsonl"
    served(echo_app(seen), questions(), out, target.tokenizer)
    for r in read_jsonl_tail_safe(out):
        msgs = r["messages"]
        assert [m["content"] for m in msgs[1::2]] == [
            f"re: {msgs[0]['content']} 1", f"re: {msgs[2]['content']} 3",
            f"re: {msgs[4]['content']} 5"]
        assert msgs[:-1] in seen and msgs[:3] in seen and msgs[:1] in seen


@pytest.mark.parametrize("refill", [True, False])
def test_a_sampled_multi_turn_run_killed_mid_write_resumes_as_it_ran(target, model, tmp_path,
                                                                      refill):
    convs = [parse_record({"turns": [f"q{i} a?"] + [f"q{i} b?"] * (i % 3 > 0)})
             for i in range(12)]
    cfg = RegenConfig(max_new_tokens=5, max_len=256, batch_size=1, temperature=0.9,
                      refill=refill)
    backend = EngineBackend(target, model, cfg)
    whole, part = tmp_path / "w.jsonl", tmp_path / "p.jsonl"
    regenerate(convs, whole, backend, target.tokenizer, cfg, False, quiet)
    lines = whole.read_bytes().split(b"\n")
    part.write_bytes(b"\n".join(lines[:9]) + b"\n" + lines[9][:30])  # killed in a write
    regenerate(convs, part, backend, target.tokenizer, cfg, False, quiet)
    assert part.read_bytes() == whole.read_bytes()


def test_a_later_turn_a_server_refuses_as_past_its_context_ends_the_conversation(target,
                                                                                tmp_path):
    """vLLM counts a later turn past its context (another tokenizer's count, a default system
    prompt): the turns answered before were dropped with the conversation, asked again by
    every rerun and refused alike, where regenerate's own count ends it there (`turns_cut`)."""
    out = tmp_path / "c.jsonl"
    stats = served(echo_app([], refuse_after=2), questions(2), out, target.tokenizer)
    recs = read_jsonl_tail_safe(out)
    assert [len(r["meta"]["answers"]) for r in recs] == [2, 2]
    assert [m["role"] for m in recs[0]["messages"]] == ["user", "assistant"] * 2
    assert stats["failed"] == 0 and stats["turns_cut"] == 2 and stats["answered"] == 2
    # a first turn refused so is still a failed prompt, refused by the server
    stats = served(echo_app([], refuse_after=0), questions(1), tmp_path / "f.jsonl",
                   target.tokenizer)
    assert stats["failed"] == 1 and stats["refused_by_server"] == 1
