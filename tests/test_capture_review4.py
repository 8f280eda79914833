"""Capture, fourth review: a resumed capture of the same conversations whose tokens changed (cut
turns, an API caller's own ids), a grown one whose kept samples changed so, and a capture resumed
with another number of processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import MANIFEST, Dataset, read_manifest, verify
from draftsmith.errors import DraftsmithError

CFG = CaptureConfig(aux_layer_ids=[-1, 0, 5], batch_size=4, samples_per_shard=2, max_len=400)


def convs(n: int = 5, cut: int | None = None) -> list[Conversation]:
    """`cut`: that conversation's answer recorded as cut at max tokens (no closing, as a
    regenerate run that hit --max-new-tokens records it), its messages and id the same."""
    return [Conversation([{"role": "user", "content": f"q{i}?"},
                          {"role": "assistant", "content": f"a{i}."}],
                         meta={"answers": [{"turn": 0, "finish": "length"}]} if i == cut else {})
            for i in range(n)]


def run(target, model, out: Path, cs: list[Conversation], **kw) -> dict:
    return capture(target, cs, out, CFG, progress=False, model=model, log=lambda s: None, **kw)


def stop_after_first(k: int) -> None:
    raise KeyboardInterrupt


def tokens(folder: Path) -> list[tuple[list[int], list[bool]]]:
    d = Dataset(folder)
    return [tuple(t.tolist() for t in d.tokens(i)) for i in range(len(d))]


@pytest.mark.parametrize("before, after", [
    (convs(), convs(cut=4)),  # the answers regenerated: one cut at max tokens now
    ([Conversation([{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "x"}],
                   id=f"c{i}") for i in range(5)],
     [Conversation([{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "yz"}],
                   id=f"c{i}") for i in range(5)]),  # the caller's ids, other answers
])
def test_a_resume_of_the_same_conversations_with_other_tokens_is_refused(
        target, model, tmp_path, before, after):
    """The digest was of the conversations' ids alone: a resume added shards of the new
    tokens to those of the old ones, one dataset of two inputs, without a word."""
    out, fresh = tmp_path / "data", tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        run(target, model, out, before, on_shard=stop_after_first)
    with pytest.raises(DraftsmithError, match=r"holds a dataset of the same conversations, but "
                       r"they encode to other tokens"):
        run(target, model, out, after)
    assert len(read_manifest(out)["shards"]) == 1
    run(target, model, out, after, overwrite=True)
    run(target, model, fresh, after)
    assert tokens(out) == tokens(fresh)


def test_a_grown_capture_redoes_kept_samples_whose_tokens_changed(target, model, tmp_path):
    """grow kept every shard whose sample ids matched: one whose answers were cut since kept
    the old tokens, unlike a capture of the input from scratch."""
    out, fresh = tmp_path / "data", tmp_path / "fresh"
    run(target, model, out, convs(4))
    grown, logs = convs(5, cut=1), []
    capture(target, grown, out, CFG, progress=False, model=model, log=logs.append, grow=True)
    assert any("2/3 shards to write" in s for s in logs)  # shard 0 (sample 1 cut) and shard 2
    run(target, model, fresh, grown)
    assert tokens(out) == tokens(fresh)
    assert read_manifest(out)["tokens_digest"] == read_manifest(fresh)["tokens_digest"]
    verify(out)


def test_a_manifest_from_before_the_tokens_digest_resumes(target, model, tmp_path):
    """An older draftsmith's manifest records no tokens_digest: it resumes as before."""
    import json

    with pytest.raises(KeyboardInterrupt):
        run(target, model, tmp_path, convs(), on_shard=stop_after_first)
    m = json.loads((tmp_path / MANIFEST).read_text())
    del m["tokens_digest"]
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    assert run(target, model, tmp_path, convs())["totals"]["samples"] == 5


def test_a_multi_process_capture_resumed_by_one_process_is_refused(
        target, model, tmp_path, monkeypatch):
    """One process captured everything again beside the ranks' shards, which stayed on disk."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run(target, model, tmp_path, convs())
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    with pytest.raises(DraftsmithError, match=r"holds an unfinished 2-process capture \(rank-1\)"
                       r": resume it with 2 processes \(torchrun\), or use another folder or "
                       r"--overwrite"):
        run(target, model, tmp_path, convs())
    assert not (tmp_path / MANIFEST).exists() and not list(tmp_path.glob("shard-*"))
    run(target, model, tmp_path, convs(), overwrite=True)
    assert not (tmp_path / "rank-1").exists() and verify(tmp_path)["samples"] == 5


def test_a_rank_folder_of_a_wider_capture_is_refused(target, model, tmp_path, monkeypatch):
    """A 3-process capture's rank 2 left its part; a 2-process one never merged (the stale part
    is incomplete) or merged into an error only after all its work."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    run(target, model, tmp_path, convs())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DraftsmithError, match=r"rank 0 was captured otherwise than rank 2 "
                       r"\(world_size 2 against 3\)"):
        run(target, model, tmp_path, convs())
    assert not (tmp_path / "rank-0").exists()
    run(target, model, tmp_path, convs(), overwrite=True)  # rank 0 removes the wider run's part
    monkeypatch.setenv("RANK", "1")
    assert run(target, model, tmp_path, convs())["totals"]["samples"] == 5
    assert not (tmp_path / "rank-2").exists() and verify(tmp_path)["shards"] == 3


def test_an_empty_list_of_aux_layers_is_refused_not_the_defaults(target, model, tmp_path):
    """`aux_layer_ids=[]` (an API caller's filtered list, emptied) captured the default layers
    without a word, the manifest recording layers nobody asked for."""
    cfg = CaptureConfig(aux_layer_ids=[], samples_per_shard=2)
    with pytest.raises(DraftsmithError, match=r"^--aux-layers: aux layer ids: the list is empty"):
        capture(target, convs(), tmp_path, cfg, progress=False, model=model, log=lambda s: None)
    assert not (tmp_path / MANIFEST).exists()
