"""Capture, tenth review: a single-process capture and a multi-process (torchrun) one into one
--out at once, each removing or listing the other's files; the hold refuses either, and ends
with the run that failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import Dataset, verify
from draftsmith.errors import DraftsmithError

CFG = CaptureConfig(aux_layer_ids=[-1, 0, 5], batch_size=2, samples_per_shard=2, max_len=64)


def convs(n: int = 5) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"q{i}?"},
                          {"role": "assistant", "content": f"a{i}."}]) for i in range(n)]


def run(target, model, out: Path, **kw) -> dict:
    return capture(target, convs(), out, CFG, progress=False, model=model, log=lambda s: None,
                   **kw)


def busy(out: Path) -> str:
    return (f"--out {out}: another `draftsmith data capture` is writing into it; wait for it "
            "to end (a rerun of the same command then resumes it) or capture into another --out")


def as_rank(monkeypatch, rank: int | None, world: int = 2) -> None:
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))


def test_a_torchrun_overwrite_into_a_folder_one_process_writes_is_refused(
        target, model, tmp_path, monkeypatch):
    """Rank 0's --overwrite removed the single process's manifest and shards as it wrote them;
    its manifest then listed files that were gone."""
    out, said = tmp_path / "d", []
    whole = run(target, model, tmp_path / "whole")

    def rank_starts(k: int) -> None:
        if k == 0:
            as_rank(monkeypatch, 0)
            try:
                with pytest.raises(DraftsmithError) as e:
                    run(target, model, out, overwrite=True)
                said.append(str(e.value))
            finally:
                as_rank(monkeypatch, None)

    assert run(target, model, out, on_shard=rank_starts) == whole
    assert said == [busy(out)]
    assert not list(out.glob("rank-*"))
    verify(out)
    assert len(Dataset(out)) == 5


def test_one_process_overwriting_a_folder_ranks_write_is_refused(
        target, model, tmp_path, monkeypatch):
    """The single process's --overwrite removed the ranks' folders while they wrote in them."""
    out, said = tmp_path / "d", []

    def one_process_starts(k: int) -> None:
        if k == 0:
            as_rank(monkeypatch, None)
            try:
                with pytest.raises(DraftsmithError) as e:
                    run(target, model, out, overwrite=True)
                said.append(str(e.value))
            finally:
                as_rank(monkeypatch, 0)

    as_rank(monkeypatch, 0)
    part = run(target, model, out, on_shard=one_process_starts)
    assert said == [busy(out)]
    assert part["complete"] and [s["index"] for s in part["shards"]] == [0, 2]
    as_rank(monkeypatch, 1)
    merged = run(target, model, out)
    assert merged["rank"] is None and merged["totals"]["samples"] == 5
    verify(out)


def test_the_hold_ends_with_a_run_that_failed(target, model, tmp_path, monkeypatch):
    """A rank stopped by an error mid-capture holds neither --out nor its own folder after."""
    out = tmp_path / "d"
    as_rank(monkeypatch, 0)

    def fail(k: int) -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        run(target, model, out, on_shard=fail)
    as_rank(monkeypatch, None)
    with pytest.raises(DraftsmithError, match="unfinished 2-process capture"):
        run(target, model, out)
    assert run(target, model, out, overwrite=True)["totals"]["samples"] == 5
