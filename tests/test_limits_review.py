"""Limits across commands: no command decodes past the target's positions, --compile where it
does nothing is refused alike everywhere, and `data make` stops at the stage that left nothing."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import write_tiny_folder
from test_bench import drafter_dir  # noqa: F401 (a fixture)
from test_cli_review import run_main
from test_cli_review2 import prompts_file

from draftsmith.errors import DraftsmithError
from draftsmith.targets import Target


def _no_weights(monkeypatch) -> None:
    def build(*_a, **_k):
        raise AssertionError("weights loaded before the check")

    monkeypatch.setattr(Target, "build", build)


def test_tune_refuses_to_decode_past_the_targets_positions(tiny_llama_dir, drafter_dir,  # noqa: F811
                                                           tmp_path, monkeypatch):
    """-n 600 on a 512-position target was measured past the positions (bench, generate and
    serve refuse it); refused before the weights load."""
    from draftsmith.tune.cli import run_tune

    _no_weights(monkeypatch)
    with pytest.raises(DraftsmithError) as e:
        run_tune(drafter_dir, str(tiny_llama_dir), None, [1], 1, 600, 1, "cpu", torch.float32,
                 False, tmp_path / "o", max_topk=1)
    assert "the longest prompt + --max-new-tokens = " in str(e.value)
    assert str(e.value).endswith("exceeds the target's max_position_embeddings 512")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", [
    ["bench", "--drafter", "random"],
    ["serve"],
    ["tune", "--drafter", "DRAFTER"],
    ["data", "regenerate", "P", "-o", "a.jsonl"],
    ["data", "make", "mk"],
])
def test_compile_on_a_cpu_is_refused_by_every_engine_command(command, tiny_llama_dir,
                                                             drafter_dir,  # noqa: F811
                                                             monkeypatch, capsys, tmp_path):
    """It did nothing on a CPU (compiled layers run inside CUDA graphs only), yet bench.json
    recorded "compile": true, and serve, tune and data dropped it without a word."""
    _no_weights(monkeypatch)
    monkeypatch.chdir(tmp_path)
    prompts_file(tmp_path / "P", 2)
    args = [str(drafter_dir) if a == "DRAFTER" else a for a in command]
    code, _, err = run_main(monkeypatch, capsys, *args, "--target", str(tiny_llama_dir),
                            "--device", "cpu", "--compile")
    assert code == 2 and err.strip().splitlines() == [  # before anything is read or loaded
        "draftsmith: error: --compile applies only on a GPU (--device cuda): leave it out on the "
        "CPU"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["P"]  # nothing written


@pytest.fixture(scope="module")
def short_target(tmp_path_factory):
    """The tiny llama with 64 positions: a prompt of 40 characters renders to 59 tokens."""
    from draftsmith.targets import load_target

    return load_target(write_tiny_folder(tmp_path_factory.mktemp("short"), "llama",
                                         max_position_embeddings=64))


def test_regenerate_fits_prompt_and_answer_within_the_targets_positions(short_target, tmp_path):
    """--max-len 2048 on a 64-position target: a 59-token prompt took 20 new tokens, decoding
    to position 79. Now --max-len is held to the positions: the prompt is truncated (or, under
    --too-long skip, skipped) and counted as one past --max-len."""
    from draftsmith.data.prompts import Conversation
    from draftsmith.data.regenerate import RegenConfig, regenerate_file

    t = short_target
    convs = [Conversation([{"role": "user", "content": "x" * 40}], "p0")]
    out, logs = tmp_path / "a.jsonl", []
    cfg = RegenConfig(20, 2048, temperature=0.0, top_p=1.0, batch_size=1)
    stats = regenerate_file(convs, out, cfg, str(t.source), log=logs.append)
    assert (stats["truncated"], stats["answered"]) == (1, 1)
    rec = json.loads(out.read_text())
    asked = len(t.chat_ids(rec["messages"][:1]))
    assert asked + rec["meta"]["answers"][0]["tokens"] <= 64
    assert logs[0] == ("regenerate: warning: --max-len 2048 exceeds the target's "
                       "max_position_embeddings 64: prompts are held to 44 tokens (64 less "
                       "--max-new-tokens 20; longer ones: --too-long truncate)")
    skip = RegenConfig(20, 2048, "skip", temperature=0.0, top_p=1.0, batch_size=1)
    stats = regenerate_file(convs, tmp_path / "b.jsonl", skip, str(t.source), log=logs.append)
    assert (stats["skipped_too_long"], stats["answered"]) == (1, 0)


def test_regenerate_refuses_an_answer_longer_than_the_positions(short_target, tmp_path,
                                                                monkeypatch):
    from draftsmith.data.prompts import Conversation
    from draftsmith.data.regenerate import RegenConfig, regenerate_file

    _no_weights(monkeypatch)
    convs = [Conversation([{"role": "user", "content": "hi"}], "p0")]
    with pytest.raises(DraftsmithError, match="^--max-new-tokens 64 leaves no room for a prompt "
                       "within the target's max_position_embeddings 64$"):
        regenerate_file(convs, tmp_path / "a.jsonl", RegenConfig(64, 2048),
                        str(short_target.source))
    assert not (tmp_path / "a.jsonl").exists()


def test_the_engine_backend_holds_its_own_answers_within_the_positions(short_target):
    """A caller building the backend itself (as `data make` does) gets the same limit."""
    from draftsmith.data.regenerate import EngineBackend, RegenConfig

    model = short_target.build(torch.float32)
    backend = EngineBackend(short_target, model, RegenConfig(20, 2048, batch_size=1))
    assert backend.cfg.max_len == 64 and backend.rt.max_seq == 65


def _make(target, out, **over):
    from draftsmith.data.pipeline import make_dataset

    kw = dict(target=target, batch_size=4, max_len=96, max_new_tokens=8, prompt_tokens=48,
              vocab_size=40, log=lambda s: None, progress=False)
    return make_dataset(out, 3, **(kw | over))


def test_make_stops_after_a_prompts_stage_that_kept_none(target, tmp_path):
    """Every self-made prompt unfinished within --prompt-tokens 1: the run went on to capture
    and stopped there with "no conversation has assistant tokens to capture ({})"."""
    with pytest.raises(DraftsmithError) as e:
        _make(target, tmp_path, prompt_tokens=1)
    msg = str(e.value)
    assert msg.startswith("data make: the target's self-made prompts were all dropped (0 "
                          "duplicates, ")
    assert re.search(r" unfinished within --prompt-tokens 1, 0 bare openings, \d+ holding the "
                     r"chat template's tokens\): raise --prompt-tokens", msg), msg
    record = json.loads((tmp_path / "make.json").read_text())
    assert set(record["stages"]) == {"prompts"} and record["stages"]["prompts"]["result"][
        "kept"] == 0
    assert not (tmp_path / "answers.jsonl").exists()


def test_make_stops_after_a_regenerate_stage_that_answered_none(target, tmp_path):
    """--max-len 30 less --max-new-tokens 12 leaves 18 prompt tokens, fewer than the chat
    template's own: every prompt skipped, and the run stopped at capture, vaguely."""
    with pytest.raises(DraftsmithError, match=r"^data make: the target answered no prompt \(3 "
                       r"longer than --max-len 30 - --max-new-tokens 12, 0 refused by the chat "
                       r"template, 0 failed\): raise --max-len or lower --max-new-tokens$"):
        _make(target, tmp_path, max_len=30, max_new_tokens=12)
    assert set(json.loads((tmp_path / "make.json").read_text())["stages"]) == {
        "prompts", "regenerate"}
    assert not (tmp_path / "dataset").exists()
