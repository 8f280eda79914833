"""A strict OpenAI-compatible server (OpenAI's own API, a gateway that forbids fields it does
not know) refused every request for the sampling fields regenerate sends beyond OpenAI's
(`top_k`, `min_p`, `repetition_penalty`): each prompt failed as "refused", nothing was kept and
the run still ended well. Those fields are sent at their "off" values to pin vLLM's and
SGLang's generation_config defaults; a server that refuses them by name is now asked without
them (one note), unless the user set one (--top-k), which stops the run naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from regen_server import EXTRAS, OPENAI, strict_app
from test_data_regenerate import ok_reply, running
from test_regenerate_review4 import asks

from draftsmith.data.regenerate import OpenAIBackend, RegenConfig, regenerate
from draftsmith.errors import DraftsmithError

pytest.importorskip("openai")



def openai_like(bodies: list[dict], status: int = 400) -> FastAPI:
    """Refuses any field outside OpenAI's by name: OpenAI's own wording (400), or a pydantic
    app's extra_forbidden (422)."""
    return strict_app(bodies, OPENAI, "openai" if status == 400 else "pydantic")


def cfg(top_k: int = 0) -> RegenConfig:
    return RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, temperature=0.7,
                       top_k=top_k)


@pytest.mark.parametrize("status", [400, 422])
def test_a_strict_server_is_asked_without_the_sampling_extras(status, capsys) -> None:
    bodies: list[dict] = []
    with running(openai_like(bodies, status)) as url:
        backend = OpenAIBackend(url, "m", cfg(), concurrency=2, retries=0)
        try:
            got = backend.answer([[{"role": "user", "content": f"q{i}"}] for i in range(4)])
        finally:
            backend.close()
    assert [(a.text, a.finish) for a in got] == [("ok", "stop")] * 4
    assert sum(not set(b) - OPENAI for b in bodies) == 4  # each answer asked once without
    assert not set(bodies[-1]) & (EXTRAS | {"return_token_ids"})
    err = capsys.readouterr().err
    assert err.count("min_p, repetition_penalty, top_k") == 1, err


def test_regenerate_keeps_a_strict_servers_answers_and_says_what_it_refused(
        target, tmp_path: Path) -> None:
    bodies: list[dict] = []
    out = tmp_path / "a.jsonl"
    with running(openai_like(bodies)) as url:
        backend = OpenAIBackend(url, "m", cfg(), retries=0)
        try:
            stats = regenerate(asks(3), out, backend, target.tokenizer, cfg(), False,
                               lambda s: None)
        finally:
            backend.close()
    assert stats["answered"] == 3 and stats["failed"] == 0, stats
    answers = [json.loads(line)["meta"]["answers"][0] for line in out.read_text().splitlines()]
    assert all(a["refused"] == ["min_p", "repetition_penalty", "top_k"] for a in answers)


def test_a_top_k_the_server_refuses_stops_the_run_naming_the_flag() -> None:
    bodies: list[dict] = []
    with running(openai_like(bodies)) as url:
        backend = OpenAIBackend(url, "m", cfg(top_k=5), retries=0)
        try:
            with pytest.raises(DraftsmithError) as e:
                backend.answer([[{"role": "user", "content": "q"}]])
        finally:
            backend.close()
    msg = str(e.value)
    assert "\n" not in msg and "top_k" in msg and "drop --top-k 5" in msg, msg


def test_a_lenient_server_still_gets_every_sampling_field() -> None:
    """vLLM and SGLang take top_k, min_p and repetition_penalty: sent at their off values, so
    the model's generation_config.json (Qwen's top_k 20) does not change the sampling."""
    bodies: list[dict] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        bodies.append(await request.json())
        return ok_reply()

    with running(app) as url:
        backend = OpenAIBackend(url, "m", cfg(), retries=0)
        try:
            backend.answer([[{"role": "user", "content": "q"}]])
        finally:
            backend.close()
    assert {k: bodies[0][k] for k in EXTRAS} == {"top_k": -1, "min_p": 0.0,
                                                  "repetition_penalty": 1.0}
