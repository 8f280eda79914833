"""Review 5 of `data make` and self-made prompts: seeds past 64 bits a round, NaN answers'
temperature, empty self-made prompts, make.json's stages of an earlier run, and a draft
vocabulary cut to the target's size without a word."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.data.prompts import read_jsonl_tail_safe
from draftsmith.data.selfmade import MagpieConfig, self_made_prompts
from draftsmith.errors import DraftsmithError

KW = dict(batch_size=4, max_len=96, max_new_tokens=8, prompt_tokens=48, vocab_size=16,
          progress=False)


def test_a_large_seed_makes_prompts(target, model, tmp_path):
    """A round's seed is seed * 1_000_003 + ...: --seed 10**14 (one torch takes) overflowed
    torch.manual_seed, a ValueError traceback after the model was built."""
    cfg = MagpieConfig(n=1, batch_size=2, max_new_tokens=8, min_chars=1, max_batches=1,
                       seed=10**14)
    stats = self_made_prompts(target, tmp_path / "p.jsonl", cfg, model, progress=False,
                              log=lambda s: None)
    assert stats["kept"] == len(read_jsonl_tail_safe(tmp_path / "p.jsonl"))


def test_make_refuses_a_seed_torch_cannot_take_and_a_nan_temperature(target, tmp_path):
    from draftsmith.data.pipeline import make_dataset

    out = tmp_path / "mk"
    for over, why in [({"seed": 2**64}, "--seed must be from"),
                      ({"temperature": float("nan")}, "--temperature must be a finite number"),
                      ({"temperature": float("inf")}, "--temperature must be a finite number")]:
        with pytest.raises(DraftsmithError, match=why):
            make_dataset(out, 2, target=target, log=lambda s: None, **(KW | over))
        assert not out.exists()


def test_min_chars_below_one_is_refused_it_kept_empty_prompts():
    for n in (0, -4):
        with pytest.raises(DraftsmithError, match=rf"--min-chars \({n}\) must be >= 1"):
            MagpieConfig(2, min_chars=n)


def test_make_json_holds_only_the_stages_this_run_ran(target, tmp_path, monkeypatch):
    """A rerun that stopped in its answers kept the earlier run's capture and vocab results
    beside its own --n, as if they were of this run's data."""
    import draftsmith.data.regenerate as regenerate
    from draftsmith.data.pipeline import make_dataset

    out = tmp_path / "mk"
    out.mkdir()
    old = {"commands": ["data make earlier"], "n": 1,
           "stages": {"capture": {"seconds": 1.0, "result": {"samples": 1}},
                      "vocab": {"seconds": 0.1, "result": {"draft_vocab_size": 3}}}}
    (out / "make.json").write_text(json.dumps(old))

    def down(*a, **k):
        raise DraftsmithError("server down")

    monkeypatch.setattr(regenerate, "regenerate", down)
    with pytest.raises(DraftsmithError, match="server down"):
        make_dataset(out, 2, target=target, log=lambda s: None, command="data make now", **KW)
    made = json.loads((out / "make.json").read_text())
    assert set(made["stages"]) == {"prompts"} and made["n"] == 2
    assert made["commands"] == ["data make earlier", "data make now"]


def test_make_says_a_vocab_size_past_the_targets_vocabulary(tmp_path, monkeypatch):
    """--vocab-size over the target's vocabulary was cut to it in silence where the data held
    every token of it."""
    import draftsmith.data.vocab as V
    from draftsmith.data.pipeline import _vocab

    monkeypatch.setattr(V, "count_dataset",
                        lambda folder, size=None: torch.ones(8, dtype=torch.long))
    logs: list[str] = []
    summary = _vocab(tmp_path, 100, 8, logs.append)
    assert summary["draft_vocab_size"] == 8
    assert any(s.startswith("warning:") and "100" in s for s in logs), logs


def test_prompts_refuses_a_seed_torch_cannot_take_before_the_target_loads(tmp_path,
                                                                           monkeypatch):
    from typer.testing import CliRunner

    import draftsmith.targets as targets
    from draftsmith.data.cli import app

    def no_load(*a, **k):
        raise AssertionError("the target loaded")

    monkeypatch.setattr(targets, "load_target", no_load)
    r = CliRunner().invoke(app, ["prompts", "--self-made", "2", "-o", str(tmp_path / "p.jsonl"),
                                 "--device", "cpu", "--seed", str(2**64)])
    assert isinstance(r.exception, DraftsmithError), r.output
    assert "--seed must be from -2**63 to 2**64 - 1" in str(r.exception)


def _said(logs: list[str]) -> dict[str, str]:
    """The line each stage ends with, by stage: `prompts: ...` after `== prompts`."""
    lines: dict[str, str] = {}
    for name in ("prompts", "regenerate", "capture", "vocab"):
        at = logs.index(f"== {name}")
        ends = [s for s in logs[at + 1:] if s.startswith("== ")]
        end = logs.index(ends[0]) if ends else len(logs)
        lines[name] = [s for s in logs[at + 1:end] if s.startswith(f"{name}: ")][-1]
    return lines


def test_a_finished_rerun_says_each_stage_was_reused_and_a_grown_one_what_it_added(target,
                                                                                   tmp_path):
    """A rerun of finished stages said `prompts` with nothing after it and `regenerate: done_before
    3, answered 0, ...`: no line told that prompts, answers and shards were reused; a grown
    --n never said how many of each it added."""
    from draftsmith.data.pipeline import make_dataset

    logs: list[str] = []
    kw = KW | dict(target=target, log=logs.append)
    make_dataset(tmp_path, 3, **kw)
    first = _said(logs)
    assert first["prompts"] == "prompts: 3 made, 3 kept"
    assert first["regenerate"] == "regenerate: 3 answered"
    assert first["capture"] == "capture: 3 samples written"
    logs.clear()
    rec = make_dataset(tmp_path, 3, **kw)
    said = _said(logs)
    assert said["prompts"] == "prompts: reused (3 kept)"
    assert said["regenerate"] == "regenerate: reused (3 answers)"
    assert said["capture"] == "capture: reused (3 samples)"
    assert rec["stages"]["prompts"]["result"]["kept"] == 3  # make.json agrees with the lines
    assert rec["stages"]["capture"]["result"]["samples"] == 3
    assert logs[-1].startswith(f"{tmp_path / 'dataset'}: 3 samples, ")
    logs.clear()
    rec = make_dataset(tmp_path, 5, **kw)
    said = _said(logs)
    assert said["prompts"] == "prompts: 2 made, 5 kept (3 reused)"
    assert said["regenerate"].startswith("regenerate: 5 answered"), said
    assert said["capture"] == "capture: 5 samples written (2 more than before)"
    assert rec["stages"]["regenerate"]["result"]["answered"] == 5
    assert logs[-1].startswith(f"{tmp_path / 'dataset'}: 5 samples, ")


def test_a_rerun_with_a_smaller_n_says_fewer_samples_not_minus_more(target, tmp_path):
    from draftsmith.data.pipeline import make_dataset

    logs: list[str] = []
    kw = KW | dict(target=target, log=logs.append)
    make_dataset(tmp_path, 4, **kw)
    logs.clear()
    rec = make_dataset(tmp_path, 2, **kw)
    said = _said(logs)
    assert said["prompts"] == "prompts: reused (2 kept)", said  # of this --n, as make.json
    assert said["regenerate"] == "regenerate: reused (2 answers)", said
    assert said["capture"] == "capture: 2 samples written (2 fewer than before)", said
    assert rec["stages"]["capture"]["result"]["samples"] == 2


def test_capture_says_reused_only_for_the_same_shards_not_the_same_count():
    from draftsmith.data.pipeline import _said_capture

    m = {"samples": 3}
    old = {"samples": 3, "sha256": ["a"]}
    assert _said_capture(m, old, {"samples": 3, "sha256": ["a"]}) == "capture: reused (3 samples)"
    assert _said_capture(m, old, {"samples": 3, "sha256": ["b"]}) == "capture: 3 samples written"
    none = {"samples": 0, "sha256": None}
    assert _said_capture(m, none, {"samples": 3, "sha256": ["a"]}) == "capture: 3 samples written"
