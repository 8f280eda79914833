"""A server that forbids fields it does not know (vLLM before 0.6.5: pydantic's extra_forbidden
400; NIM-like servers: a 422) refused every request once regenerate asked `return_token_ids`:
the run kept nothing. Regenerate drops the field on such a refusal and asks again."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from regen_server import EXTRAS, OPENAI
from regen_server import strict_app as shared_strict_app
from test_data_regenerate import ok_reply, running

from draftsmith.data.regenerate import OpenAIBackend, RegenConfig

KNOWN = OPENAI | EXTRAS
WORDING = {400: "vllm", 422: "pydantic"}


def strict_app(bodies: list[dict], status: int) -> FastAPI:
    """A server refusing unknown fields by name, as vLLM 0.6.4's protocol did."""
    return shared_strict_app(bodies, KNOWN, WORDING[status])


def answers(url: str, n: int, concurrency: int = 1) -> list:
    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, temperature=0.0)
    backend = OpenAIBackend(url, "m", cfg, concurrency=concurrency, retries=0)
    try:
        return backend.answer([[{"role": "user", "content": f"q{i}"}] for i in range(n)])
    finally:
        backend.close()


def test_a_server_refusing_return_token_ids_still_answers(capsys) -> None:
    for status in (400, 422):
        bodies: list[dict] = []
        with running(strict_app(bodies, status)) as url:
            got = answers(url, 3)
        assert [(a.text, a.finish, a.ids) for a in got] == [("ok", "stop", None)] * 3
        # asked once with the field, then never again: one request more than answers
        assert ["return_token_ids" in b for b in bodies] == [True, False, False, False]
        err = capsys.readouterr().err
        assert err.count("refuses return_token_ids") == 1, err


def test_requests_in_flight_together_all_ask_again(capsys) -> None:
    bodies: list[dict] = []
    with running(strict_app(bodies, 400)) as url:
        got = answers(url, 6, concurrency=3)
    assert [a.text for a in got] == ["ok"] * 6
    assert sum("return_token_ids" not in b for b in bodies) == 6
    assert capsys.readouterr().err.count("refuses return_token_ids") == 1


def test_another_refusal_is_still_a_failed_answer() -> None:
    bodies: list[dict] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        bodies.append(await request.json())
        return JSONResponse({"object": "error", "message": "prompt too long", "code": 400},
                            status_code=400)

    with running(app) as url:
        got = answers(url, 1)
    assert got[0].finish.startswith("error: HTTP 400") and len(bodies) == 1
    assert bodies[0]["return_token_ids"] is True


def test_an_error_echoing_the_request_keeps_the_ids_asked(capsys) -> None:
    """vLLM's validation errors echo the request body, return_token_ids included: such a 400
    turned the ids off for the whole run, with a false note."""
    bodies: list[dict] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        bodies.append(body)
        if len(bodies) == 1:
            return JSONResponse({"object": "error", "code": 400, "message": (
                "1 validation error: max_tokens too large [type=value_error, input_value="
                f"{body!r}]")}, status_code=400)
        return ok_reply()

    with running(app) as url:
        got = answers(url, 2)
    assert got[0].finish.startswith("error: HTTP 400") and got[1].text == "ok"
    assert all("return_token_ids" in b for b in bodies)
    assert "refuses return_token_ids" not in capsys.readouterr().err


def test_a_prompt_the_server_refuses_every_time_does_not_fail_the_run(tmp_path,
                                                                      capsys) -> None:
    """A 400 a rerun gets again (vLLM's prompt + max_tokens past --max-model-len) made
    `data regenerate` exit 2 on every rerun and `data make --base-url` never reach capture."""
    from typer.testing import CliRunner

    from draftsmith.data.cli import app as data_app

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if "too long" in body["messages"][-1]["content"]:
            return JSONResponse({"object": "error", "code": 400, "message": "context length "
                                 "exceeded"}, status_code=400)
        return ok_reply()

    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": "user", "content": "too long" if i == 1 else f"q{i}"}]}) + "\n"
        for i in range(3)))
    with running(app) as url:
        res = CliRunner().invoke(data_app, ["regenerate", str(src), "-o", str(tmp_path / "a"),
                                            "--base-url", url, "--model", "m", "--retries", "0"])
    assert res.exit_code == 0, res.output
    assert "failed 1, of them refused (a rerun gets the same) 1" in " ".join(res.output.split())
    assert len((tmp_path / "a").read_text().splitlines()) == 2
