"""Tune, nineteenth review: a --max-topk past the drafter's draft vocabulary refused under
--tp N before any rank spawns, in the same line as without --tp."""

from __future__ import annotations

import torch
from conftest import write_tiny_folder
from test_tune_cli import invoke_tune


def _small_vocab_pair(tmp_path):
    """A tiny target and a drafter of a 4-token draft vocabulary."""
    from draftsmith.models.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
    from draftsmith.targets import load_target

    folder = write_tiny_folder(tmp_path / "t", "llama")
    drafter = Eagle3Drafter(Eagle3Config.for_target(load_target(folder).cfg, 4, [0, 2, 4]))
    drafter.set_vocab(torch.zeros(4, dtype=torch.long), torch.arange(128) < 4)
    save_drafter(drafter, tmp_path / "d")
    return folder


def test_a_max_topk_past_the_draft_vocabulary_is_refused_before_tp_ranks_spawn(tmp_path,
                                                                                monkeypatch):
    """--tp 2 --max-topk 8 over a draft vocabulary of 4: two ranks were spawned, each loaded
    its prompts and checked the drafter, and the refusal came back as `rank 0: ...`."""
    from draftsmith import dist
    from draftsmith.errors import DraftsmithError

    folder = _small_vocab_pair(tmp_path)
    spawned = []
    monkeypatch.setattr(dist, "launch_tp", lambda *a, **k: spawned.append(a) or {})
    res = invoke_tune("--drafter", str(tmp_path / "d"), "--target", str(folder), "--device",
                      "cpu", "--max-topk", "8", "--tp", "2", "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError), res.exception
    assert str(res.exception) == ("--max-topk 8 exceeds the drafter's draft vocabulary of 4: "
                                  "give --max-topk 4 or less")
    assert spawned == [] and not (tmp_path / "o").exists()


def test_a_max_topk_within_the_draft_vocabulary_still_spawns_tp_ranks(tmp_path, monkeypatch):
    """--max-topk 4 (the whole draft vocabulary) under --tp 2 goes on to the ranks."""
    from draftsmith import dist

    folder = _small_vocab_pair(tmp_path)
    spawned = []
    monkeypatch.setattr(dist, "launch_tp", lambda *a, **k: spawned.append(a[1]) or {})
    res = invoke_tune("--drafter", str(tmp_path / "d"), "--target", str(folder), "--device",
                      "cpu", "--max-topk", "4", "--tp", "2", "--out", str(tmp_path / "o"))
    assert res.exception is None, res.exception
    assert spawned == [2]


def test_an_empty_prompt_file_is_refused_before_tp_ranks_spawn(tmp_path, monkeypatch):
    """An empty --prompts file under --tp 2: each spawned rank read it and refused it, the
    error coming back as `rank 0: --prompts ...` once every rank had started."""
    from draftsmith import dist
    from draftsmith.errors import DraftsmithError

    folder = _small_vocab_pair(tmp_path)
    (empty := tmp_path / "empty.jsonl").write_text("")
    spawned = []
    monkeypatch.setattr(dist, "launch_tp", lambda *a, **k: spawned.append(a) or {})
    res = invoke_tune("--drafter", str(tmp_path / "d"), "--target", str(folder), "--device",
                      "cpu", "--max-topk", "4", "--prompts", str(empty), "--tp", "2",
                      "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError), res.exception
    assert str(res.exception).startswith(f"--prompts {empty}"), str(res.exception)
    assert spawned == [] and not (tmp_path / "o").exists()
