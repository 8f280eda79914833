"""A server's answer ids (vLLM's `return_token_ids`) recorded as the engine records its own."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletion

from draftsmith.data.regenerate import reply, served_ids


def completion(content: str, finish: str, ids: Any = None) -> ChatCompletion:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                              "message": {"role": "assistant", "content": content}}
    if ids is not None:
        choice["token_ids"] = ids
    return ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [choice]})


def test_the_stopping_special_token_is_dropped_and_nothing_else(target) -> None:
    tok = target.tokenizer
    words = tok("a cat sat", add_special_tokens=False)["input_ids"]
    eos = target.eos_ids[0]
    assert reply(completion("a cat sat", "stop", words + [eos]), "m", tok).ids == words
    # an answer stopped by its end without the end among its ids: its last token is kept
    assert reply(completion("a cat sat", "stop", words), "m", tok).ids == words
    # cut at max tokens: a special token there is the target's, kept
    assert reply(completion("a cat sat", "length", words + [eos]), "m", tok).ids == words + [eos]


def test_no_ids_where_the_server_sends_none_or_bad_ones(target) -> None:
    tok = target.tokenizer
    assert reply(completion("hi", "stop"), "m", tok).ids is None
    assert reply(completion("hi", "stop", [1, 2]), "m", None).ids is None  # no tokenizer
    for bad in ([1, -2], [1, "2"], [1.0], "12", {"a": 1}):
        assert served_ids(bad, "stop", tok) is None
    assert served_ids([], "stop", tok) == []
