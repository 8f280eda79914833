"""vLLM's `return_token_ids` with `stream: true`: each choice's first chunk carries the prompt's
ids (a chat's at the root, a text completion's in the choice), each chunk's choice the ids of its
delta; over the stream they are the non-streamed answer's ids (its eos at the end), stop strings
included, and the streamed text is unchanged."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_serve import PROMPTS, ask, engine, live, tiny_dir  # noqa: E402

from draftsmith.serve.engine import ServeEngine  # noqa: E402

__all__ = ["engine", "tiny_dir"]  # fixtures
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def srv(engine: ServeEngine, tiny_dir: Path) -> Iterator[dict]:
    with live(engine, str(tiny_dir)) as s:
        yield s


def _gather(chunks: list, chat: bool, dec=None) -> dict[int, dict]:
    """Per choice: its text, its ids concatenated, its prompt ids (from its first chunk only),
    its finish reason. `dec`: check that the ids sent so far never run ahead of the text sent
    (held-back text keeps its ids back)."""
    out: dict[int, dict] = defaultdict(lambda: {"text": "", "ids": [], "prompt": None,
                                                "chunks": 0, "finish": None})
    for c in chunks:
        if not c.choices:  # the usage chunk
            continue
        (ch,) = c.choices
        got = out[ch.index]
        prompt = getattr(c if chat else ch, "prompt_token_ids", None)
        assert (prompt is not None) == (got["chunks"] == 0)  # the choice's first chunk only
        if prompt is not None:
            got["prompt"] = prompt
        if chat and got["chunks"] == 0:  # the role chunk: no ids of its own
            assert ch.delta.role == "assistant" and getattr(ch, "token_ids", None) is None
        else:
            assert isinstance(ch.token_ids, list)
            got["ids"] += ch.token_ids
        got["text"] += (ch.delta.content or "") if chat else ch.text
        got["chunks"] += 1
        if dec is not None and not ch.finish_reason:  # a stop string's own ids: at the finish
            assert got["text"].startswith(dec(got["ids"], skip_special_tokens=True))
        got["finish"] = ch.finish_reason or got["finish"]
    return dict(out)


def _chat_both(srv: dict, text: str, most: int, dec=None, **kw) -> tuple:
    whole = ask(srv, text, most, extra_body=IDS, **kw)
    chunks = list(ask(srv, text, most, stream=True, extra_body=IDS, **kw))
    return whole, _gather(chunks, chat=True, dec=dec)


def test_streamed_chat_ids_are_the_non_streamed_ones(srv: dict, engine) -> None:
    for p in PROMPTS[:5]:
        whole, got = _chat_both(srv, p, 30, engine.target.tokenizer.decode)
        (c,) = whole.choices
        assert got[0]["text"] == c.message.content
        assert got[0]["ids"] == c.token_ids and got[0]["finish"] == c.finish_reason
        assert got[0]["prompt"] == whole.prompt_token_ids
        assert whole.usage.completion_tokens == len(got[0]["ids"])


def test_streamed_ids_with_stop_strings_are_the_non_streamed_ones(srv: dict, engine) -> None:
    """Text held back for a stop string brings its ids when released or at the finish; the ids
    past the stop string are never sent, as the non-streamed answer has none."""
    stopped = 0
    for p in PROMPTS[:6]:
        text = ask(srv, p, 30).choices[0].message.content
        for stop in dict.fromkeys([text[4:7], text[10:12], text[15:16], text[2:3], "zz-never-zz"]):
            if not stop.strip():
                continue
            whole, got = _chat_both(srv, p, 30, engine.target.tokenizer.decode,
                                    stop=[stop, "zz-never-zz"])
            (c,) = whole.choices
            assert got[0]["text"] == c.message.content
            assert got[0]["ids"] == c.token_ids, (p, stop)
            assert got[0]["prompt"] == whole.prompt_token_ids
            stopped += len(c.message.content) < len(text)
    assert stopped >= 4  # the stop strings cut answers short


def test_streamed_text_completion_ids_with_n_and_prompts(srv: dict) -> None:
    cl = srv["client"]
    for stop in (None, ["e ", "zz-never-zz"]):
        kw = dict(model=srv["model"], prompt=["ab", "Tell me", "xyz"], n=2, max_tokens=20,
                  temperature=0, stop=stop, extra_body=IDS)
        whole = cl.completions.create(**kw)
        got = _gather(list(cl.completions.create(stream=True, **kw)), chat=False)
        assert sorted(got) == list(range(6))
        for i, c in enumerate(whole.choices):
            assert got[i]["text"] == c.text and got[i]["ids"] == c.token_ids
            assert got[i]["prompt"] == c.prompt_token_ids
            assert got[i]["finish"] == c.finish_reason
    kw = dict(model=srv["model"], messages=[{"role": "user", "content": PROMPTS[2]}], n=2,
              max_tokens=20, temperature=0, stop=["e "], extra_body=IDS)
    whole = cl.chat.completions.create(**kw)
    got = _gather(list(cl.chat.completions.create(stream=True, **kw)), chat=True)
    assert sorted(got) == [0, 1]
    for i, c in enumerate(whole.choices):
        assert got[i]["text"] == c.message.content
        assert got[i]["ids"] == c.token_ids and got[i]["prompt"] == whole.prompt_token_ids


def test_no_ids_in_a_stream_unless_asked(srv: dict) -> None:
    chunks = list(ask(srv, PROMPTS[0], 12, stream=True, stream_options={"include_usage": True}))
    chunks += list(srv["client"].completions.create(model=srv["model"], prompt="ab", n=2,
                                                    max_tokens=12, temperature=0, stream=True))
    for c in chunks:
        assert getattr(c, "prompt_token_ids", None) is None
        for ch in c.choices:
            assert getattr(ch, "token_ids", None) is None
            assert getattr(ch, "prompt_token_ids", None) is None
        assert "token_ids" not in c.model_dump_json()
