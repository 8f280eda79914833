"""A server's context shorter than the run's --max-len or --max-new-tokens (vLLM's
--max-model-len, SGLang's --context-length): each request past it is a 400 naming the limit,
which was counted as one prompt the server refuses, every prompt asked and warned in turn and
the run ending well with nothing kept. It now stops at the first such refusal with the flag
to change."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai.types.chat import ChatCompletion
from test_data_regenerate import ok_reply, running
from test_regenerate_review4 import asks

from draftsmith.data.regenerate import OpenAIBackend, RegenConfig, regenerate, reply, served_ids
from draftsmith.errors import DraftsmithError

pytest.importorskip("openai")

# how servers refuse a request past the model's context, by their own words
SAYS = {
    "vllm": lambda n: f"This model's maximum context length is {n} tokens. However, you "
                      f"requested {n + 20} tokens (20 in the messages, {n} in the completion).",
    "sglang": lambda n: f"Requested token count exceeds the model's maximum context length of "
                        f"{n} tokens. You requested a total of {n + 20} tokens.",
    "sglang-input": lambda n: f"Input length (20 tokens) exceeds the maximum allowed length "
                              f"({n} tokens). Use a shorter input or enable "
                              "--allow-auto-truncate.",
    "vllm-prompt": lambda n: f"The decoder prompt (length 20) is longer than the maximum model "
                             f"length of {n}.",
    "tgi": lambda n: f"`inputs` tokens + `max_new_tokens` must be <= {n}. Given: 20 `inputs` "
                     "tokens and 30 `max_new_tokens`",
}


def short_app(calls: list[dict], context: int, says: str, prompt: int) -> FastAPI:
    """A server of `context` tokens that counts `prompt` tokens in every prompt."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        calls.append(body)
        if prompt + body["max_tokens"] > context:
            return JSONResponse({"object": "error", "type": "BadRequestError", "code": 400,
                                 "message": SAYS[says](context)}, status_code=400)
        return ok_reply()

    return app


def run(target, out: Path, cfg: RegenConfig, calls: list[dict], context: int,
        says: str = "vllm", prompt: int = 20) -> dict[str, int]:
    with running(short_app(calls, context, says, prompt)) as url:
        backend = OpenAIBackend(url, "m", cfg, concurrency=2, retries=0)
        try:
            return regenerate(asks(6), out, backend, target.tokenizer, cfg, False, lambda s: None)
        finally:
            backend.close()


@pytest.mark.parametrize("says", list(SAYS))
def test_max_new_tokens_past_the_servers_context_stops_the_run(target, tmp_path: Path,
                                                               says: str) -> None:
    cfg = RegenConfig(max_new_tokens=40, max_len=64, batch_size=2, temperature=0.0)
    calls: list[dict] = []
    with pytest.raises(DraftsmithError) as e:
        run(target, tmp_path / "a.jsonl", cfg, calls, context=32, says=says)
    msg = str(e.value)
    assert "\n" not in msg and "context of 32 tokens" in msg, msg
    assert "lower --max-new-tokens 40" in msg, msg
    assert len(calls) <= 2  # the first chunk's: no later one asked


def test_a_max_len_past_the_servers_context_stops_the_run_naming_it(target,
                                                                     tmp_path: Path) -> None:
    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, temperature=0.0)
    calls: list[dict] = []
    with pytest.raises(DraftsmithError) as e:
        run(target, tmp_path / "a.jsonl", cfg, calls, context=24)
    msg = str(e.value)
    assert "\n" not in msg and "context of 24 tokens" in msg and "--max-len 24" in msg, msg
    assert len(calls) <= 2


def test_within_the_context_the_same_refusal_is_one_prompts(target, tmp_path: Path) -> None:
    """A server counting more tokens than the target's tokenizer (another model's) refuses a
    prompt within --max-len: that prompt fails, the run goes on."""
    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, temperature=0.0)
    calls: list[dict] = []
    stats = run(target, tmp_path / "a.jsonl", cfg, calls, context=80, prompt=100)
    assert len(calls) == 6 and stats["refused_by_server"] == 6, stats


def test_a_run_stopped_by_an_error_closes_its_bar(target, tmp_path: Path, monkeypatch,
                                                   capsys) -> None:
    """On a terminal the bar was left open: the error `data regenerate` prints next ran on
    from the bar's line."""
    from draftsmith.data import progress

    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    calls: list[dict] = []
    cfg = RegenConfig(max_new_tokens=40, max_len=64, batch_size=2, temperature=0.0)
    with running(short_app(calls, 32, "vllm", 20)) as url:
        backend = OpenAIBackend(url, "m", cfg, concurrency=2, retries=0)
        try:
            with pytest.raises(DraftsmithError):
                regenerate(asks(6), tmp_path / "a.jsonl", backend, target.tokenizer, cfg, True,
                           lambda s: None)
        finally:
            backend.close()
    err = capsys.readouterr().err
    assert "regenerate:" in err and err.endswith("\n"), repr(err[-200:])


@pytest.mark.parametrize("cleans", [True, False])
def test_the_targets_own_ids_are_kept_where_its_decode_cleans_spaces(target, monkeypatch,
                                                                     cleans: bool) -> None:
    """Llama 3's tokenizer config sets clean_up_tokenization_spaces, so its decode drops the
    space before `.`, `'s`...; vLLM's detokenizer keeps it: an answer holding `x = 's'` or
    `ls .` was taken for another vocabulary's, its ids dropped with a false warning."""
    tok = target.tokenizer
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", cleans)
    text = "Set x = 'spam' and run ls . here"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    done = ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "length", "token_ids": ids,
                     "message": {"role": "assistant", "content": text}}]})
    got = reply(done, "m", tok)
    assert got.ids == ids and not got.foreign_ids
    assert served_ids(ids, "length", tok, text) == ids
    other = [i + 3 for i in ids]  # another vocabulary's are still told
    assert served_ids(other, "length", tok, text) is None


class Waits(threading.Event):
    """An Event that records each wait asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.asked.append(timeout or 0.0)
        return super().wait(timeout)


def test_requests_refused_together_do_not_retry_together() -> None:
    """Each of a chunk's requests refused by a 503 (or a 429 without Retry-After) waited the
    same backoff, so they all came back at once and were refused again."""
    seen: set[str] = set()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        text = (await request.json())["messages"][-1]["content"]
        if text not in seen:
            seen.add(text)
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        return ok_reply()

    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=8, temperature=0.0)
    with running(app) as url:
        backend = OpenAIBackend(url, "m", cfg, concurrency=8, retries=1, backoff=0.02)
        backend.closed = waits = Waits()
        try:
            got = backend.answer([[{"role": "user", "content": f"q{i}"}] for i in range(8)])
        finally:
            backend.close()
    assert [a.text for a in got] == ["ok"] * 8 and len(waits.asked) == 8
    assert all(0.02 <= w <= 0.03 for w in waits.asked), waits.asked
    assert len(set(waits.asked)) > 1, waits.asked


@pytest.mark.parametrize("status", [408, 409])
def test_a_408_or_409_is_asked_again_within_the_run(status: int) -> None:
    """A proxy's 408 (request timeout) or a 409 is passing, as OpenAI's own client retries it:
    the answer failed at once, whatever --retries, for a rerun to ask."""
    calls: list[int] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        calls.append(status)
        if len(calls) == 1:
            return JSONResponse({"error": {"message": "try again"}}, status_code=status)
        return ok_reply()

    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=1, temperature=0.0)
    with running(app) as url:
        backend = OpenAIBackend(url, "m", cfg, concurrency=1, retries=1, backoff=0.01)
        try:
            got = backend.one([{"role": "user", "content": "q"}])
        finally:
            backend.close()
    assert (got.text, got.finish, len(calls)) == ("ok", "stop", 2)


def test_a_prompts_warning_is_a_line_of_its_own_beside_the_bar(target, tmp_path: Path,
                                                                monkeypatch, capsys) -> None:
    """On a terminal a failed prompt's warning was printed onto the bar's line."""
    from draftsmith.data import progress

    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if (await request.json())["messages"][-1]["content"] == "q 3":
            return JSONResponse({"error": {"message": "no"}}, status_code=400)
        return ok_reply()

    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, temperature=0.0)
    with running(app) as url:
        backend = OpenAIBackend(url, "m", cfg, concurrency=2, retries=0)
        try:
            stats = regenerate(asks(4), tmp_path / "a.jsonl", backend, target.tokenizer, cfg,
                               True, lambda s: None)
        finally:
            backend.close()
    err = capsys.readouterr().err
    assert stats["failed"] == 1 and "conv/s]" in err, err
    at = err.index("draftsmith: warning: prompt")
    assert err[at - 1] in "\r\n", repr(err[at - 80 : at + 30])


def test_the_closing_line_names_failure_kinds_only_where_some_failed() -> None:
    """It read "answered again in their grown chunk 0, ... failed 0, of them refused (a rerun
    gets the same) 0, of them timed out 0" after every run that failed nothing."""
    from draftsmith.data.regenerate import closing_line

    clean = {"done_before": 0, "answered": 3, "redone": 0, "failed": 0, "refused_by_server": 0,
             "timed_out": 0}
    line = closing_line(clean)
    assert line == "regenerate: done_before 0, answered 3, failed 0", line
    failed = {**clean, "redone": 2, "failed": 1, "refused_by_server": 1}
    assert closing_line(failed) == (
        "regenerate: done_before 0, answered 3, answered again in their grown chunk 2, failed 1, "
        "of them refused (a rerun gets the same) 1, of them timed out 0")
