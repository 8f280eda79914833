"""`draftsmith serve` end to end: a real uvicorn server on a free port, the real `openai` client."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import write_tiny_folder  # noqa: E402

from draftsmith.data.chat import AnswerTally  # noqa: E402
from draftsmith.data.prompts import encode_conversation, parse_record  # noqa: E402
from draftsmith.engine.generate import generate  # noqa: E402
from draftsmith.engine.runtime import Runtime  # noqa: E402
from draftsmith.errors import DraftsmithError  # noqa: E402
from draftsmith.serve.cli import server_config  # noqa: E402
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402

LIMITS = dict(max_batch=8, max_prompt_tokens=96, max_tokens=40)
PROMPTS = ["hello", "What is 2+2?", "Tell me a story", "xyz", "abc def", "Why?", "ok", "12345"]




@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_folder(tmp_path_factory.mktemp("serve_target"), "llama", seed=2)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> ServeEngine:
    return load_engine(str(tiny_dir), None, "cpu", torch.float32, EngineConfig(**LIMITS))


@contextmanager
def live(engine: ServeEngine, target: str, **over) -> Iterator[dict]:
    from draftsmith.serve.app import create_app

    cfg = server_config(engine, target, over.pop("name", None), over.pop("api_key", None), 64)
    app = create_app(engine, cfg)
    with served(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        yield {"url": url, "client": client, "model": cfg.model_name, "app": app}


@contextmanager
def served(app: Any) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port; yields its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def srv(engine: ServeEngine, tiny_dir: Path) -> Iterator[dict]:
    with live(engine, str(tiny_dir)) as s:
        yield s


def chat_ids(engine: ServeEngine, text: str) -> list[int]:
    return engine.target.chat_ids([{"role": "user", "content": text}])


def reference(engine: ServeEngine, ids: list[int], n: int) -> str:
    """What `draftsmith generate` prints: engine greedy generation alone, decoded."""
    t = engine.target
    eager = Runtime(engine.rt.model, 1, len(ids) + n + 1, graphs=False)
    toks = generate(eager, [ids], n, eos_ids=t.eos_ids)[0]
    return t.tokenizer.decode(toks, skip_special_tokens=True)


def reference_ids(engine: ServeEngine, ids: list[int], n: int) -> list[int]:
    """The ids `reference` decodes: up to, not with, the eos."""
    eager = Runtime(engine.rt.model, 1, len(ids) + n + 1, graphs=False)
    return [int(t) for t in generate(eager, [ids], n, eos_ids=engine.target.eos_ids)[0]]


def ask(srv: dict, text: str, n: int = 24, **kw):
    return srv["client"].chat.completions.create(
        model=srv["model"], messages=[{"role": "user", "content": text}], max_tokens=n,
        temperature=0, **kw)


def streamed(srv: dict, text: str, n: int = 24, **kw) -> tuple[str, list]:
    chunks = list(ask(srv, text, n, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# ---- basics --------------------------------------------------------------------------------


def test_server_freezes_gc_while_it_runs(engine: ServeEngine, tiny_dir: Path) -> None:
    """Frozen from the first server's start to the last one's stop, overlapping or not (the
    first to stop must not unfreeze the other), and the switch interval put back."""
    import gc
    import sys

    switch = sys.getswitchinterval()
    assert gc.get_freeze_count() == 0, "another server of this process is still up"
    with live(engine, str(tiny_dir)) as a:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the engine's model and tokenizer among them
        with live(engine, str(tiny_dir)) as b:
            assert ask(b, "hi", 4).usage.completion_tokens > 0
        assert gc.get_freeze_count() > frozen // 2  # still frozen (a few died by refcount)
        assert ask(a, "hi", 4).usage.completion_tokens > 0
    assert gc.get_freeze_count() == 0 and sys.getswitchinterval() == switch


def test_models_health_metrics(srv: dict) -> None:
    assert [m.id for m in srv["client"].models.list()] == [srv["model"]]
    assert httpx.get(srv["url"] + "/health").json()["status"] == "ok"
    m = httpx.get(srv["url"] + "/metrics").json()
    for key in ("requests", "tokens_generated", "tokens_per_s", "speculative", "queued"):
        assert key in m
    assert m["speculative"] is False


def test_chat_greedy_equals_generate(srv: dict, engine: ServeEngine) -> None:
    for text in PROMPTS[:4]:
        r = ask(srv, text)
        assert r.choices[0].message.content == reference(engine, chat_ids(engine, text), 24)
        ids = chat_ids(engine, text)
        assert r.usage.prompt_tokens == len(ids)
        want = "length" if r.usage.completion_tokens == 24 else "stop"
        assert r.choices[0].finish_reason == want
        assert r.model == srv["model"] and r.object == "chat.completion"


def test_greedy_equals_generate_cli(srv: dict, tiny_dir: Path) -> None:
    from typer.testing import CliRunner

    from draftsmith.cli import app

    args = ["generate", "--target", str(tiny_dir), "--device", "cpu", "-n", "24", "--json"]
    for p in PROMPTS[:3]:
        args += ["-p", p]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 3
    for line in lines:
        assert ask(srv, line["prompt"]).choices[0].message.content == line["completion"]


def test_chat_stream(srv: dict) -> None:
    for text in PROMPTS[:3]:
        full = ask(srv, text).choices[0].message.content
        got, chunks = streamed(srv, text, stream_options={"include_usage": True})
        assert got == full
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
        assert all(c.object == "chat.completion.chunk" for c in chunks)
    raw = httpx.post(srv["url"] + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True,
        "temperature": 0})
    lines = [x for x in raw.text.split("\n\n") if x]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_completions(srv: dict, engine: ServeEngine) -> None:
    c = srv["client"]
    text = "Once upon a time"
    ids = engine.text_ids(text)
    r = c.completions.create(model=srv["model"], prompt=text, max_tokens=20, temperature=0)
    assert r.choices[0].text == reference(engine, ids, 20)
    r2 = c.completions.create(model=srv["model"], prompt=ids, max_tokens=20, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    many = c.completions.create(model=srv["model"], prompt=[text, "abc"], max_tokens=20,
                                temperature=0)
    assert [x.index for x in many.choices] == [0, 1]
    assert many.choices[0].text == r.choices[0].text
    parts = list(c.completions.create(model=srv["model"], prompt=text, max_tokens=20,
                                      temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
    assert parts[-1].choices[0].finish_reason in ("stop", "length")


def test_sampling_and_n(srv: dict) -> None:
    c = srv["client"]
    r = c.chat.completions.create(model=srv["model"], messages=[{"role": "user", "content": "x"}],
                                  max_tokens=12, temperature=0.9, top_p=0.9, seed=3, n=3)
    assert len(r.choices) == 3 and r.usage.completion_tokens > 0
    again = c.chat.completions.create(
        model=srv["model"], messages=[{"role": "user", "content": "x"}], max_tokens=12,
        temperature=0.9, top_p=0.9, seed=3, n=3)
    assert [x.message.content for x in again.choices] == [x.message.content for x in r.choices]


def test_stop_strings(srv: dict) -> None:
    full = ask(srv, "hello").choices[0].message.content
    assert len(full) > 6
    stop = full[3:5]
    cut = full[: full.index(stop)]
    r = ask(srv, "hello", stop=[stop, "never-there"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    got, chunks = streamed(srv, "hello", stop=stop)
    assert got == cut and chunks[-1].choices[0].finish_reason == "stop"


# ---- bad requests --------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("chat", b"{not json", 400, "JSON"),
    ("chat", b"[1, 2]", 400, "object"),
    ("chat", {"model": "m"}, 400, "messages"),
    ("chat", {"messages": "hi"}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "'wizard' is not one of"),
    ("chat", {"messages": [*MSG, {"role": "tool", "content": "{}"}]}, 400, "tool calls"),
    ("chat", {"messages": [{"role": "user", "content": 3}]}, 400, "content"),
    ("chat", {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": MSG, "temperature": 5}, 400, "temperature"),
    ("chat", {"messages": MSG, "max_tokens": "10"}, 400, "max_tokens"),
    ("chat", {"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    ("chat", {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": MSG, "max_tokens": 41}, 400, "max-tokens-limit"),
    ("chat", {"messages": MSG, "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x" * 200}]}, 400, "max-prompt-tokens"),
    ("chat", {"messages": MSG, "model": "gpt-4o"}, 404, "gpt-4o"),
    ("chat", {"messages": MSG, "n": 9}, 400, "n"),
    ("chat", {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("chat", {"messages": MSG, "stop": 5}, 400, "stop"),
    ("chat", {"messages": MSG, "logprobs": True}, 400, "logprobs"),
    ("chat", {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 9999]}, 400, "vocabulary"),
    ("completions", {"prompt": "y" * 97}, 400, "max-prompt-tokens"),
    ("completions", {"prompt": ["a", "b", "c"], "n": 3}, 400, "max-batch"),
    ("completions", {}, 400, "prompt"),
]


@pytest.mark.parametrize(("route", "body", "status", "word"), BAD)
def test_bad_requests(srv: dict, route: str, body, status: int, word: str) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{srv['url']}/v1/{route.replace('chat', 'chat/completions')}", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert word in err["message"] and err["type"] == "invalid_request_error"


def test_bad_requests_through_openai(srv: dict) -> None:
    with pytest.raises(openai.BadRequestError, match="max-tokens-limit"):
        ask(srv, "hi", n=1000)
    with pytest.raises(openai.NotFoundError):
        srv["client"].chat.completions.create(model="nope", messages=MSG)
    r = httpx.get(srv["url"] + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(srv["url"] + "/health").status_code == 200


# ---- concurrency and failures --------------------------------------------------------------


def test_sixteen_concurrent_requests(srv: dict, engine: ServeEngine) -> None:
    jobs = [(PROMPTS[i % 8] + " " * (i // 8), 12 + i, i % 3 == 0) for i in range(16)]
    before = httpx.get(srv["url"] + "/metrics").json()

    def one(job: tuple[str, int, bool]) -> str:
        text, n, stream = job
        return streamed(srv, text, n)[0] if stream else ask(srv, text, n).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, jobs))
    for (text, n, _), out in zip(jobs, got, strict=True):
        assert out == reference(engine, chat_ids(engine, text), n), text
    after = httpx.get(srv["url"] + "/metrics").json()
    assert after["completed"] - before["completed"] == 16
    assert after["batches"] - before["batches"] < 16  # some requests shared a batch
    assert after["joined_rows"] > before["joined_rows"]  # and some joined a running one


def test_engine_error_is_one_500(srv: dict, engine: ServeEngine, monkeypatch) -> None:
    poison = chat_ids(engine, "poison")
    real = engine.open

    def open_rows(*a, **kw):
        live = real(*a, **kw)
        add = live.add

        def checked(slots, prompts, params=None):
            if poison in prompts:
                raise RuntimeError("boom")
            add(slots, prompts, params)

        live.add = checked
        return live

    monkeypatch.setattr(engine, "open", open_rows)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(ask, srv, t, 8) for t in ("poison", "hello", "abc def", "ok")]
        with pytest.raises(openai.InternalServerError, match="boom"):
            futs[0].result()
        assert all(f.result().choices[0].message.content is not None for f in futs[1:])
    assert httpx.get(srv["url"] + "/health").json()["status"] == "ok"
    monkeypatch.undo()
    assert ask(srv, "hello", 8).choices[0].finish_reason


def test_api_key(engine: ServeEngine, tiny_dir: Path) -> None:
    with live(engine, str(tiny_dir), api_key="sekret", name="tiny") as s:
        with pytest.raises(openai.AuthenticationError):
            s["client"].models.list()
        ok = openai.OpenAI(base_url=s["url"] + "/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in ok.models.list()] == ["tiny"]
        assert httpx.get(s["url"] + "/health").status_code == 200


# ---- speculative ---------------------------------------------------------------------------


def write_drafter(t, embed: torch.Tensor, folder: Path) -> Path:
    """A random drafter for target `t`, sharing its embedding, saved in `folder`."""
    from draftsmith.layers import default_aux_layers
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter

    cfg = Eagle3Config.for_target(t.cfg, t.cfg.vocab_size, default_aux_layers(t.cfg.num_layers),
                                  target_fingerprint=t.fingerprint)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.init_weights()
    d.embed_tokens.weight.data.copy_(embed)
    d.set_vocab(torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
                torch.ones(cfg.vocab_size, dtype=torch.bool))
    return save_drafter(d, folder)


@pytest.fixture(scope="module")
def drafter_dir(engine: ServeEngine, tmp_path_factory) -> Path:
    return write_drafter(engine.target, engine.rt.model.embed.weight,
                         tmp_path_factory.mktemp("drafter"))


@pytest.mark.parametrize(("topk", "ndt"), [(1, None), (2, 6)])
def test_speculative_server(engine: ServeEngine, tiny_dir: Path, drafter_dir: Path, topk: int,
                            ndt: int | None) -> None:
    cfg = EngineConfig(max_batch=4, max_prompt_tokens=64, max_tokens=32, steps=3, topk=topk,
                       num_draft_tokens=ndt)
    spec = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    with live(spec, str(tiny_dir)) as s:
        lens = [20, 6, 14, 9, 17, 4]  # rows end apart: queued requests join running batches
        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda pn: ask(s, *pn), zip(PROMPTS[:6], lens, strict=True)))
        for p, n, r in zip(PROMPTS[:6], lens, outs, strict=True):
            assert r.choices[0].message.content == reference(engine, chat_ids(engine, p), n)
        assert streamed(s, PROMPTS[0], 20)[0] == outs[0].choices[0].message.content
        m = httpx.get(s["url"] + "/metrics").json()
        assert m["speculative"] is True and m["mean_accept_length"] >= 1.0
        assert m["steps"] == 3 and m["topk"] == topk


def test_return_token_ids_as_vllm_gives_them(srv: dict, engine: ServeEngine) -> None:
    """vLLM's `return_token_ids`: a chat's prompt ids at the root, each choice's ids with the
    eos that ended them; a text completion's prompt ids per choice (streamed: review 12)."""
    eos = engine.target.eos_ids
    for p in PROMPTS[:4]:
        r = ask(srv, p, 30, extra_body={"return_token_ids": True})
        want = reference_ids(engine, chat_ids(engine, p), 30)
        got = r.choices[0].token_ids
        assert r.prompt_token_ids == chat_ids(engine, p)
        if r.choices[0].finish_reason == "stop":
            assert got[:-1] == want and got[-1] in eos
        else:
            assert got == want and len(got) == 30
        assert r.usage.completion_tokens == len(got)
    plain = ask(srv, PROMPTS[0], 8)
    assert getattr(plain.choices[0], "token_ids", None) is None
    assert getattr(plain, "prompt_token_ids", None) is None
    text = srv["client"].completions.create(model=srv["model"], prompt=["ab", "xyz"], n=2,
                                            max_tokens=5, temperature=0,
                                            extra_body={"return_token_ids": True})
    prompts = [engine.target.tokenizer(t)["input_ids"] for t in ("ab", "xyz")]
    assert [c.prompt_token_ids for c in text.choices] == [prompts[0]] * 2 + [prompts[1]] * 2
    dec = engine.target.tokenizer.decode
    assert all(dec(c.token_ids, skip_special_tokens=True) == c.text for c in text.choices)


# ---- the data pipeline against the server --------------------------------------------------


def test_data_regenerate_against_server(srv: dict, engine: ServeEngine, tiny_dir: Path,
                                        tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": p}]}) + "\n" for i, p in enumerate(PROMPTS[:4])))
    out = tmp_path / "answers.jsonl"
    args = ["regenerate", str(src), "--out", str(out), "--base-url", srv["url"] + "/v1",
            "--target", str(tiny_dir), "--max-new-tokens", "16", "--max-len", "96",
            "--temperature", "0", "--concurrency", "4"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 4
    for rec in recs:
        user, answer = rec["messages"][0]["content"], rec["messages"][-1]["content"]
        assert answer == reference(engine, chat_ids(engine, user), 16).strip()
        meta = rec["meta"]["answers"][0]
        assert meta["backend"] == "openai" and meta["model"] == srv["model"]
        assert meta["ids"] == reference_ids(engine, chat_ids(engine, user), 16)
    tally = AnswerTally()
    convs = [parse_record(r) for r in recs]
    for conv in convs:  # what capture trains on: the server's ids, in place of the text's
        ids, mask = encode_conversation(engine.target.tokenizer, conv, tally)
        said = conv.meta["answers"][0]["ids"]
        assert [t for t, m in zip(ids, mask, strict=True) if m][: len(said)] == said
    assert tally.as_dict() == {"target_ids": 4, "text": 0, "fallback": 0}
    sampled = CliRunner().invoke(app, [*args[:3], str(tmp_path / "sampled.jsonl"),
                                       *args[4:-4], "--concurrency", "4"])
    assert sampled.exit_code == 0, sampled.output
    assert len((tmp_path / "sampled.jsonl").read_text().splitlines()) == 4


def test_data_make_with_answers_from_the_server_equals_the_engines(srv: dict, tiny_dir: Path,
                                                                   tmp_path: Path) -> None:
    """`data make --base-url`: prompts and capture here, the answers from the server; greedy,
    the dataset is the one the built-in engine makes, the server's ids trained on."""
    from typer.testing import CliRunner

    from draftsmith.data.cli import app
    from draftsmith.data.shards import Dataset

    common = ["--n", "4", "--target", str(tiny_dir), "--batch-size", "4", "--max-len", "96",
              "--max-new-tokens", "16", "--prompt-tokens", "32", "--vocab-size", "40",
              "--temperature", "0"]
    here = CliRunner().invoke(app, ["make", str(tmp_path / "engine"), *common])
    assert here.exit_code == 0, here.output
    there = CliRunner().invoke(app, ["make", str(tmp_path / "server"), *common, "--base-url",
                                     srv["url"] + "/v1", "--concurrency", "3"])
    assert there.exit_code == 0, there.output
    assert "answers 4 as the target's decoded ids" in there.output
    engine, server = (Dataset(tmp_path / k / "dataset") for k in ("engine", "server"))
    assert len(engine) == len(server) == 4
    for i in range(4):
        assert [t.tolist() for t in engine.tokens(i)] == [t.tolist() for t in server.tokens(i)]
    recs = [json.loads(x) for x in
            (tmp_path / "server" / "answers.jsonl").read_text().splitlines()]
    assert {r["meta"]["answers"][0]["backend"] for r in recs} == {"openai"}
    made = json.loads((tmp_path / "server" / "make.json").read_text())
    assert made["server"]["base_url"] == srv["url"] + "/v1"
    refused = CliRunner().invoke(app, ["make", str(tmp_path / "x"), *common,
                                       "--concurrency", "3"])
    assert refused.exit_code != 0 and "--concurrency applies only to a server" in str(
        refused.exception)


@pytest.mark.parametrize("drafts", ["topk", "drawn"])
def test_speculative_server_keeps_one_decoder_a_kind_of_sampling(tiny_dir: Path,
                                                                 drafter_dir: Path, drafts: str,
                                                                 monkeypatch) -> None:
    """Greedy drafts (the default rule): one decoder a kind of sampling, whatever the
    temperature. Drafts drawn from the drafter: one a setting, at most MAX_DECODERS besides
    greedy, the least recently used sampled one going (with its graphs on CUDA)."""
    from draftsmith.engine import speculative
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.serve.engine import MAX_DECODERS

    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", drafts)
    cfg = EngineConfig(max_batch=2, max_prompt_tokens=32, max_tokens=8, steps=2)
    spec = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    greedy = spec._spec_for(SamplingParams())
    temps = [0.3 + 0.1 * i for i in range(MAX_DECODERS + 3)]
    for t in temps:
        spec._spec_for(SamplingParams(temperature=t))
    spec._spec_for(SamplingParams(temperature=0.5, top_p=0.9))
    assert spec._spec_for(SamplingParams()) is greedy
    if drafts == "topk":
        assert list(spec._spec) == ["temperature", "filtered", "greedy"]
        assert spec._spec_for(SamplingParams(2.0)) is spec._spec["temperature"]
    else:
        kept = [k.temperature for k in spec._spec if k != "greedy"]
        assert kept == [*temps[-MAX_DECODERS + 1:], 0.5]


def test_baseline_server_keeps_one_decode_step_a_kind_of_sampling(tiny_dir: Path,
                                                                   monkeypatch) -> None:
    """Baseline decode steps (and their graphs) are cached per (batch, eos, kind of sampling):
    however many temperatures come, the sampled ones share one step of each sort, static and
    continuous. Captures run eagerly here (CPU), keyed as on CUDA."""
    from draftsmith.engine.graphs import Graphs
    from draftsmith.engine.sampling import SamplingParams

    def capture(self, key, fn, warmup=2):
        self.graphs[key] = (None, fn())
        return self.graphs[key][1]

    monkeypatch.setattr(Graphs, "capture", capture)
    monkeypatch.setattr(Graphs, "replay", lambda self, key: self.graphs[key][1])
    eng = load_engine(str(tiny_dir), None, "cpu", torch.float32, EngineConfig(**LIMITS))
    eng.rt.graphs = Graphs(torch.device("cpu"))
    settings = [SamplingParams(), *(SamplingParams(0.3 + 0.1 * i) for i in range(6)),
                SamplingParams(0.7, top_k=5), SamplingParams(1.1, top_p=0.8)]
    for params in settings:
        eng.run([[5, 6, 7]], 3, params)
        live = eng.open(1, params)  # the scheduler's continuous rows: ("refill", ...) steps
        live.add([0], [[5, 6, 7]], [params])
    for kind in ("decode", "refill"):
        steps = {k for k in eng.rt._steps if k[0] == kind}
        assert sorted(k[-1] for k in steps) == ["filtered", "greedy", "temperature"], kind
        assert {k for k in eng.rt.graphs.graphs if k[0] == kind} == steps


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("kind", ["temperature", "filtered"])
def test_a_batch_of_mixed_settings_samples_each_row_as_its_own(tiny_dir: Path, drafter_dir: Path,
                                                                kind: str,
                                                                speculative: bool) -> None:
    """Rows of one continuous batch under four settings: a greedy row (and, in a filtered batch,
    a top_k 1 row) decodes exactly as greedy does beside rows that draw at temperature 1.5, and
    those draw apart from greedy, for the baseline and the speculative engine alike. A batch
    refuses a row of a wider kind than its own."""
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.serve.engine import KIND_SETTINGS

    cfg = EngineConfig(max_batch=4, max_prompt_tokens=32, max_tokens=24, steps=2)
    eng = load_engine(str(tiny_dir), drafter_dir if speculative else None, "cpu",
                      torch.float32, cfg)
    prompts = [[5, 6, 7], [9, 3], [5, 6, 7], [9, 3]]
    greedy = eng.run(prompts, 24, SamplingParams()).rows
    settings = ([SamplingParams(), SamplingParams(1.5), SamplingParams(), SamplingParams(1.2)]
                if kind == "temperature" else
                [SamplingParams(), SamplingParams(1.5, top_p=0.99),
                 SamplingParams(0.6, top_k=1, top_p=0.5), SamplingParams(1.5, top_k=40)])
    live = eng.open(4, KIND_SETTINGS[kind])
    torch.manual_seed(0)
    live.add([0, 1, 2, 3], prompts, settings)
    live.step(24)
    rows, done = live.read([0, 1, 2, 3])
    assert all(done)
    assert rows[0][:24] == greedy[0] and rows[2][:24] == greedy[2]
    assert rows[1][:24] != greedy[1] and rows[3][:24] != greedy[3]
    if kind == "temperature":
        with pytest.raises(DraftsmithError, match="cannot take"):
            live.add([1], [[4]], [SamplingParams(0.7, top_p=0.5)])


def test_seeded_requests_draw_the_same_alone_or_beside_a_twin(srv: dict) -> None:
    """A seeded sampled request never shares a batch (its draws would depend on the other
    rows): two identical ones sent at once each get what one alone gets."""
    def one(_: int) -> str:
        r = srv["client"].chat.completions.create(
            model=srv["model"], messages=[{"role": "user", "content": PROMPTS[2]}],
            max_tokens=16, temperature=0.9, seed=11)
        return r.choices[0].message.content

    alone = one(0)
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(one, range(2))) == [alone, alone]


def test_sampled_decoders_share_the_drafter_prompt_runtime(tiny_dir: Path,
                                                           drafter_dir: Path) -> None:
    """Every sampling setting's decoder prefills through one drafter prompt runtime (and its
    graphs on CUDA): a new setting captures none, an evicted one leaves none behind."""
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.engine.spec_refill import _prefiller

    cfg = EngineConfig(max_batch=2, max_prompt_tokens=32, max_tokens=8, steps=2)
    spec = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    greedy = _prefiller(spec._spec_for(SamplingParams()))
    warm = _prefiller(spec._spec_for(SamplingParams(temperature=0.7)))
    assert greedy is not warm and greedy.drt is warm.drt and greedy.rt is warm.rt


def test_warmup_with_fixed_rows_captures_the_one_row_count(tiny_dir: Path,
                                                            drafter_dir: Path) -> None:
    """`serve --fixed-rows`: every batch opens at --max-batch rows, so warm-up steps that size
    alone, baseline and speculative (prompt passes still at every padded row count)."""
    from draftsmith.engine.sampling import SamplingParams

    cfg = EngineConfig(max_batch=6, max_prompt_tokens=64, max_tokens=8, steps=2, fixed_rows=True)
    base = load_engine(str(tiny_dir), None, "cpu", torch.float32, cfg)
    base.warmup()
    assert sorted(k[1] for k in base.rt._steps if k[0] == "refill") == [6]
    spec = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    spec.warmup()
    assert sorted(spec._spec_for(SamplingParams()).states) == [6]


def test_warmup_captures_each_kind_of_sampling_it_is_given(tiny_dir: Path, drafter_dir: Path,
                                                          monkeypatch) -> None:
    """`serve --warm-sampling temperature` (the default): the warm-up steps rows of greedy and of
    temperature sampling at every size, so a request at another temperature makes no new state
    or step; filtered sampling is left for its first request unless named. Under drawn drafts
    (one decoder a setting) no sampled kind is warmed."""
    from draftsmith.engine import speculative
    from draftsmith.engine.sampling import SamplingParams

    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "topk")
    cfg = EngineConfig(max_batch=2, max_prompt_tokens=64, max_tokens=8, steps=2)
    base = load_engine(str(tiny_dir), None, "cpu", torch.float32, cfg)
    base.warmup(kinds=("temperature",))
    steps = set(base.rt._steps)
    assert sorted((k[1], k[-1]) for k in steps if k[0] == "refill") == [
        (1, "greedy"), (1, "temperature"), (2, "greedy"), (2, "temperature")]
    spec = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    spec.warmup(kinds=("temperature", "filtered"))
    assert sorted(spec._spec) == ["filtered", "greedy", "temperature"]
    states = {k: set(d.states) for k, d in spec._spec.items()}
    assert all(v == {1, 2} for v in states.values())
    t = SamplingParams(0.6)
    for eng in (base, spec):
        live = eng.open(2, t)
        live.add([0, 1], [[5, 6, 7], [9]], [t, t])
        live.step(2)
    assert set(base.rt._steps) == steps
    assert {k: set(d.states) for k, d in spec._spec.items()} == states
    with pytest.raises(DraftsmithError, match="unknown kind"):
        base.warmup(kinds=("topp",))
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "drawn")
    drawn = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    drawn.warmup(kinds=("temperature",))
    assert list(drawn._spec) == ["greedy"]


def test_warmup_opens_every_row_count_the_scheduler_opens(tiny_dir: Path,
                                                          drafter_dir: Path) -> None:
    """`serve --warmup` (the default on GPU) fills and steps rows at every size a batch opens
    at (powers of two up to --max-batch, static batches too), baseline and speculative; the rows
    decode after it as they would cold."""
    from draftsmith.engine.sampling import SamplingParams

    cfg = EngineConfig(max_batch=6, max_prompt_tokens=64, max_tokens=8, steps=2)
    base = load_engine(str(tiny_dir), None, "cpu", torch.float32, cfg)
    base.warmup()
    assert sorted(k[1] for k in base.rt._steps if k[0] == "refill") == [1, 2, 4, 6]
    spec = load_engine(str(tiny_dir), drafter_dir, "cpu", torch.float32, cfg)
    spec.warmup()
    assert sorted(spec._spec_for(SamplingParams()).states) == [1, 2, 4, 6]
    a, b = chat_ids(base, "hello"), chat_ids(base, "Tell me a story")
    want = [generate(base.rt.model, [p], 8, eos_ids=[])[0] for p in (a, b)]
    for eng in (base, spec):  # b joins row 0 while a decodes in row 1, then a's row is dropped
        live = eng.open(2, SamplingParams())
        live.add([1], [a])
        live.step(2)
        live.add([0], [b])
        live.step(7)
        (ta, tb), ended = live.read([1, 0])
        assert ta == want[0][: len(ta)] and tb == want[1][: len(tb)]
        assert all(len(t) == 8 or e for t, e in zip((ta, tb), ended, strict=True))
        live.drop([1])
        assert live.read([1])[1] == [True]
