"""Fifth review of data making: flags that did nothing refused, dtype and compile recorded with
answers and self-made prompts, a torn write's first record, a short shard read named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from draftsmith.data.cli import app
from draftsmith.data.prompts import Conversation, load_prompts, read_prompts
from draftsmith.errors import DraftsmithError

NEVER = "never-loaded-target"


def refusal(*args: str, env: dict[str, str] | None = None) -> str:
    res = CliRunner().invoke(app, list(args), env=env)
    assert isinstance(res.exception, DraftsmithError), (res.exit_code, res.output)
    return str(res.exception)


@pytest.fixture
def source(tmp_path) -> Path:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "why is the sky blue?"}) + "\n")
    return p


# --- flags that do nothing ---------------------------------------------------------------------


def test_seed_at_temperature_zero_is_refused_by_regenerate(source, tmp_path):
    out = tmp_path / "a.jsonl"
    said = refusal("regenerate", str(source), "-o", str(out), "--target", NEVER,
                   "--temperature", "0", "--seed", "3")
    assert said == ("--seed applies only to sampling (--temperature > 0): at temperature 0 "
                    "decoding is greedy; leave it out")
    assert not out.exists()


def test_seed_at_temperature_zero_is_refused_by_self_made_prompts(tmp_path):
    out = tmp_path / "p.jsonl"
    said = refusal("prompts", "--self-made", "4", "-o", str(out), "--target", NEVER,
                   "--temperature", "0", "--seed", "3", "--top-p", "0.5")
    assert said.startswith("--top-p, --seed apply only to sampling (--temperature > 0)")
    assert not out.exists()


def test_a_typed_api_key_without_a_server_is_refused(source, tmp_path):
    out = tmp_path / "a.jsonl"
    said = refusal("regenerate", str(source), "-o", str(out), "--target", NEVER,
                   "--api-key", "sk-123")
    assert said == "--api-key applies only to a server: give it with --base-url"


def test_an_api_key_from_the_environment_is_not_refused(source, tmp_path):
    """OPENAI_API_KEY set for other tools: the engine run goes on (here to the missing target,
    which is refused after the flags are checked)."""
    said = refusal("regenerate", str(source), "-o", str(tmp_path / "a.jsonl"), "--target",
                   NEVER, "--device", "cpu", env={"OPENAI_API_KEY": "sk-123"})
    assert "--api-key" not in said and NEVER in said


# --- an empty prompt source --------------------------------------------------------------------


@pytest.mark.parametrize("empty", ["", " "])
def test_an_empty_prompt_source_is_one_clear_error(empty, tmp_path, monkeypatch):
    """bench --suite '' read the working folder as a `datasets` folder and asked for the
    datasets package."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DraftsmithError, match="an empty prompt source"):
        read_prompts(empty)
    with pytest.raises(DraftsmithError, match="an empty prompt source"):
        load_prompts(empty)


def test_a_folder_named_on_purpose_is_still_read_as_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DraftsmithError, match=r"^\.: ") as err:
        read_prompts(".")
    assert "empty" not in str(err.value)


def _unused(c: Conversation) -> None:
    pass


# --- a shard cut short -------------------------------------------------------------------------


def _two_shards(folder: Path) -> None:
    import torch

    from draftsmith.data.shards import Sample, ShardWriter

    w = ShardWriter(folder, {"aux_layer_ids": [0, 1, 2], "hidden_size": 8}, ())
    for k in range(2):
        w.write(k, [Sample(f"s{k}", torch.arange(5), torch.ones(5, dtype=torch.bool),
                           torch.zeros(5, 3, 8), torch.zeros(5, 8))])
    w.finish()


def test_a_short_shard_read_names_the_shard(tmp_path):
    from draftsmith.data.shards import Dataset
    from draftsmith.train.reader import ShardReader

    _two_shards(tmp_path)
    reader = ShardReader(Dataset(tmp_path))
    assert reader[0]["hidden"].shape == (5, 8)
    shard = tmp_path / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-40])
    with pytest.raises(DraftsmithError, match=r"shard-00001.safetensors: shard read came back "
                       r"short \(\d+ of \d+ bytes\): the file is truncated"):
        reader[1]
    reader.close()
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")  # a torn header
    with pytest.raises(DraftsmithError, match=r"shard-00001.safetensors: unreadable shard"):
        ShardReader(Dataset(tmp_path))[1]


# --- dtype and compile recorded with engine answers --------------------------------------------


def _regen(target, model, out: Path, n: int, **over) -> dict[str, int]:
    from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate

    cfg = RegenConfig(**({"max_new_tokens": 4, "max_len": 64, "batch_size": 2,
                          "temperature": 1.0, "refill": False} | over))
    convs = [Conversation([{"role": "user", "content": f"question {i}"}], f"q{i}")
             for i in range(n)]
    return regenerate(convs, out, EngineBackend(target, model, cfg), target.tokenizer, cfg,
                      False, lambda s: None)


def _rewrite(out: Path, edit) -> None:
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    for r in recs:
        for a in r["meta"]["answers"]:
            edit(a)
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_regenerate_records_dtype_and_compile_and_refuses_a_rerun_at_another(target, model,
                                                                            tmp_path):
    """A rerun at another --dtype went on: the file held answers of two numerics, equal to
    neither run's."""
    out = tmp_path / "a.jsonl"
    _regen(target, model, out, 2)
    answers = [a for r in read_prompts(out) for a in r.meta["answers"]]
    assert {(a["dtype"], a["compile"]) for a in answers} == {("float32", False)}
    _rewrite(out, lambda a: a.update(dtype="bfloat16"))  # as a bf16 run wrote it
    before = out.read_bytes()
    with pytest.raises(DraftsmithError, match=r"a.jsonl:1: holds answers made with --dtype "
                       r"bfloat16, this run with --dtype float32: write to another file"):
        _regen(target, model, out, 4)
    assert out.read_bytes() == before
    _rewrite(out, lambda a: a.update(dtype="float32", compile=True))
    with pytest.raises(DraftsmithError, match=r"holds answers made with --compile, this run "
                       r"with no --compile: "):
        _regen(target, model, out, 4)
    # nothing left to answer: the file is read, not added to, whatever the numerics
    assert _regen(target, model, out, 2)["done_before"] == 2


def test_answers_without_a_recorded_dtype_still_resume(target, model, tmp_path):
    out = tmp_path / "old.jsonl"
    _regen(target, model, out, 2)
    _rewrite(out, lambda a: (a.pop("dtype"), a.pop("compile")))
    stats = _regen(target, model, out, 3)
    assert stats["done_before"] == 2 and stats["answered"] == 1


# --- dtype and compile recorded with self-made prompts -----------------------------------------


def _magpie(n: int, **over):
    from draftsmith.data.selfmade import BUILTIN_OPENINGS, MagpieConfig

    return MagpieConfig(**({"n": n, "batch_size": 4, "max_new_tokens": 24, "min_chars": 1,
                            "openings": BUILTIN_OPENINGS} | over))


def _rewrite_meta(out: Path, edit) -> None:
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    for r in recs:
        edit(r["meta"])
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_self_made_prompts_record_dtype_and_refuse_a_rerun_at_another(target, model, tmp_path):
    from draftsmith.data.selfmade import self_made_prompts

    out = tmp_path / "p.jsonl"
    self_made_prompts(target, out, _magpie(2), model, progress=False)
    assert {(c.meta["dtype"], c.meta["compile"]) for c in read_prompts(out)} == {
        ("float32", False)}
    _rewrite_meta(out, lambda m: m.update(dtype="bfloat16", compile=True))
    before = out.read_bytes()
    with pytest.raises(DraftsmithError, match=r"p.jsonl holds self-made prompts made otherwise "
                       r"\(--dtype bfloat16 there, --dtype float32 now; --compile there, no "
                       r"--compile now\): rerun with those settings"):
        self_made_prompts(target, out, _magpie(4), model, progress=False)
    assert out.read_bytes() == before
    # enough there: read at any numerics (a `data make` rerun in another dtype)
    assert self_made_prompts(target, out, _magpie(2), model, progress=False)["kept"] == 2


def test_self_made_prompts_without_a_recorded_dtype_still_resume(target, model, tmp_path):
    from draftsmith.data.selfmade import self_made_prompts

    out = tmp_path / "p.jsonl"
    self_made_prompts(target, out, _magpie(2), model, progress=False)
    _rewrite_meta(out, lambda m: (m.pop("dtype"), m.pop("compile")))
    assert self_made_prompts(target, out, _magpie(3), model, progress=False)["kept"] == 3


# --- a kill that tore a write's first record -----------------------------------------------------


def line_starts(data: bytes) -> list[int]:
    return [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")][:-1]


def test_a_torn_first_record_drops_no_whole_write(target, model, tmp_path):
    """A kill inside a chunk's first record: the chunk before it, written whole, was cut off too
    and answered again."""
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    _regen(target, model, whole, 8)
    data = whole.read_bytes()
    part.write_bytes(data[: line_starts(data)[4] + 30])  # inside chunk 2's first record
    stats = _regen(target, model, part, 8)
    assert (stats["done_before"], stats["answered"]) == (4, 4)
    assert part.read_bytes() == data


def test_a_kill_between_the_records_of_a_write_is_made_again_whole(target, model, tmp_path):
    """The file ended after chunk 1's first record, at a line's end: the rest of the chunk was
    answered alone, in a batch of one, sampled otherwise than the uninterrupted run."""
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    _regen(target, model, whole, 6)
    data = whole.read_bytes()
    part.write_bytes(data[: line_starts(data)[3]])
    stats = _regen(target, model, part, 6)
    assert (stats["done_before"], stats["answered"]) == (2, 4)
    assert part.read_bytes() == data


def test_a_torn_self_made_round_keeps_the_rounds_before(target, model, tmp_path, monkeypatch):
    """A kill inside a round's first prompt: the round before it, written whole, was made
    again too."""
    import draftsmith.engine.generate as generate
    from draftsmith.data.selfmade import self_made_prompts

    calls: list[int] = []
    real = generate.run_generation
    monkeypatch.setattr(generate, "run_generation",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    self_made_prompts(target, whole, _magpie(12), model, progress=False)
    data = whole.read_bytes()
    rounds = [json.loads(line)["meta"]["round"] for line in data.splitlines()]
    i = next(i for i in range(1, len(rounds)) if rounds[i] != rounds[i - 1])  # a round's first
    part.write_bytes(data[: line_starts(data)[i]])  # the rounds before, whole
    calls.clear()
    self_made_prompts(target, part, _magpie(12), model, progress=False)
    redone = len(calls)
    part.write_bytes(data[: line_starts(data)[i] + 20])  # and the next round's first, torn
    calls.clear()
    self_made_prompts(target, part, _magpie(12), model, progress=False)
    assert part.read_bytes() == data and len(calls) == redone


def test_an_unmarked_torn_file_still_drops_its_last_group(tmp_path):
    """Files written before the marks: the last chunk is cut as before (its write unknown)."""
    from draftsmith.data.prompts import appended_records, drop_last_write

    out = tmp_path / "old.jsonl"
    recs = [{"messages": [], "meta": {"round": r}} for r in (0, 0, 1, 1)]
    out.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"messages": [')
    records, torn = appended_records(out)
    assert torn and len(records) == 4
    kept = drop_last_write(out, records, lambda r: r["meta"]["round"])
    assert [r["meta"]["round"] for _, r in kept] == [0, 0]
    assert out.read_text() == "".join(json.dumps(r) + "\n" for r in recs[:2])
