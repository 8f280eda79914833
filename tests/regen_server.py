"""A fake OpenAI-compatible server that refuses, by name, the request fields it does not know,
worded as a strict server words it: shared by the regenerate tests of such servers."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_data_regenerate import ok_reply

# OpenAI's own chat fields, as regenerate sends them; vLLM and SGLang also take EXTRAS
OPENAI = {"model", "messages", "max_tokens", "temperature", "top_p", "seed", "presence_penalty",
          "frequency_penalty"}
EXTRAS = {"top_k", "min_p", "repetition_penalty"}


def _vllm(extra: list[str]) -> JSONResponse:
    """vLLM 0.6.4's 400: pydantic's extra_forbidden detail in an error object's message."""
    return JSONResponse({"object": "error", "message": str(_detail(extra)),
                         "type": "BadRequestError", "code": 400}, status_code=400)


def _openai(extra: list[str]) -> JSONResponse:
    """OpenAI's own API's 400."""
    return JSONResponse({"error": {
        "message": f"Unrecognized request arguments supplied: {', '.join(extra)}",
        "type": "invalid_request_error", "param": None, "code": None}}, status_code=400)


def _pydantic(extra: list[str]) -> JSONResponse:
    """A pydantic app's 422 (NIM-like servers, gateways)."""
    return JSONResponse({"detail": _detail(extra)}, status_code=422)


def _detail(extra: list[str]) -> list[dict]:
    return [{"type": "extra_forbidden", "loc": ["body", k], "msg": "Extra inputs are not permitted"}
            for k in extra]


WORDINGS = {"vllm": _vllm, "openai": _openai, "pydantic": _pydantic}


def strict_app(bodies: list[dict], known: set[str], wording: str) -> FastAPI:
    """Appends each request body to `bodies`; refuses one with a field outside `known` in the
    `WORDINGS` named, else answers "ok"."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        bodies.append(body)
        extra = sorted(set(body) - known)
        return WORDINGS[wording](extra) if extra else ok_reply()

    return app
