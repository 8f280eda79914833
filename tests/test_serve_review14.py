"""Sampling extras the server does not implement refused by name rather than ignored: vLLM's and
SGLang's request fields were covered, `top_n_sigma` and the other samplers that llama.cpp-style
clients send (and SGLang's `lora_path`, `custom_logit_processor`) were sampled as if absent; each
one's "off" value still passes. Through the real `openai` client."""

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
    ("top_n_sigma", 1.0), ("top_n_sigma", 2), ("top_n_sigma", -2.5),
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


def test_a_stream_asking_top_n_sigma_is_refused_before_its_200(srv: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _ask(srv, True, {"top_n_sigma": 1.0}, stream=True)
    assert e.value.body["param"] == "top_n_sigma"


@pytest.mark.parametrize("chat", [True, False])
def test_their_off_values_still_sample(srv: dict, chat: bool) -> None:
    off = {"top_n_sigma": -1, "typical_p": 1.0, "mirostat": 0, "xtc_probability": 0.0,
           "dry_multiplier": 0, "dynatemp_range": 0.0, "repeat_penalty": 1.0, "lora_path": None,
           "custom_logit_processor": None}
    r = _ask(srv, chat, off)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert _ask(srv, chat, {"top_n_sigma": 0}).usage.completion_tokens >= 1
