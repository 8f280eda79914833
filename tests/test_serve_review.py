"""`draftsmith serve` as the real `openai` client meets it: disconnects, refused fields, limits."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import write_tiny_folder  # noqa: E402
from test_serve import live  # noqa: E402

from draftsmith.serve import app as serve_app  # noqa: E402
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402
from draftsmith.serve.text import ChoiceText  # noqa: E402

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_folder(tmp_path_factory.mktemp("serve_review"), "llama", seed=2)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> ServeEngine:
    cfg = EngineConfig(max_batch=4, max_prompt_tokens=96, max_tokens=40)
    return load_engine(str(tiny_dir), None, "cpu", torch.float32, cfg)


@pytest.fixture(scope="module")
def srv(engine: ServeEngine, tiny_dir: Path) -> Iterator[dict]:
    with live(engine, str(tiny_dir)) as s:
        yield s


def metrics(srv: dict) -> dict:
    return httpx.get(srv["url"] + "/metrics").json()


def test_a_client_that_leaves_before_its_whole_answer_frees_its_row(srv: dict, engine,
                                                                     monkeypatch) -> None:
    """A non-streamed request whose client timed out stops decoding at the next look and
    counts as cancelled (it once ran to its max_tokens and counted as completed)."""
    real = engine.open

    def slow(*a, **kw):
        rows = real(*a, **kw)
        step = rows.step

        def each(n: int) -> None:
            time.sleep(0.03 * n)
            step(n)

        rows.step = each
        return rows

    monkeypatch.setattr(engine, "open", slow)
    before = metrics(srv)
    impatient = srv["client"].with_options(timeout=0.2)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=srv["model"], messages=MSG, max_tokens=40,
                                          temperature=0)
    deadline = time.time() + 5
    while (m := metrics(srv))["cancelled"] == before["cancelled"]:
        assert time.time() < deadline, "the abandoned request was never cancelled"
        time.sleep(0.05)
    assert m["completed"] == before["completed"]
    assert m["completion_tokens"] == before["completion_tokens"]


def test_a_seed_torch_cannot_take_is_a_400_not_an_engine_error(srv: dict) -> None:
    for seed in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(openai.BadRequestError, match="'seed' must be in"):
            srv["client"].chat.completions.create(model=srv["model"], messages=MSG,
                                                  max_tokens=4, temperature=1.0, seed=seed)
    r = srv["client"].chat.completions.create(model=srv["model"], messages=MSG, max_tokens=4,
                                              temperature=1.0, seed=(1 << 64) - 1)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_completion_logprobs_zero_asks_for_logprobs_and_is_refused(srv: dict) -> None:
    """On /v1/completions `logprobs: 0` asks for the chosen tokens' logprobs: a 400, not an
    answer whose logprobs are silently null."""
    c = srv["client"]
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.completions.create(model=srv["model"], prompt="hi", max_tokens=4, logprobs=0)
    r = c.chat.completions.create(model=srv["model"], messages=MSG, max_tokens=4, logprobs=False)
    assert r.choices[0].logprobs is None


def test_a_chunked_body_over_the_limit_is_a_413(srv: dict, monkeypatch) -> None:
    """A body without content-length (chunked) is held to the same limit as one with it."""
    monkeypatch.setattr(serve_app, "MAX_BODY", 1024)

    def body() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        yield b"x" * 2048
        yield b'"}], "max_tokens": 2}'

    r = httpx.post(srv["url"] + "/v1/chat/completions", content=body())
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "body_too_large"


def test_usage_counts_every_byte_of_a_multibyte_stop_string() -> None:
    """A stop string's last character split over byte tokens: the tokens up to its last byte
    are the completion's, not one fewer (its first byte alone decodes to a placeholder)."""
    ids = list("abéc".encode())
    for stream in (False, True):
        ct = ChoiceText(lambda t: bytes(t).decode("utf-8", errors="replace"), ["é"], stream)
        for i in range(1, len(ids) + 1):
            ct.feed(ids[:i])
        assert ct.stopped and ct.text == "ab" and ct.tokens_used(ids) == 4


@pytest.mark.parametrize(("route", "body", "param"), [
    ("completions", b'{"prompt": ["ok", "a\\ud83db"], "max_tokens": 2}', "prompt"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud83d"}]}',
     "messages[0].content"),
])
def test_an_unpaired_surrogate_is_a_400_naming_the_field(srv: dict, route: str, body: bytes,
                                                         param: str) -> None:
    """Half of a UTF-16 pair, escaped in valid JSON: once a 500 from the tokenizer's
    TypeError (completions) or a chat-template complaint about TextEncodeInput."""
    r = httpx.post(f"{srv['url']}/v1/{route}", content=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]
