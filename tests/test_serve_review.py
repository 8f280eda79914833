"""`draftsmith serve` as the real `openai` client meets it: disconnects, refused fields, limits;
stream_options without a stream, prompts too long to fit refused before they are tokenized (text,
chat, token ids; in-process and in frontend processes), vLLM's answer-changing fields refused,
seeded n > 1."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import write_tiny_folder  # noqa: E402
from test_serve import live  # noqa: E402

from draftsmith.serve import app as serve_app  # noqa: E402
from draftsmith.serve.cli import server_config  # noqa: E402
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402
from draftsmith.serve.frontends import Frontends  # noqa: E402
from draftsmith.serve.protocol import ApiError, ServeConfig, parse_chat, parse_completion  # noqa: E402
from draftsmith.serve.text import ChoiceText, TextSide, chars_per_token  # noqa: E402

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
    deadline = time.time() + 15  # the decode runs ~1.2 s to its end; a loaded CPU is slower
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


LONG = 1 << 20  # characters: tokenizing them takes seconds on this CPU, holding the tokenizer




class Spy:
    """The tokenizer, recording the longest text it was asked to tokenize."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.longest = tok, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __call__(self, text: str, **kw: Any) -> Any:
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)


@pytest.fixture
def spy(engine: ServeEngine, monkeypatch) -> Spy:
    s = Spy(engine.text_side.tokenizer)
    monkeypatch.setattr(engine.text_side, "tokenizer", s)
    return s


def post(url: str, route: str, body: dict, timeout: float = 30) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/{route}", json=body, timeout=timeout)
    return r, time.perf_counter() - t0


def too_long(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    assert "--max-prompt-tokens 96" in err["message"]


# ---- stream_options --------------------------------------------------------------------------


def test_stream_options_without_a_stream_is_a_400(srv: dict) -> None:
    """As OpenAI and vLLM answer it; it was silently ignored (no usage chunk ever came)."""
    c, model = srv["client"], srv["model"]
    with pytest.raises(openai.BadRequestError, match="stream_options") as e:
        c.chat.completions.create(model=model, messages=MSG, max_tokens=2,
                                  stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        c.completions.create(model=model, prompt="hi", max_tokens=2, stream=False,
                             stream_options={"include_usage": True})
    chunks = list(c.chat.completions.create(model=model, messages=MSG, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    for empty in (None, {}):  # vLLM takes these without a stream
        r, _ = post(srv["url"], "chat/completions", {"messages": MSG, "max_tokens": 2,
                                                     "stream_options": empty})
        assert r.status_code == 200, r.text


# ---- prompts too long to fit -----------------------------------------------------------------


def test_an_oversized_prompt_is_refused_before_it_is_tokenized(srv: dict, spy: Spy) -> None:
    """A 1 MiB prompt was tokenized whole (seconds, under the one tokenizer lock every request
    parses through) before its length was checked; now refused at once with the same 400."""
    for route, body, param in (
        ("completions", {"prompt": "x" * LONG, "max_tokens": 2}, "prompt"),
        ("completions", {"prompt": ["ok", "y" * LONG], "max_tokens": 2}, "prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": "z" * LONG}]},
         "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "w" * 40}] * 20000},
         "messages"),
    ):
        r, took = post(srv["url"], route, body)
        too_long(r, param)
        assert "at least" in r.json()["error"]["message"]
        assert spy.longest < 4096, (route, spy.longest)
        assert took < 3, (route, took)


def test_a_prompt_at_the_limit_still_fits(srv: dict, engine: ServeEngine) -> None:
    """The bound never refuses a prompt that fits: 96 special tokens of 12 characters each
    are 96 tokens (the most characters a token of this tokenizer stands for)."""
    assert engine.text_side.span == len("<|im_start|>") == 12
    ok = "<|im_start|>" * 96
    assert len(engine.text_ids(ok)) == 96
    r, _ = post(srv["url"], "completions", {"prompt": ok, "max_tokens": 1})
    assert r.status_code == 200, r.text
    r, _ = post(srv["url"], "completions", {"prompt": ok + "a", "max_tokens": 1})
    too_long(r, "prompt")
    assert "at least 97 tokens" in r.json()["error"]["message"]
    r, _ = post(srv["url"], "completions", {"prompt": "a" * 97, "max_tokens": 1})
    too_long(r, "prompt")
    assert "is 97 tokens" in r.json()["error"]["message"]  # counted: the bound did not decide


CFG = ServeConfig("tiny", max_tokens=8, max_prompt_tokens=20, max_batch=4)


class Ids(list):
    """A prompt of token ids that counts how often it is walked."""

    walks = 0

    def __iter__(self):
        Ids.walks += 1
        return super().__iter__()


class Counting:
    vocab_size = 256
    calls = 0

    def text_ids(self, text: str, most: int | None = None) -> list[int]:
        Counting.calls += 1
        return list(text.encode())

    def chat_ids(self, messages: list[dict[str, str]], most: int | None = None) -> list[int]:
        return self.text_ids("".join(m["content"] for m in messages))


def test_a_huge_token_array_is_refused_by_its_length_before_any_id_is_read() -> None:
    Ids.walks = 0
    for prompt in (Ids([1] * 100_000), [[1, 2], Ids([3] * 100_000)]):
        with pytest.raises(ApiError) as e:
            parse_completion({"prompt": prompt}, CFG, Counting())
        assert e.value.code == "context_length_exceeded" and "100000 tokens" in e.value.message
    assert Ids.walks == 0
    with pytest.raises(ApiError, match="must be a string") as e:  # the shape still checked
        parse_completion({"prompt": [1, 2, "x"]}, CFG, Counting())
    assert e.value.code == "invalid_type"
    assert parse_completion({"prompt": [[1, 2], "ab"]}, CFG, Counting()).prompts == [
        [1, 2], [97, 98]]


def test_every_field_is_checked_before_any_prompt_is_tokenized() -> None:
    """100,000 prompts of one string each were all tokenized before --max-batch refused them;
    so was a prompt of a request whose other fields were wrong."""
    Counting.calls = 0
    with pytest.raises(ApiError, match="max-batch"):
        parse_completion({"prompt": ["a"] * 100_000}, CFG, Counting())
    with pytest.raises(ApiError, match="stream_options"):
        parse_chat({"messages": MSG, "stream_options": {"include_usage": True}}, CFG, Counting())
    with pytest.raises(ApiError, match="max_tokens"):
        parse_completion({"prompt": "a", "max_tokens": 0}, CFG, Counting())
    assert Counting.calls == 0


# ---- the bound itself ------------------------------------------------------------------------


def _tok(model: Any, pre: Any = None, norm: Any = None, added: list[str] = ()) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(model)
    t.pre_tokenizer, t.normalizer = pre, norm
    fast = PreTrainedTokenizerFast(tokenizer_object=t)
    fast.add_tokens(list(added))
    return fast


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab c\u0301\u0323e\u0307 \t\n.1é"
    return [" " * 500, "\u0301" * 300, "<sep>" * 40] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) for _ in range(60)]


def test_chars_per_token_bounds_every_text_or_gives_none() -> None:
    """len(text) <= tokens x span for each tokenizer a bound is given for (byte-level BPE with
    NFC, sentencepiece-like BPE with byte fallback, a per-character model), and no bound where
    a step drops text (a whitespace split, Strip, fused unknowns)."""
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    chars = sorted(set("".join(_texts(0)) + "abce"))
    bytes_vocab = {f"<0x{b:02X}>": b for b in range(256)}
    sp_vocab = {**bytes_vocab, **{c: 256 + i for i, c in enumerate(chars + ["▁"])},
                "ab": 400, "▁▁": 401, "▁▁▁▁": 402}
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl_vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    bl_vocab.update({"ĠĠ": 300, "ĠĠĠĠ": 301, "ab": 302})
    bounded = {
        "byte-level": _tok(models.BPE(bl_vocab, [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("a", "b")]), bl,
                           normalizers.NFC(), ["<sep>"]),
        "sentencepiece": _tok(models.BPE(sp_vocab, [("▁", "▁"), ("▁▁", "▁▁"), ("a", "b")],
                                         unk_token="<0x00>", fuse_unk=True, byte_fallback=True),
                              None, normalizers.Sequence([normalizers.Prepend("▁"),
                                                          normalizers.Replace(" ", "▁")])),
        "chars": _tok(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"),
                      pre_tokenizers.Split("", "isolated"), normalizers.NFKC()),
    }
    for name, tok in bounded.items():
        span = chars_per_token(tok)
        assert span is not None, name
        for text in _texts(1):
            assert len(text) <= len(tok(text)["input_ids"]) * span, (name, repr(text[:40]))
    unbounded = {
        "whitespace": _tok(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"),
                           pre_tokenizers.WhitespaceSplit()),
        "strip": _tok(models.BPE(bl_vocab, []), bl, normalizers.Strip()),
        "regex": _tok(models.BPE(bl_vocab, []), bl, normalizers.Replace(Regex(" +"), " ")),
        "fused unknowns": _tok(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>",
                                          fuse_unk=True)),
    }
    for name, tok in unbounded.items():
        assert chars_per_token(tok) is None, name
        assert len(tok(" " * 1000)["input_ids"]) <= 1, name  # why no bound holds


def test_the_text_side_keeps_its_bound_through_a_pickle(engine: ServeEngine) -> None:
    import pickle

    texts = pickle.loads(pickle.dumps(engine.text_side))
    assert isinstance(texts, TextSide) and texts.span == engine.text_side.span == 12
    assert texts.at_least("x" * 25) == 3


# ---- the same in frontend processes ----------------------------------------------------------


def test_frontends_refuse_what_one_process_refuses(engine: ServeEngine, tiny_dir: Path) -> None:
    cfg = server_config(engine, str(tiny_dir), None, None, 64)
    with Frontends(engine, cfg, 1) as fe:
        r, took = post(fe.url, "completions", {"prompt": "x" * (4 * LONG), "max_tokens": 2})
        too_long(r, "prompt")
        assert took < 3, took
        r, took = post(fe.url, "chat/completions",
                       {"messages": [{"role": "user", "content": "z" * (4 * LONG)}]})
        too_long(r, "messages")
        assert took < 3, took
        r, _ = post(fe.url, "completions", {"prompt": [1] * 200, "max_tokens": 2})
        too_long(r, "prompt")
        r, _ = post(fe.url, "chat/completions",
                    {"messages": MSG, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
        r, _ = post(fe.url, "chat/completions", {"messages": MSG, "max_tokens": 2, "min_p": 0.1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text


# ---- other fields ----------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("min_p", 0.05), ("repetition_penalty", 1.1), ("ignore_eos", True), ("min_tokens", 4),
    ("stop_token_ids", [5]), ("skip_special_tokens", False), ("chat_template_kwargs",
                                                              {"enable_thinking": False}),
    ("tool_choice", "required"), ("modalities", ["text", "audio"]),
    ("response_format", {"type": "json_object"}),
])
def test_fields_that_would_change_the_answer_are_refused(srv: dict, field: str,
                                                         value: Any) -> None:
    """vLLM's sampling extras were silently ignored: `ignore_eos` benchmarks got short answers,
    `min_p` and `repetition_penalty` sampled as if absent."""
    r, _ = post(srv["url"], "chat/completions", {"messages": MSG, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported"


def test_their_defaults_and_ignorable_fields_pass(srv: dict) -> None:
    body = {"messages": MSG, "max_tokens": 2, "min_p": 0.0, "repetition_penalty": 1.0,
            "ignore_eos": False, "min_tokens": 0, "stop_token_ids": [], "skip_special_tokens": True,
            "tool_choice": "none", "tools": [], "response_format": {"type": "text"},
            "user": "u-1", "metadata": {"k": "v"}, "store": False, "modalities": ["text"]}
    r, _ = post(srv["url"], "chat/completions", body)
    assert r.status_code == 200, r.text


def test_seeded_choices_differ_and_repeat(srv: dict) -> None:
    """n=3 with a seed: three different samples, the same three on every run."""
    def ask() -> list[str]:
        r = srv["client"].completions.create(model=srv["model"], prompt="Tell me", n=3,
                                             max_tokens=12, temperature=1.0, seed=11)
        return [c.text for c in r.choices]

    first = ask()
    assert len(set(first)) == 3, first
    assert ask() == first


@pytest.mark.parametrize(("body", "status", "param"), [
    (b'{"model": "m\\ud83d", "messages": [{"role": "user", "content": "a"}]}', 404, "model"),
    (b'{"messages": [{"role": "user", "content": "a"}], "stop": ["x", "\\udc00"]}', 400, "stop"),
])
def test_an_unpaired_surrogate_elsewhere_is_answered_not_a_500(srv: dict, body: bytes,
                                                              status: int, param: str) -> None:
    """A model name quoted in its 404 made the error body fail to encode (a 500 with a
    traceback); a stop string that could never match was taken silently."""
    r = httpx.post(srv["url"] + "/v1/chat/completions", content=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(("body", "param", "match"), [
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"stop": ["a", ""]}, "stop", "non-empty"),
    ({"max_tokens": -1}, "max_tokens", r"\[1, 8\]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", r"\[1, 8\]"),
    ({"n": 0}, "n", r"\[1, 4\]"),
    ({"n": 2, "prompt": ["a", "b", "c"]}, "n", "max-batch"),
])
def test_limits_name_the_field(body: dict, param: str, match: str) -> None:
    chat = "max_completion_tokens" in body  # chat's name for max_tokens
    with pytest.raises(ApiError, match=match) as e:
        if chat:
            parse_chat({"messages": MSG, **body}, CFG, Counting())
        else:
            parse_completion({"prompt": "a", **body}, CFG, Counting())
    assert e.value.status == 400 and e.value.param == param
