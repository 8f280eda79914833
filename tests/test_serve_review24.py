"""`draftsmith serve` under review, round twenty-four, through the real `openai` client.
Checked: /v1/models' max_model_len is the longest prompt + completion a request is served at
(vLLM's meaning), one token more a 400. Fixed: an `n` past --max-batch says which --max-batch
would serve it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_serve import LIMITS, drafter_dir, engine, live, tiny_dir  # noqa: E402
from test_serve_review13 import srv  # noqa: E402

from draftsmith.serve.engine import EngineConfig, load_engine  # noqa: E402

__all__ = ["drafter_dir", "engine", "srv", "tiny_dir"]  # fixtures
PROMPT, LIMIT, MOST = LIMITS["max_prompt_tokens"], LIMITS["max_tokens"], LIMITS["max_batch"]


def max_model_len(srv: dict) -> int:
    return httpx.get(srv["url"] + "/v1/models").json()["data"][0]["max_model_len"]


def complete(srv: dict, prompt: int, max_tokens: int) -> object:
    return srv["client"].completions.create(model=srv["model"], prompt=[7] * prompt,
                                            max_tokens=max_tokens, temperature=0)


def test_max_model_len_is_the_longest_request_served(srv: dict) -> None:
    most = max_model_len(srv)
    assert most == PROMPT + LIMIT
    r = complete(srv, PROMPT, most - PROMPT)
    assert r.usage.prompt_tokens == PROMPT and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("topk", "ndt"), [(1, None), (2, 6)])
def test_a_speculative_servers_max_model_len_is_served_past_its_margin(
        engine: object, tiny_dir: Path, drafter_dir: Path, topk: int, ndt: int | None) -> None:
    """The drafting margin is cache beyond max_model_len, not taken out of it."""
    cfg = EngineConfig(max_batch=2, max_prompt_tokens=24, max_tokens=20, steps=3, topk=topk,
                       num_draft_tokens=ndt)
    spec = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    with live(spec, str(tiny_dir)) as s:
        most = max_model_len(s)
        assert most == 24 + 20
        r = complete(s, 24, most - 24)
        assert r.usage.prompt_tokens == 24 and r.usage.completion_tokens <= most - 24


@pytest.mark.parametrize(("prompt", "extra", "param", "says"), [
    (PROMPT + 1, 0, "prompt", f"over the server's --max-prompt-tokens {PROMPT}"),
    (PROMPT, 1, "max_tokens", f"must be in [1, {LIMIT}] (the server's --max-tokens-limit)"),
])
def test_one_token_past_max_model_len_is_a_400(srv: dict, prompt: int, extra: int, param: str,
                                               says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        complete(srv, prompt, max_model_len(srv) - PROMPT + extra)
    err = e.value.body
    assert err["param"] == param and says in err["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_n_past_the_batch_says_which_max_batch_serves_it(srv: dict, chat: bool) -> None:
    c, n = srv["client"], MOST + 3
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            c.chat.completions.create(model=srv["model"], messages=[{"role": "user",
                                      "content": "hi"}], n=n, max_tokens=2)
        else:
            c.completions.create(model=srv["model"], prompt="hi", n=n, max_tokens=2)
    err = e.value.body
    assert (err["param"], err["code"]) == ("n", "invalid_value")
    assert err["message"] == (f"'n' must be in [1, {MOST}] (the server's --max-batch), got {n}: "
                              f"serving n={n} needs --max-batch {n} or more")


def test_an_n_below_one_gets_no_max_batch_advice(srv: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        srv["client"].completions.create(model=srv["model"], prompt="hi", n=0, max_tokens=2)
    said = e.value.body["message"]
    assert said == f"'n' must be in [1, {MOST}] (the server's --max-batch), got 0"
