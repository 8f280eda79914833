"""Review of data making: short targets' default layers, a resumed capture under another
spelling of the target's path, replies from another model, openings files with a BOM, and
progress off a terminal."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from test_data_capture import convs, shard_bytes
from test_data_regenerate import ok_reply, running

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.regenerate import OpenAIBackend, RegenConfig, regenerate
from draftsmith.data.selfmade import openings_from
from draftsmith.errors import DraftsmithError
from draftsmith.layers import default_aux_layers, validate
from draftsmith.targets import load_target

# --- short targets: three distinct states, or one clear refusal --------------------------------


def test_short_targets_default_to_three_distinct_layers():
    """A 3-layer target defaulted to [0, 1] (a 2-state drafter), a 2-layer one to [0]."""
    assert default_aux_layers(2) == default_aux_layers(3) == [-1, 0, 1]
    kept = {4: [0, 1, 2], 5: [0, 1, 3], 6: [0, 2, 4], 7: [1, 2, 3], 8: [1, 3, 4], 32: [1, 15, 28]}
    assert {n: default_aux_layers(n) for n in kept} == kept
    for n in range(2, 40):
        ids = validate(default_aux_layers(n), n)
        assert len(set(ids)) == 3 and ids == sorted(ids)
    with pytest.raises(DraftsmithError, match="1-layer target.*--aux-layers -1,0"):
        default_aux_layers(1)


def test_a_3_layer_target_captures_three_states_by_default(tmp_path):
    from conftest import write_tiny_folder

    t3 = load_target(write_tiny_folder(tmp_path / "t3", "llama", num_hidden_layers=3))
    cfg = CaptureConfig(batch_size=2, samples_per_shard=4, max_len=64)
    m = capture(t3, convs(2), tmp_path / "d", cfg, progress=False, log=lambda s: None)
    assert m["aux_layer_ids"] == [-1, 0, 1]


# --- a capture resumed with the target's path typed otherwise ---------------------------------


def test_a_capture_resumes_under_another_spelling_of_the_target(tiny_llama_dir, model, tmp_path,
                                                               monkeypatch):
    """The manifest compared the target's `source` as typed: a kill resumed with the absolute
    path (or from another folder) was refused as "a different target"."""
    cfg = CaptureConfig(aux_layer_ids=[0, 2, 4], batch_size=3, samples_per_shard=4, max_len=200)
    whole, part = tmp_path / "whole", tmp_path / "part"
    quiet = {"progress": False, "model": model, "log": lambda s: None}
    capture(load_target(tiny_llama_dir), convs(), whole, cfg, **quiet)

    def die(k: int) -> None:
        if k == 1:
            raise KeyboardInterrupt

    monkeypatch.chdir(tiny_llama_dir.parent)
    with pytest.raises(KeyboardInterrupt):
        capture(load_target(tiny_llama_dir.name), convs(), part, cfg, on_shard=die, **quiet)
    m = capture(load_target(str(tiny_llama_dir.resolve())), convs(), part, cfg, **quiet)
    assert m["complete"] and shard_bytes(part) == shard_bytes(whole)


# --- a server that answers with another model -------------------------------------------------


def naming_app(served: str) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.json()
        return ok_reply() | {"model": served}

    return app


def test_a_reply_from_another_model_stops_the_run(target, tmp_path):
    """A router's fallback answered; its answers were recorded as the asked model's."""
    cfg = RegenConfig(max_new_tokens=8, max_len=128, batch_size=2)
    asks = [Conversation([{"role": "user", "content": f"q {i}"}]) for i in range(3)]
    out = tmp_path / "a.jsonl"
    for served, asked in (("m", "m"), ("other-model", "m")):
        with running(naming_app(served)) as url:
            backend = OpenAIBackend(url, asked, cfg, concurrency=1, retries=0)
            try:
                if served == asked:
                    regenerate(asks[:2], out, backend, target.tokenizer, cfg, False,
                               lambda s: None)
                    before = out.read_bytes()
                    continue
                with pytest.raises(DraftsmithError, match=(
                        r"answered with model 'other-model', not 'm'.*--model other-model.*"
                        r"keeps the 2 conversations")):
                    regenerate(asks, out, backend, target.tokenizer, cfg, False, lambda s: None)
            finally:
                backend.close()
    assert out.read_bytes() == before


# --- openings files written on Windows --------------------------------------------------------


def test_an_openings_file_with_a_bom_and_crlf(tmp_path):
    """The BOM opened every prompt of the first opening with an invisible U+FEFF."""
    path = tmp_path / "o.txt"
    path.write_bytes(b"\xef\xbb\xbfWrite a poem\r\n\r\nExplain\r\n")
    assert openings_from(str(path)) == ("Write a poem", "Explain")
    path.write_bytes(b"\xff\xfeW\x00")
    with pytest.raises(DraftsmithError, match="--openings .*cannot read it as UTF-8"):
        openings_from(str(path))


# --- progress off a terminal ------------------------------------------------------------------


def test_progress_off_a_terminal_is_plain_lines(target, model, tmp_path, capsys):
    """tqdm's bar wrote one endless line of carriage returns into a log file."""
    said: list[str] = []
    cfg = CaptureConfig(aux_layer_ids=[0, 2, 4], batch_size=3, samples_per_shard=2, max_len=64)
    capture(target, convs(4), tmp_path / "d", cfg, model=model, log=said.append)
    err = capsys.readouterr().err
    assert "\r" not in err and "capture: 4/4 samples" in said[-1]
    said.clear()
    asks = [Conversation([{"role": "user", "content": f"q {i}"}]) for i in range(2)]
    regen = RegenConfig(max_new_tokens=4, max_len=64, batch_size=2, temperature=0.0)
    from draftsmith.data.regenerate import EngineBackend

    regenerate(asks, tmp_path / "a.jsonl", EngineBackend(target, model, regen), target.tokenizer,
               regen, True, said.append)
    assert "\r" not in capsys.readouterr().err
    assert any(s.startswith("regenerate: 2/2 convs") for s in said)
