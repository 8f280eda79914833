"""Reruns of the data stages into the same output: settings the results depend on are recorded
and a rerun made otherwise is refused; one shape check for shards, trainer and verify alike."""

from __future__ import annotations

import dataclasses
import json

import pytest

from draftsmith.data.prompts import Conversation, read_jsonl_tail_safe
from draftsmith.data.regenerate import EngineBackend, RegenConfig, regenerate
from draftsmith.errors import DraftsmithError


def asks(n: int) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"question {i}"}], f"q{i}")
            for i in range(n)]


def _regen(target, model, out, n: int, **over) -> dict[str, int]:
    cfg = RegenConfig(**({"max_new_tokens": 4, "max_len": 64, "batch_size": 2,
                          "temperature": 1.0, "refill": False} | over))
    return regenerate(asks(n), out, EngineBackend(target, model, cfg), target.tokenizer, cfg,
                      False, lambda s: None)


def test_a_regenerate_rerun_batched_otherwise_is_refused(target, model, tmp_path):
    """Sampled answers depend on the rows drawn together and the chunks seeded: a rerun at
    another --batch-size or --refill went on, its file equal to neither run's."""
    out = tmp_path / "a.jsonl"
    _regen(target, model, out, 2)
    before = out.read_bytes()
    with pytest.raises(DraftsmithError, match=r"a.jsonl:1: holds answers made with --batch-size "
                       r"2, this run with --batch-size 3: write to another file"):
        _regen(target, model, out, 4, batch_size=3)
    with pytest.raises(DraftsmithError, match=r"holds answers made with --no-refill, this run "
                       r"with --refill: "):
        _regen(target, model, out, 4, refill=True)
    assert out.read_bytes() == before
    # nothing left to answer: the file is read, not added to, whatever the batching
    assert _regen(target, model, out, 2, batch_size=3)["done_before"] == 2
    assert _regen(target, model, out, 4)["done_before"] == 2


def test_answers_without_a_recorded_batching_still_resume(target, model, tmp_path):
    """Files written before the batching was recorded resume under any setting."""
    out = tmp_path / "old.jsonl"
    _regen(target, model, out, 2)
    recs = read_jsonl_tail_safe(out)
    for r in recs:
        for a in r["meta"]["answers"]:
            assert (a.pop("batch_size"), a.pop("refill")) == (2, False)
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    stats = _regen(target, model, out, 3, batch_size=3, refill=True)
    assert stats["done_before"] == 2 and stats["answered"] == 1


def _shards(folder, n_aux: int = 3, h: int = 8):
    import torch

    from draftsmith.data.shards import Sample, ShardWriter

    w = ShardWriter(folder, {"aux_layer_ids": list(range(n_aux)), "hidden_size": h}, ())
    for k in range(2):
        w.write(k, [Sample(f"s{k}", torch.arange(5), torch.ones(5, dtype=torch.bool),
                           torch.zeros(5, n_aux, h), torch.zeros(5, h))])
    w.finish()


def test_verify_and_the_trainers_reader_name_foreign_widths_alike(tmp_path):
    """The reader's up-front check repeated part of `verify`'s, each with its own message."""
    from draftsmith.data.shards import Dataset, verify
    from draftsmith.train.reader import ShardReader

    _shards(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["aux_layer_ids"] = [0, 1]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    why = (r"shard-00000.safetensors: holds aux states \[3, 8\] and hidden \[8\] a token, but the "
           r"manifest says 2 aux layers of 8: a shard of another capture")
    with pytest.raises(DraftsmithError, match=why):
        verify(tmp_path, hashed=())
    with pytest.raises(DraftsmithError, match=why):
        ShardReader(Dataset(tmp_path)).check_shapes(2, 8)


def test_the_readers_shape_check_names_a_shard_with_a_broken_header(tmp_path):
    from draftsmith.data.shards import Dataset
    from draftsmith.train.reader import ShardReader

    _shards(tmp_path)
    reader = ShardReader(Dataset(tmp_path))
    reader.check_shapes(3, 8)
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"@@@@"
    shard.write_bytes(bytes(data))
    with pytest.raises(DraftsmithError, match=r"shard-00001.safetensors: unreadable shard"):
        reader.check_shapes(3, 8)


def test_self_made_prompts_rerun_with_another_set_of_openings_is_refused(target, model,
                                                                          tmp_path):
    """`mixed` starts with `builtin`'s openings, so the first prompt's opening passed for
    either: a rerun went on picking from the other set."""
    from draftsmith.data.selfmade import MagpieConfig, openings_from, self_made_prompts

    out = tmp_path / "p.jsonl"
    cfg = MagpieConfig(n=1, batch_size=4, max_new_tokens=48, min_chars=1,
                       openings=openings_from("builtin"))
    assert self_made_prompts(target, out, cfg, model, progress=False)["kept"] == 1
    before = out.read_bytes()
    mixed = MagpieConfig(n=3, batch_size=4, max_new_tokens=48, min_chars=1,
                         openings=openings_from("mixed"))
    with pytest.raises(DraftsmithError, match=r"p.jsonl holds self-made prompts made otherwise "
                       r"\(other --openings\)"):
        self_made_prompts(target, out, mixed, model, progress=False)
    assert out.read_bytes() == before
    # prompts written before the set was recorded: the first one's opening still decides
    [rec] = read_jsonl_tail_safe(out)
    del rec["meta"]["openings_id"]
    out.write_text(json.dumps(rec) + "\n")
    assert self_made_prompts(target, out, dataclasses.replace(mixed, n=1),
                             progress=False)["kept"] == 1


def test_self_made_prompts_past_the_targets_positions_are_refused(target, tmp_path):
    """--max-new-tokens past max_position_embeddings (512) decoded on past them, writing prompts
    of positions the target never saw; generate, bench and serve refuse them."""
    from draftsmith.data.selfmade import MagpieConfig, self_made_prompts

    out = tmp_path / "p.jsonl"
    cfg = MagpieConfig(n=1, batch_size=2, max_new_tokens=510, min_chars=1, max_batches=1)
    with pytest.raises(DraftsmithError, match=r"^self-made prompts: the longest prompt \+ "
                       r"--max-new-tokens 510 \(`data make`: --prompt-tokens\) = \d+ exceeds "
                       r"the target's max_position_embeddings 512$"):
        self_made_prompts(target, out, cfg, progress=False)
    assert not out.exists()


def test_a_truncated_prompt_is_a_prefix_of_the_one_given(target, model, tmp_path):
    """The cut decoded its first tokens: a character split by the cut came back as U+FFFD (the
    default target, CJK text), text the tokenizer cannot spell back as '<unk>' (here)."""
    text = "日本語 é " * 60
    cfg = RegenConfig(max_new_tokens=4, max_len=64, batch_size=2, temperature=0.0)
    out = tmp_path / "a.jsonl"
    stats = regenerate([Conversation([{"role": "user", "content": text}])], out,
                       EngineBackend(target, model, cfg), target.tokenizer, cfg, False,
                       lambda s: None)
    assert stats["truncated"] == 1 and stats["answered"] == 1
    [rec] = read_jsonl_tail_safe(out)
    cut = rec["messages"][0]["content"]
    assert cut and text.startswith(cut) and len(target.chat_ids([rec["messages"][0]])) <= 60
