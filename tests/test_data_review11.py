"""`data make` grown by --n equals a fresh run of the larger --n; the prompts stage reports
what this run keeps."""

from __future__ import annotations

import json

import pytest

from draftsmith.data.prompts import read_jsonl_tail_safe
from draftsmith.data.regenerate import RegenConfig, regenerate
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.data.shards import Dataset

KW = dict(batch_size=4, max_len=96, max_new_tokens=12, prompt_tokens=32, vocab_size=16,
          log=lambda s: None, progress=False)


def _shas(folder):
    return [s["sha256"] for s in Dataset(folder / "dataset").manifest["shards"]]


def test_a_grown_make_equals_a_fresh_one(target, tmp_path):
    """--n 2 then --n 6 made round 0's and chunk 0's draws again with fewer rows: the grown
    prompts and answers were neither a fresh --n 6's nor its shards."""
    from draftsmith.data.pipeline import make_dataset

    fresh, grown = tmp_path / "fresh", tmp_path / "grown"
    make_dataset(fresh, 6, target=target, **KW)
    make_dataset(grown, 2, target=target, **KW)
    make_dataset(grown, 6, target=target, **KW)
    assert _prompts(grown / "prompts.jsonl") == _prompts(fresh / "prompts.jsonl")
    assert (grown / "answers.jsonl").read_text() == (fresh / "answers.jsonl").read_text()
    assert _shas(grown) == _shas(fresh)


def test_grown_self_made_prompts_equal_a_fresh_run(target, model, tmp_path):
    """A round cut at --n is made again whole when --n grows, as a fresh run made it."""
    cfg = MagpieConfig(n=9, batch_size=4, max_new_tokens=24, min_chars=1, seed=2)
    fresh, grown = tmp_path / "fresh.jsonl", tmp_path / "grown.jsonl"
    self_made_prompts(target, fresh, cfg, model, progress=False)
    for n in (2, 5, 9):
        stats = self_made_prompts(target, grown, MagpieConfig(**{**_asdict(cfg), "n": n}), model,
                                  progress=False)
        assert stats["kept"] == n
    assert _prompts(grown) == _prompts(fresh)


def _prompts(path):
    """Each prompt and the round that made it (a record's `n` is its run's)."""
    return [(r["id"], r["messages"], r["meta"]["round"])
            for r in read_jsonl_tail_safe(path)]


def _asdict(cfg):
    from dataclasses import asdict

    return asdict(cfg)


def test_kept_says_what_this_run_keeps_of_a_larger_file(target, model, tmp_path):
    out = tmp_path / "p.jsonl"
    cfg = MagpieConfig(n=6, batch_size=4, max_new_tokens=24, min_chars=1, seed=1)
    self_made_prompts(target, out, cfg, model, progress=False)
    said: list[str] = []
    stats = self_made_prompts(target, out, MagpieConfig(**{**_asdict(cfg), "n": 2}), model,
                              progress=False, log=said.append)
    assert stats["kept"] == 2 and stats["in_file"] == 6
    assert any("holds 6 prompts" in s and "keeps its first 2" in s for s in said), said
    assert len(read_jsonl_tail_safe(out)) == 6  # nothing written is lost


def test_grown_regenerate_answers_equal_a_fresh_run(target, model, tmp_path):
    """The engine's last chunk, asked with fewer prompts than it now holds, is asked again
    whole; a server's answers (per-request seeds) are kept."""
    from draftsmith.data.prompts import Conversation
    from draftsmith.data.regenerate import EngineBackend

    convs = [Conversation([{"role": "user", "content": f"Say {w}."}])
             for w in ("one", "two", "three", "four", "five", "six")]
    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, temperature=0.8, seed=3)
    backend = EngineBackend(target, model, cfg)
    fresh, grown = tmp_path / "fresh.jsonl", tmp_path / "grown.jsonl"
    regenerate(convs, fresh, backend, target.tokenizer, cfg, progress=False, log=lambda s: None)
    regenerate(convs[:3], grown, backend, target.tokenizer, cfg, progress=False,
               log=lambda s: None)
    said = regenerate(convs, grown, backend, target.tokenizer, cfg, progress=False,
                      log=lambda s: None)
    assert grown.read_text() == fresh.read_text()
    assert said["done_before"] == 0 and said["answered"] == 6 and said["redone"] == 3
    again = regenerate(convs, grown, backend, target.tokenizer, cfg, progress=False,
                       log=lambda s: None)
    assert again["done_before"] == 6 and again["answered"] == 0
    assert [json.loads(x)["meta"]["prompt_id"] for x in grown.read_text().splitlines()] == \
        [c.id for c in convs]


def _six():
    from draftsmith.data.prompts import Conversation

    return [Conversation([{"role": "user", "content": f"Say {w}."}])
            for w in ("one", "two", "three", "four", "five", "six")]


def test_a_stopped_redo_keeps_the_answers_there(target, model, tmp_path, monkeypatch):
    """The grown chunk's earlier answers stay on disk until its whole answers are written."""
    from draftsmith.data.regenerate import EngineBackend

    convs = _six()
    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, temperature=0.8, seed=3)
    backend = EngineBackend(target, model, cfg)
    fresh, out = tmp_path / "fresh.jsonl", tmp_path / "a.jsonl"
    quiet = dict(progress=False, log=lambda s: None)
    regenerate(convs, fresh, backend, target.tokenizer, cfg, **quiet)
    regenerate(convs[:3], out, backend, target.tokenizer, cfg, **quiet)
    before = out.read_text()

    def stopped(batch):
        raise KeyboardInterrupt

    monkeypatch.setattr(backend, "answer", stopped)
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        regenerate(convs, out, backend, target.tokenizer, cfg, progress=False, log=said.append)
    assert out.read_text() == before
    assert any("keeps the 3 conversations" in s for s in said), said
    monkeypatch.undo()
    regenerate(convs, out, backend, target.tokenizer, cfg, **quiet)
    assert out.read_text() == fresh.read_text()


def test_greedy_answers_are_not_asked_again(target, model, tmp_path):
    """A greedy answer is its prompt's alone: a grown input keeps the answers there."""
    from draftsmith.data.regenerate import EngineBackend

    convs = _six()
    cfg = RegenConfig(max_new_tokens=8, max_len=64, batch_size=2, temperature=0.0)
    backend = EngineBackend(target, model, cfg)
    fresh, out = tmp_path / "fresh.jsonl", tmp_path / "a.jsonl"
    quiet = dict(progress=False, log=lambda s: None)
    regenerate(convs, fresh, backend, target.tokenizer, cfg, **quiet)
    regenerate(convs[:3], out, backend, target.tokenizer, cfg, **quiet)
    said = regenerate(convs, out, backend, target.tokenizer, cfg, **quiet)
    assert said["done_before"] == 3 and said["redone"] == 0
    texts = [json.loads(x)["messages"] for x in out.read_text().splitlines()]
    assert texts == [json.loads(x)["messages"] for x in fresh.read_text().splitlines()]


def test_a_file_of_other_prompts_is_not_taken_for_self_made_ones(target, model, tmp_path):
    """Four prompts from a file counted as self-made: --n 3 made none and said kept 3."""
    from draftsmith.errors import DraftsmithError

    out = tmp_path / "p.jsonl"
    text = "".join(json.dumps({"messages": [{"role": "user", "content": f"file prompt {i}"}],
                               "meta": {"source": "humaneval"}}) + "\n" for i in range(4))
    out.write_text(text)
    cfg = MagpieConfig(n=3, batch_size=4, max_new_tokens=16, min_chars=1)
    with pytest.raises(DraftsmithError, match=r"p\.jsonl:1: holds a prompt that is not self-made "
                       r"\(source 'humaneval'\).*--overwrite"):
        self_made_prompts(target, out, cfg, model, progress=False)
    assert out.read_text() == text
    assert self_made_prompts(target, out, cfg, model, progress=False, overwrite=True)["kept"] == 3
