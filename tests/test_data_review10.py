"""Data-path review 10: self-made rounds of --batch-size rows (review 11: whatever --n),
`data vocab` reading a manifest's `complete` as train and the doctor read it, and `data make`
refusing a training run's folder without importing the trainer."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.cli import app
from draftsmith.data.prompts import Conversation
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.data.shards import MANIFEST
from draftsmith.errors import DraftsmithError


def spy_rows(monkeypatch) -> list[tuple[int, int]]:
    """(rows decoded, the runtime's rows) of each self-made round."""
    import draftsmith.engine.generate as G

    plain, seen = G.run_generation, []

    def counted(rt, starts, *a, **kw):
        seen.append((len(starts), rt.max_batch))
        return plain(rt, starts, *a, **kw)

    monkeypatch.setattr(G, "run_generation", counted)
    return seen


def test_a_round_decodes_batch_size_rows_whatever_n(target, model, tmp_path, monkeypatch):
    """Rounds of the rows still wanted (5 wanted: 7 rows) drew other questions under each --n,
    so `data make` grown from --n 5 was not a fresh run of the larger --n (review 11)."""
    seen = spy_rows(monkeypatch)
    cfg = MagpieConfig(n=5, batch_size=16, max_new_tokens=12, min_chars=1, seed=2)
    stats = self_made_prompts(target, tmp_path / "p.jsonl", cfg, model, progress=False)
    assert stats["kept"] == 5
    assert seen and all(x == (16, 16) for x in seen), seen


def test_a_compiled_run_keeps_whole_batches():
    """Each row count compiles a decode step of its own: a compiled run's rounds stay whole."""
    from draftsmith.data.selfmade import _rows

    assert _rows(MagpieConfig(n=100, batch_size=32)) == _rows(MagpieConfig(n=5, batch_size=32))
    assert _rows(MagpieConfig(n=5, batch_size=32)) == 32


def test_whole_rounds_and_a_resumed_run_equals_an_uninterrupted_one(
        target, model, tmp_path, monkeypatch):
    """A round's seed follows the prompts kept before it, so a run killed in its last round
    and rerun writes what an uninterrupted run writes."""
    import draftsmith.engine.generate as G

    plain, seen = G.run_generation, []

    def asks(rt, starts, new, params, stops):  # questions drawn from the seeded generator
        seen.append(len(starts))
        gen = plain(rt, starts, 1, params, stops)
        texts = [f"question {int(torch.randint(0, 40, ()))}?" for _ in starts]
        gen.tokens = [target.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return gen

    monkeypatch.setattr(G, "run_generation", asks)
    cfg = MagpieConfig(n=9, batch_size=4, max_new_tokens=24, min_chars=1, seed=5,
                       openings=("Why", "How", "List"))
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    self_made_prompts(target, whole, cfg, model, progress=False)
    rounds = [json.loads(x)["meta"]["round"] for x in whole.read_text().splitlines()]
    assert seen == [4] * len(seen) and len(seen) > 2, (seen, rounds)
    kill_at = 2 * len(seen) - 1  # the second run's last round, once

    def killed_in_the_last_round(*a, **kw):
        if len(seen) == kill_at:
            seen.append(0)
            raise KeyboardInterrupt
        return asks(*a, **kw)

    monkeypatch.setattr(G, "run_generation", killed_in_the_last_round)
    with pytest.raises(KeyboardInterrupt):
        self_made_prompts(target, part, cfg, model, progress=False)
    self_made_prompts(target, part, cfg, model, progress=False)
    assert part.read_text() == whole.read_text()


def talks() -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"answer number {i}."}])
            for i in range(4)]


@pytest.fixture()
def data(target, model, tmp_path):
    capture(target, talks(), tmp_path / "d", CaptureConfig(aux_layer_ids=[1], max_len=64,
                                                           samples_per_shard=2),
            progress=False, model=model, log=lambda s: None)
    return tmp_path / "d"


def edit(folder, **changes) -> None:
    path = folder / MANIFEST
    m = json.loads(path.read_text())
    m.update(changes)
    path.write_text(json.dumps({k: v for k, v in m.items() if v is not None}))


def vocab_said(folder, monkeypatch) -> tuple[int, list[str]]:
    import draftsmith.data.cli as C

    said: list[str] = []
    monkeypatch.setattr(C, "say", said.append)
    r = CliRunner().invoke(app, ["vocab", str(folder), "--size", "8"])
    if r.exception is not None and not isinstance(r.exception, (SystemExit, DraftsmithError)):
        raise r.exception
    return r.exit_code, said + ([str(r.exception)] if r.exception else [])


def test_vocab_reads_a_manifest_without_complete_as_whole(data, monkeypatch):
    """Train and the doctor read a manifest without `complete` (an external tool's) as whole;
    `data vocab` warned it was a capture not yet complete, and inspect said complete false."""
    m = json.loads((data / MANIFEST).read_text())
    del m["complete"]
    (data / MANIFEST).write_text(json.dumps(m))
    code, said = vocab_said(data, monkeypatch)
    assert code == 0, said
    assert not any("not yet complete" in s for s in said), said
    r = CliRunner().invoke(app, ["inspect", str(data), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["complete"] is True


def test_vocab_of_a_rank_part_or_a_manifest_without_vocab_size_is_refused_by_name(
        data, monkeypatch):
    """One rank's folder was counted as the dataset (half its shards, no word); a manifest
    without vocab_size or target was a KeyError traceback."""
    edit(data, world_size=2, rank=1)
    code, said = vocab_said(data, monkeypatch)
    assert code != 0 and "rank 1's part of a 2-process capture" in said[-1], said
    assert "data merge" in said[-1]
    edit(data, world_size=1, rank=0)
    m = json.loads((data / MANIFEST).read_text())
    m.pop("vocab_size"), m.pop("target")
    (data / MANIFEST).write_text(json.dumps(m))
    code, said = vocab_said(data, monkeypatch)
    assert code != 0 and "names no vocab_size" in said[-1], said
    m["vocab_size"] = 128
    (data / MANIFEST).write_text(json.dumps(m))
    code, said = vocab_said(data, monkeypatch)
    assert code == 0, said
    assert json.loads((data / "vocab.json").read_text())["made_from"]["target"] is None


def test_data_make_refuses_a_run_folder_without_importing_the_trainer(tmp_path, monkeypatch):
    """`data.pipeline` imported `train.loop` (the whole trainer) for three file names."""
    from draftsmith.data.pipeline import check_not_a_model

    monkeypatch.setitem(sys.modules, "draftsmith.train.loop", None)  # importing it fails
    (tmp_path / "train_log.jsonl").write_text("")
    with pytest.raises(DraftsmithError, match=r"a drafter or training run \(train_log.jsonl\)"):
        check_not_a_model(tmp_path)


def test_the_run_markers_name_the_files_a_training_run_writes():
    from draftsmith.data.pipeline import RUN_MARKERS
    from draftsmith.models.eagle3 import CONFIG_FILE
    from draftsmith.train import checkpoint, report

    assert {CONFIG_FILE, report.LOG, checkpoint.CHECKPOINTS} == RUN_MARKERS


def test_inspect_reads_a_manifest_train_reads(data):
    """A manifest without what draftsmith records beside the shards (an external tool's:
    no target, totals, convention words or dtype) trains, but `data inspect` was a KeyError."""
    m = json.loads((data / MANIFEST).read_text())
    for key in ("target", "totals", "aux_convention", "dtype", "complete"):
        m.pop(key)
    (data / MANIFEST).write_text(json.dumps(m))
    r = CliRunner().invoke(app, ["inspect", str(data), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["complete"] is True and info["samples"] == 4 and info["shards"] == 2
    assert info["target"] == "? (fingerprint ?)"
    assert info["same layers for vLLM/speculators"] == "?"


def test_vocab_never_replaces_a_datasets_vocab_unasked(data, monkeypatch):
    """`data vocab DATASET --size N` wrote over data make's vocab.safetensors, which a drafter
    may have been trained on (the README: an existing output is never written over unasked)."""
    assert vocab_said(data, monkeypatch)[0] == 0
    kept = (data / "vocab.safetensors").read_bytes()
    monkeypatch.setattr("draftsmith.data.cli.say", lambda s: None)
    r = CliRunner().invoke(app, ["vocab", str(data), "--size", "4"])
    assert isinstance(r.exception, DraftsmithError) and "--overwrite" in str(r.exception)
    assert (data / "vocab.safetensors").read_bytes() == kept
    r = CliRunner().invoke(app, ["vocab", str(data), "--size", "4", "--overwrite"])
    assert r.exit_code == 0 and (data / "vocab.safetensors").read_bytes() != kept
