"""Sampling extras the server does not implement refused by name rather than ignored: vLLM's and
SGLang's request fields were covered, the samplers that llama.cpp-style clients send (and SGLang's
`lora_path`, `custom_logit_processor`) were sampled as if absent; each one's "off" value still
passes. `top_n_sigma`, refused here at first, is now served (`sampling.filtered`). Through the real
`openai` client."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_serve import engine, tiny_dir  # noqa: E402
from test_serve_review13 import MSG, srv  # noqa: E402

__all__ = ["engine", "srv", "tiny_dir"]  # fixtures


def _ask(srv: dict, chat: bool, extra: dict[str, Any], stream: bool = False) -> Any:
    c, body = srv["client"], {"model": srv["model"], "max_tokens": 2, "temperature": 0.8,
                              "extra_body": extra, "stream": stream}
    if chat:
        return c.chat.completions.create(messages=MSG, **body)
    return c.completions.create(prompt="hello", **body)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize(("field", "value"), [
    ("typical_p", 0.9), ("mirostat", 2), ("xtc_probability", 0.5), ("dry_multiplier", 0.8),
    ("dynatemp_range", 0.5), ("repeat_penalty", 1.1),
    ("lora_path", "adapter"), ("custom_logit_processor", "{}"),
])
def test_sampler_extras_are_400s_not_ignored(srv: dict, chat: bool, field: str,
                                             value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _ask(srv, chat, {field: value})
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == field and err["code"] == "unsupported"
    assert field in err["message"]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("n", [1.0, 2])
def test_top_n_sigma_is_served(srv: dict, chat: bool, n: float) -> None:
    assert _ask(srv, chat, {"top_n_sigma": n}).usage.completion_tokens >= 1


@pytest.mark.parametrize("chat", [True, False])
def test_a_top_n_sigma_that_keeps_one_token_decodes_as_greedy(srv: dict, chat: bool) -> None:
    """n near 0 keeps only the largest logit: T 2 then draws greedy's tokens."""
    c, body = srv["client"], {"model": srv["model"], "max_tokens": 8, "seed": 3}
    ask = c.chat.completions.create if chat else c.completions.create
    where = {"messages": MSG} if chat else {"prompt": "hello"}
    text = lambda r: r.choices[0].message.content if chat else r.choices[0].text  # noqa: E731
    greedy = ask(**where, **body, temperature=0)
    sharp = ask(**where, **body, temperature=2.0, extra_body={"top_n_sigma": 1e-6})
    assert text(sharp) == text(greedy)


def test_a_stream_asking_top_n_sigma_is_served(srv: dict) -> None:
    chunks = list(_ask(srv, True, {"top_n_sigma": 1.0}, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("bad", [-2.5, -0.5])
def test_a_negative_top_n_sigma_but_its_off_value_is_a_400(srv: dict, bad: float) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _ask(srv, True, {"top_n_sigma": bad})
    err = e.value.body
    assert err["param"] == "top_n_sigma" and err["code"] == "invalid_value"
    assert err["message"] == f"'top_n_sigma' must be a finite number >= 0, or -1 (off), got {bad}"


@pytest.mark.parametrize("chat", [True, False])
def test_their_off_values_still_sample(srv: dict, chat: bool) -> None:
    off = {"top_n_sigma": -1, "typical_p": 1.0, "mirostat": 0, "xtc_probability": 0.0,
           "dry_multiplier": 0, "dynatemp_range": 0.0, "repeat_penalty": 1.0, "lora_path": None,
           "custom_logit_processor": None}
    r = _ask(srv, chat, off)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert _ask(srv, chat, {"top_n_sigma": 0}).usage.completion_tokens >= 1
