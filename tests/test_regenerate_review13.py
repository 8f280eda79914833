"""Regenerate review 13: `data make` checks a folder's answers by the record regenerate writes,
built in one place (`regenerate.answered_by`), not by hand beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_data_regenerate import ok_reply, running

from draftsmith.data import pipeline
from draftsmith.data import regenerate as R
from draftsmith.data.prompts import Conversation, read_jsonl_tail_safe

CFG = R.RegenConfig(max_new_tokens=4, max_len=64, batch_size=2, temperature=0.7, seed=3)


def checked_info(monkeypatch: pytest.MonkeyPatch, answers: Path, target: Any,
                 cfg: R.RegenConfig) -> dict[str, Any]:
    """The record `pipeline._same_answers` checks an engine folder's answers against."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(R, "_same_answerer", lambda out, records, info: seen.append(info))
    pipeline._same_answers(answers, target, cfg, None)
    assert len(seen) == 1
    return seen[0]


@pytest.fixture(scope="module")
def engine_answers(target, model, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """An engine run's answers file and its answerer record (`regenerate.answerer`)."""
    out = tmp_path_factory.mktemp("r13") / "answers.jsonl"
    backend = R.EngineBackend(target, model, CFG)
    convs = [Conversation([{"role": "user", "content": f"q{i}"}]) for i in range(3)]
    R.regenerate(convs, out, backend, target.tokenizer, CFG, False, lambda s: None)
    return out, R.answerer(backend, CFG)


def test_data_makes_check_is_the_recorded_answerer_less_the_engines_runtime(
        engine_answers, target, monkeypatch) -> None:
    """Byte for byte: the answers' own record, less the engine's batching and numerics."""
    out, full = engine_answers
    info = checked_info(monkeypatch, out, target, CFG)
    less = {k: v for k, v in full.items() if k not in R.ENGINE}
    assert json.dumps(info) == json.dumps(less)
    assert json.dumps(info) == json.dumps({"backend": "engine", "model": target.source,
                                           "sampling": CFG.sampling(),
                                           "target": target.fingerprint})
    recorded = read_jsonl_tail_safe(out)[0]["meta"]["answers"][0]
    assert json.dumps({k: recorded[k] for k in info}) == json.dumps(info)
    assert {k: recorded[k] for k in R.ENGINE} == {k: full[k] for k in R.ENGINE}


def test_a_field_added_to_the_answerers_base_is_checked_by_data_make_too(
        engine_answers, target, model, monkeypatch) -> None:
    """The engine's record was built by hand in pipeline: a field added to answerer's base
    reached the answers but not `data make`'s check of them."""
    out, _ = engine_answers
    base = R.answered_by
    monkeypatch.setattr(R, "answered_by", lambda *a, **k: base(*a, **k) | {"new": 1})
    full = R.answerer(R.EngineBackend(target, model, CFG), CFG)
    info = checked_info(monkeypatch, out, target, CFG)
    assert full["new"] == 1 and info == {k: v for k, v in full.items() if k not in R.ENGINE}


def cut_mid_character_app(cuts: int) -> Any:
    """A server whose first `cuts` replies are cut short inside a character's UTF-8 bytes (a
    proxy or a crashing server; Starlette and vLLM write JSON unescaped), then whole."""
    from fastapi import FastAPI
    from fastapi.responses import Response

    app, sent = FastAPI(), [0]

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        body = json.dumps(ok_reply() | {"choices": [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "ça va"}}]},
            ensure_ascii=False).encode()
        sent[0] += 1
        if sent[0] <= cuts:
            body = body[: body.index("ç".encode()) + 1]
        return Response(body, media_type="application/json")

    return app


@pytest.mark.parametrize("retries", [0, 1])
def test_a_reply_cut_inside_a_character_is_retried_not_a_traceback(target, tmp_path,
                                                                   retries) -> None:
    """Its body failed to decode as UTF-8 (UnicodeDecodeError, not JSONDecodeError), which
    escaped the worker and ended the run with a traceback; now it is retried as any reply that
    is not JSON, and after the last retry a failed answer a rerun asks again."""
    cfg = R.RegenConfig(max_new_tokens=8, max_len=128, batch_size=1, temperature=0.0)
    out, lines = tmp_path / "a.jsonl", []
    with running(cut_mid_character_app(cuts=1)) as url:
        backend = R.OpenAIBackend(url, "m", cfg, concurrency=1, retries=retries, backoff=0.01)
        try:
            stats = R.regenerate([Conversation([{"role": "user", "content": "q"}])], out,
                                 backend, target.tokenizer, cfg, False, lines.append)
        finally:
            backend.close()
    assert (stats["answered"], stats["failed"]) == (retries, 1 - retries)
    if retries:
        assert read_jsonl_tail_safe(out)[0]["messages"][-1]["content"] == "ça va"


def test_a_served_stop_on_the_last_allowed_token_is_recorded_as_the_engine_records_it(
        target) -> None:
    """vLLM, SGLang, TGI and `draftsmith serve` say finish_reason: an end token sampled as
    the max_tokens-th token is "stop", its ids and count without it, as the engine's answer of
    max_tokens - 1 tokens; only a reply with no finish reason is read by its count alone."""
    from types import SimpleNamespace

    tok = target.tokenizer
    words = tok("a cat sat", add_special_tokens=False)["input_ids"]
    most, eos = len(words) + 1, target.eos_ids[0]
    msg = SimpleNamespace(content="a cat sat", tool_calls=None)
    r = SimpleNamespace(model="m", usage=SimpleNamespace(completion_tokens=most),
                        choices=[SimpleNamespace(message=msg, finish_reason="stop",
                                                 token_ids=[*words, eos])])
    got = R.reply(r, "m", tok, most)
    assert (got.finish, got.ids, got.tokens) == ("stop", words, most - 1)
