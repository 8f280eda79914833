"""`data make --base-url` end to end against a real `draftsmith serve` on loopback: resumes,
growth, ctrl-C, failures, a server down or a wrong --model, and what make.json keeps."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from conftest import write_tiny_folder  # noqa: E402
from test_serve import live as serve_live  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from draftsmith.data.cli import app  # noqa: E402
from draftsmith.serve.engine import EngineConfig, ServeEngine, load_engine  # noqa: E402

KEY = "sk-secret-1234"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_folder(tmp_path_factory.mktemp("make_target"), "llama", seed=2)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> ServeEngine:
    cfg = EngineConfig(max_batch=8, max_prompt_tokens=96, max_tokens=40)
    return load_engine(str(tiny_dir), None, "cpu", torch.float32, cfg)


@contextmanager
def live(engine: ServeEngine, target: str, api_key: str | None = None) -> Iterator[dict]:
    """test_serve's real server, its URL with /v1 as --base-url takes it."""
    with serve_live(engine, target, api_key=api_key) as s:
        yield {"url": s["url"] + "/v1", "model": s["model"]}


@pytest.fixture(scope="module")
def srv(engine: ServeEngine, tiny_dir: Path) -> Iterator[dict]:
    with live(engine, str(tiny_dir), api_key=KEY) as s:
        yield s


def common(tiny_dir: Path, n: int = 4, temperature: str = "0") -> list[str]:
    return ["--n", str(n), "--target", str(tiny_dir), "--batch-size", "4", "--max-len", "96",
            "--max-new-tokens", "8", "--prompt-tokens", "32", "--vocab-size", "40",
            "--temperature", temperature]


def make(out: Path, *args: str, monkeypatch: pytest.MonkeyPatch | None = None) -> object:
    argv = ["make", str(out), *args]
    if monkeypatch is not None:  # the command line make.json records is this process's
        monkeypatch.setattr(sys, "argv", ["draftsmith", "data", *argv])
    return CliRunner().invoke(app, argv)


def served(srv: dict, *more: str) -> list[str]:
    return ["--base-url", srv["url"], "--api-key", KEY, "--concurrency", "2", *more]


def answers(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "answers.jsonl").read_text().splitlines()]


def convs(out: Path) -> list[tuple[str, list]]:
    return [(r["meta"]["prompt_id"], r["messages"]) for r in answers(out)]


def all_bytes(out: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file())


def test_the_api_key_is_never_written(srv: dict, tiny_dir: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for k, spelling in enumerate((["--api-key", KEY], [f"--api-key={KEY}"])):
        out = tmp_path / str(k)
        args = [*common(tiny_dir), "--base-url", srv["url"], *spelling]
        r = make(out, *args, monkeypatch=monkeypatch)
        assert r.exit_code == 0, r.output
        assert KEY.encode() not in all_bytes(out)
        made = json.loads((out / "make.json").read_text())
        assert "--api-key" in made["commands"][0] and "--base-url" in made["commands"][0]


def test_make_json_names_the_served_model_it_asked(srv: dict, tiny_dir: Path,
                                                   tmp_path: Path) -> None:
    r = make(tmp_path / "d", *common(tiny_dir), *served(srv))
    assert r.exit_code == 0, r.output
    made = json.loads((tmp_path / "d" / "make.json").read_text())
    assert made["server"] == {"base_url": srv["url"], "model": srv["model"]}


def test_a_rerun_asks_nothing_and_keeps_the_shards(srv: dict, tiny_dir: Path,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "d"
    first = make(out, *common(tiny_dir), *served(srv))
    assert first.exit_code == 0, first.output
    before = {p: p.stat().st_mtime_ns for p in (out / "dataset").rglob("*.safetensors")
              if p.name != "vocab.safetensors"}  # counted again, the same
    again = make(out, *common(tiny_dir), *served(srv))
    assert again.exit_code == 0, again.output
    assert "conversations to answer" not in again.output
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_a_server_down_is_told_before_the_prompts_stage(tiny_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for model in ([], ["--model", "m"]):
        r = make(tmp_path / "d", *common(tiny_dir), "--base-url", f"http://127.0.0.1:{port}/v1",
                 "--retries", "0", *model)
        assert r.exit_code != 0
        assert "no server answered" in str(r.exception), r.output
        assert "== prompts" not in r.output and not (tmp_path / "d").exists()  # nor OUT made


def test_a_wrong_key_is_told_before_the_prompts_stage(srv: dict, tiny_dir: Path,
                                                      tmp_path: Path) -> None:
    r = make(tmp_path / "d", *common(tiny_dir), "--base-url", srv["url"], "--api-key", "bad",
             "--model", srv["model"])
    assert r.exit_code != 0 and "HTTP 401" in str(r.exception), r.output
    assert "--api-key" in str(r.exception) and "== prompts" not in r.output


def test_a_wrong_model_is_warned_then_stops_before_capture(srv: dict, tiny_dir: Path,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "d"
    r = make(out, *common(tiny_dir), *served(srv, "--model", "nope"))
    assert r.exit_code != 0
    assert f"lists ['{srv['model']}'], not --model 'nope'" in r.output
    assert "HTTP 404" in str(r.exception) and "check --model" in str(r.exception)
    assert not (out / "dataset").exists()
    fixed = make(out, *common(tiny_dir), *served(srv, "--model", srv["model"]))
    assert fixed.exit_code == 0, fixed.output


def test_server_options_without_a_server_are_refused(tiny_dir: Path, tmp_path: Path) -> None:
    for flag in (["--model", "m"], ["--retries", "1"], ["--api-key", "k"]):
        r = make(tmp_path / "d", *common(tiny_dir), *flag)
        assert r.exit_code != 0 and f"{flag[0]} applies only to a server" in str(r.exception)
    assert not (tmp_path / "d").exists()


def test_switching_between_engine_and_server_in_one_folder_is_refused(
        srv: dict, tiny_dir: Path, tmp_path: Path) -> None:
    engine_first, server_first = tmp_path / "e", tmp_path / "s"
    assert make(engine_first, *common(tiny_dir, 4)).exit_code == 0
    r = make(engine_first, *common(tiny_dir, 8), *served(srv))
    assert r.exit_code != 0 and "holds the built-in engine's answers, this run asks a server: " \
        "leave --base-url out" in str(r.exception)
    assert make(server_first, *common(tiny_dir, 4), *served(srv)).exit_code == 0
    r = make(server_first, *common(tiny_dir, 4))
    assert r.exit_code != 0 and "give --base-url as before" in str(r.exception)
    assert len(answers(server_first)) == 4
    made = json.loads((server_first / "make.json").read_text())
    assert made["server"]["base_url"] == srv["url"]


def test_a_larger_n_grows_a_sampled_run_as_one_run_makes_it(srv: dict, tiny_dir: Path,
                                                           tmp_path: Path) -> None:
    grown, whole = tmp_path / "g", tmp_path / "w"
    assert make(grown, *common(tiny_dir, 4, "0.8"), *served(srv)).exit_code == 0
    r = make(grown, *common(tiny_dir, 8, "0.8"), *served(srv))
    assert r.exit_code == 0, r.output
    assert "4 conversations to answer" in r.output
    assert make(whole, *common(tiny_dir, 8, "0.8"), *served(srv)).exit_code == 0
    assert sorted(convs(grown)) == sorted(convs(whole))
    assert len({str(m) for _, m in convs(whole)}) == 8


def test_ctrl_c_in_the_answers_then_a_rerun_equals_one_run(srv: dict, tiny_dir: Path,
                                                           tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    from draftsmith.data.regenerate import OpenAIBackend

    one, calls = OpenAIBackend.one, []

    def stopped(self, messages):  # the fourth request: ctrl-C
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return one(self, messages)

    cut, whole = tmp_path / "c", tmp_path / "w"
    args = [*common(tiny_dir, 8, "0.8"), *served(srv)]
    monkeypatch.setattr(OpenAIBackend, "one", stopped)
    r = make(cut, *args)
    assert r.exit_code == 130, r.output  # ctrl-C's exit
    kept = len(answers(cut))
    assert kept < 8 and not (cut / "dataset").exists()
    monkeypatch.setattr(OpenAIBackend, "one", one)
    again = make(cut, *args)
    assert again.exit_code == 0, again.output
    assert f"{8 - kept} conversations to answer" in again.output
    assert make(whole, *args).exit_code == 0
    assert convs(cut) == convs(whole)


def test_a_failed_request_stops_before_capture_and_a_rerun_completes(
        srv: dict, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from draftsmith.data.regenerate import Answer, OpenAIBackend

    one = OpenAIBackend.one
    out = tmp_path / "d"
    args = [*common(tiny_dir), *served(srv)]
    first_prompt: list = []

    def failing(self, messages):
        if not first_prompt:
            first_prompt.append(json.dumps(messages))
        if json.dumps(messages) == first_prompt[0]:
            return Answer("", 0, "error: HTTP 500: boom")
        return one(self, messages)

    monkeypatch.setattr(OpenAIBackend, "one", failing)
    r = make(out, *args)
    assert r.exit_code != 0
    said = str(r.exception)
    assert "regenerate: 1 of the 4 conversations asked failed (is the server at" in said
    assert "nothing was captured: rerun the same command" in said
    assert len(answers(out)) == 3 and not (out / "dataset").exists()
    monkeypatch.setattr(OpenAIBackend, "one", one)
    again = make(out, *args)
    assert again.exit_code == 0, again.output
    assert "1 conversations to answer" in again.output and len(answers(out)) == 4
