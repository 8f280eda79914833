"""Data-path review 9: capture past the target's positions, what a capture says it cut, a
self-made run whose rounds ran out, ranks captured otherwise, `data inspect`'s cut count."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from draftsmith.data.capture import CaptureConfig, capture, try_merge
from draftsmith.data.cli import app
from draftsmith.data.prompts import Conversation
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.data.shards import MANIFEST, Dataset
from draftsmith.errors import DraftsmithError


def talks() -> list[Conversation]:
    return [Conversation([{"role": "user", "content": "q" * 300},
                          {"role": "assistant", "content": "a" * 400}]),
            Conversation([{"role": "user", "content": "short?"},
                          {"role": "assistant", "content": "yes"}])]


def test_capture_past_the_targets_positions_is_cut_and_said(target, model, tmp_path):
    """--max-len 2048 on a target of 512 positions: a 740-token conversation was captured
    whole, its states past position 512 of positions the target never saw, without a word."""
    said: list[str] = []
    cfg = CaptureConfig(aux_layer_ids=[1], max_len=2048)
    m = capture(target, talks(), tmp_path, cfg, progress=False, model=model, log=said.append)
    most = target.cfg.max_position_embeddings
    assert m["max_len"] == most and m["input"]["truncated"] == 1
    assert max(Dataset(tmp_path).lengths()) == most
    assert any("exceeds the target's max_position_embeddings 512" in s for s in said), said


def test_capture_says_how_many_it_cut_and_skipped_and_to_what(target, model, tmp_path):
    """The line read "skipped 0, truncated to max_len 1": one conversation cut, not a
    --max-len of 1."""
    said: list[str] = []
    cfg = CaptureConfig(aux_layer_ids=[1], max_len=400)
    capture(target, talks(), tmp_path / "cut", cfg, progress=False, model=model, log=said.append)
    assert "capture: skipped none; 1 truncated to --max-len 400 tokens" in said, said
    said.clear()
    cfg = CaptureConfig(aux_layer_ids=[1], max_len=400, too_long="skip")
    capture(target, talks(), tmp_path / "skip", cfg, progress=False, model=model,
            log=said.append)
    assert "capture: skipped 1 too_long; 0 truncated to --max-len 400 tokens" in said, said


def test_self_made_rounds_run_out_say_why_and_a_rerun_goes_on(target, model, tmp_path,
                                                            monkeypatch):
    """A target that asks one question in its first rounds: the run ended on "only 1 of 6
    unique prompts after 2 batches", with no word of why, that the prompt was kept, or what
    to do; and a rerun began after the last round that kept a prompt, so it made the rounds
    that kept none again, seeded alike: they kept none again (all of them, a rerun stuck)."""
    import draftsmith.engine.generate as G

    plain = G.run_generation

    def asks(rt, starts, new, params, stops):  # rounds 0 and 1: one question; then new ones
        gen, seed = plain(rt, starts, 1, params, stops), torch.initial_seed()
        texts = [f"question {seed} {i}?" if seed >= 1009 + 2 else "why is the sky blue?"
                 for i in range(len(starts))]
        gen.tokens = [target.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return gen

    monkeypatch.setattr(G, "run_generation", asks)
    out, said = tmp_path / "p.jsonl", []
    cfg = MagpieConfig(n=6, batch_size=3, max_new_tokens=24, min_chars=1, max_batches=2)
    stats = self_made_prompts(target, out, cfg, model, progress=False, log=said.append)
    assert stats["kept"] == 1 and stats["duplicates"] == 5
    for words in ("only 1 of 6", "after 2 rounds of 3", "5 duplicates", "the 1 are kept",
                  "rerun the same command"):
        assert words in said[-1], said[-1]
    stats = self_made_prompts(target, out, cfg, model, progress=False, log=said.append)
    rounds = [json.loads(x)["meta"]["round"] for x in out.read_text().splitlines()]
    assert stats["kept"] == 6 and rounds == [0, 2, 2, 2, 3, 3], rounds


def two_ranks(target, model, tmp_path, monkeypatch, dtypes=(torch.float32, torch.float32)):
    monkeypatch.setenv("WORLD_SIZE", "2")
    convs = talks() + [Conversation([{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}])
                           for i in range(4)]
    try:
        for rank in (1, 0):
            monkeypatch.setenv("RANK", str(rank))
            cfg = CaptureConfig(aux_layer_ids=[1], max_len=64, samples_per_shard=2,
                                dtype=dtypes[rank])
            capture(target, convs, tmp_path, cfg, progress=False, model=model.to(dtypes[rank]),
                    log=lambda s: None)
    finally:
        model.float()  # the module's model, shared


def test_a_rank_captured_otherwise_is_refused_before_its_work(target, model, tmp_path,
                                                            monkeypatch):
    """Rank 1 at bf16, rank 0 at fp32: rank 0 captured all its shards, then the merge refused
    naming the key alone ("differs from rank 0 in ['compute_dtype']")."""
    with pytest.raises(DraftsmithError) as e:
        two_ranks(target, model, tmp_path, monkeypatch, (torch.float32, torch.bfloat16))
    msg = str(e.value)
    assert "rank 0 was captured otherwise than rank 1" in msg
    assert "compute_dtype 'float32' against 'bfloat16'" in msg and "--overwrite" in msg
    assert not (tmp_path / "rank-0").exists()


def test_ranks_storing_another_dtype_are_not_merged(target, model, tmp_path, monkeypatch):
    """A rank's shards of another stored dtype were merged under rank 0's `dtype`."""
    two_ranks(target, model, tmp_path, monkeypatch)
    (tmp_path / MANIFEST).unlink()
    path = tmp_path / "rank-1" / MANIFEST
    m = json.loads(path.read_text())
    path.write_text(json.dumps({**m, "dtype": "float16"}))
    with pytest.raises(DraftsmithError, match=re.escape("dtype 'float16' against 'bfloat16'")):
        try_merge(tmp_path)


def test_inspect_says_how_many_conversations_were_cut(target, model, tmp_path):
    capture(target, talks(), tmp_path, CaptureConfig(aux_layer_ids=[1], max_len=400),
            progress=False, model=model, log=lambda s: None)
    r = CliRunner().invoke(app, ["inspect", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["truncated inputs"] == "1 cut to --max-len 400 tokens"


def test_vocab_of_an_unfinished_capture_says_it_counts_part(target, model, tmp_path,
                                                            monkeypatch):
    """A capture killed (or still running): `data vocab` counted its finished shards alone and
    said nothing of the rest."""
    import draftsmith.data.cli as C

    capture(target, talks(), tmp_path, CaptureConfig(aux_layer_ids=[1], max_len=400),
            progress=False, model=model, log=lambda s: None)
    path = tmp_path / MANIFEST
    m = json.loads(path.read_text())
    path.write_text(json.dumps({**m, "complete": False, "expected": {"shards": 3}}))
    said: list[str] = []
    monkeypatch.setattr(C, "say", said.append)
    r = CliRunner().invoke(app, ["vocab", str(tmp_path), "--size", "8"])
    assert r.exit_code == 0, r.output
    assert any("not yet complete (1 of 3 shards)" in s for s in said), said
