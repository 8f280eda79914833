"""Regenerate review 14: a server's error is told in one line, a --model the server does not
list is said (SGLang answers any name, echoing it), and a server that answered only errors
was still reached."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_data_regenerate import ok_reply, running

from draftsmith.data import regenerate as R
from draftsmith.data.prompts import Conversation

CFG = R.RegenConfig(max_new_tokens=4, max_len=64, batch_size=2, temperature=0.0)
# vLLM's 400 for a request pydantic refuses: its ValidationError's text, several lines
VALIDATION = ("1 validation error for ChatCompletionRequest\n  Value error, bad request "
              "[type=value_error, input_value={'messages': ...}, input_type=dict]\n    For "
              "further information visit https://errors.pydantic.dev/2.9/v/value_error\n")


def erring_app(status: int, message: str) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        return JSONResponse({"object": "error", "message": message, "type": "BadRequestError",
                             "code": status}, status_code=status)

    return app


@pytest.mark.parametrize("status", [400, 500])
def test_a_servers_error_of_many_lines_is_one_line(status: int) -> None:
    """Its message went into the prompt's warning as it came: 40 lines, 4,000 characters."""
    with running(erring_app(status, VALIDATION * 20)) as url:
        backend = R.OpenAIBackend(url, "m", CFG, concurrency=1, retries=1, backoff=0.01)
        try:
            got = backend.one([{"role": "user", "content": "hi"}])
        finally:
            backend.close()
    assert got.finish.startswith("error: ") and "1 validation error for" in got.finish
    assert "\n" not in got.finish and "\r" not in got.finish, got.finish
    assert len(got.finish) <= 400, len(got.finish)


def echoing_app(served: str) -> FastAPI:
    """SGLang's Python route: lists the model it serves, answers any name, echoing it."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0,
                                            "owned_by": "x"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        return ok_reply() | {"model": (await request.json())["model"]}

    return app


def test_a_model_the_server_does_not_list_is_said(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """`data regenerate --model` was never checked against the server's models: SGLang
    answered with its own model and the answers were recorded as --model's."""
    convs = [Conversation([{"role": "user", "content": "q"}])]
    said: dict[str, list[str]] = {}
    with running(echoing_app("served/model")) as url:
        for model in ("other/model", "served/model"):
            logs: list[str] = []
            stats = R.regenerate_file(convs, tmp_path / f"{model[:5]}.jsonl", CFG,
                                      str(tiny_llama_dir), base_url=url, model=model,
                                      retries=0, log=logs.append)
            assert stats["answered"] == 1
            said[model] = [s for s in logs if "not --model" in s]
    assert said["served/model"] == [], said
    [line] = said["other/model"]
    assert line.startswith(f"regenerate: warning: {url} lists ['served/model'], not --model "
                           "'other/model'"), line
    assert "\n" not in line


def test_a_server_that_answered_only_errors_was_reached() -> None:
    """A 5xx or 429 is an answer: once the server went down after them, the run said no server
    had ever answered at the URL (is it running, with its /v1?)."""
    with running(erring_app(503, "overloaded")) as url:
        backend = R.OpenAIBackend(url, "m", CFG, concurrency=1, retries=0)
        try:
            got = backend.one([{"role": "user", "content": "hi"}])
        finally:
            backend.close()
    assert got.finish.startswith("error: ") and backend.reached
    assert "stopped answering" in R.gone(backend, 2, 3)
