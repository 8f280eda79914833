"""Tune, ninth review: a tensor-parallel tune's engine flags name the TP size, and tune-nccl's
table prints a checkpoint path as written."""

from __future__ import annotations

import pytest
from test_tune_review import _tree_choice

from draftsmith.tune.cost_model import Measurement, SpecSetting, recommend
from draftsmith.tune.flags import (
    export_paths,
    recommendation_text,
    sglang_flags,
    vllm_flags,
)


def _chain_choice():
    (rec,) = recommend([], [Measurement(SpecSetting.baseline(), 1, 90.0),
                            Measurement(SpecSetting(3), 1, 150.0, accept_length=2.5)])
    return rec


def test_tp_flags_are_named_where_tp_is_over_one():
    """`tune --tp 2` printed flags that served the target unsharded: SGLang's `--tp-size` and
    vLLM's `--tensor-parallel-size` were missing."""
    chain = SpecSetting(3)
    assert sglang_flags(chain, "/d", tp=2).startswith("--tp-size 2 --speculative-algorithm")
    assert vllm_flags(chain, "/d", tp=4).startswith("--tensor-parallel-size 4 --speculative")
    assert "--tp-size" not in sglang_flags(chain, "/d") and "tensor-parallel" not in vllm_flags(
        chain, "/d", tp=1)
    text = recommendation_text(_chain_choice(), "runs/d", exports=export_paths("runs/d"), tp=2)
    assert "  SGLang: --tp-size 2 --speculative-algorithm EAGLE3" in text
    assert "  vLLM:   --tensor-parallel-size 2 --speculative-config" in text
    assert "tp-size" not in recommendation_text(_chain_choice(), "runs/d", tp=1)


def test_a_tree_whose_vllm_chain_is_no_speculation_still_names_the_tp_size():
    rec = _tree_choice({0: 90.0, 1: 80.0, 2: 70.0})
    text = recommendation_text(rec, "runs/d", exports=export_paths("runs/d"), tp=2)
    assert "  vLLM:   --tensor-parallel-size 2 (serve without --speculative-config)" in text
    one = recommendation_text(rec, "runs/d", exports=export_paths("runs/d"), tp=1)
    assert "  vLLM:   (serve without --speculative-config)" in one


def test_the_tp_size_defaults_to_the_ranks_tune_runs_in(monkeypatch):
    """tune's ranks (spawned or torchrun) are one TP group of every process: the text built on
    rank 0 names that size without being told."""
    import torch.distributed as dist

    assert "tp-size" not in recommendation_text(_chain_choice(), "runs/d")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert "--tp-size 2" in recommendation_text(_chain_choice(), "runs/d")
    assert "--tp-size" not in recommendation_text(_chain_choice(), "runs/d", tp=1)


@pytest.mark.parametrize("label", ["ckpt/llama[v2]/m", "ckpt/[/x]/m"])
def test_nccl_table_prints_a_bracketed_checkpoint_path_as_written(label, capsys, monkeypatch):
    """The table's title went through rich markup: `[v2]` vanished and `[/x]` raised a
    MarkupError after nccl.json was written."""
    from draftsmith.tune import nccl

    monkeypatch.setenv("COLUMNS", "300")
    report = {"tp": 2, "target_label": label, "device": "cpu", "shapes": [[1, 4]],
              "results": [{"setting": "NCCL_PROTO=[LL]", "status": "failed"}],
              "recommendation": {"per_shape": [], "overall": None, "note": "every setting failed"}}
    nccl.print_report(report)
    out = capsys.readouterr().out
    assert f"NCCL sweep, TP 2, {label}," in out and "NCCL_PROTO=[LL]" in out


@pytest.mark.parametrize("given", [".", "..", "./"])
def test_export_folders_of_a_dot_drafter_lie_beside_it(given, tmp_path, monkeypatch):
    """`tune --drafter .` printed `--out .-sglang`: a folder inside the drafter's, which export
    refuses, so the printed commands failed."""
    from pathlib import Path

    (tmp_path / "d").mkdir()
    monkeypatch.chdir(tmp_path / "d")
    drafter = Path(given).resolve()
    for path in export_paths(Path(given)).values():
        out = Path(path).resolve()
        assert out.parent == drafter.parent and out.name.startswith(drafter.name + "-")
    assert export_paths("runs/d") == {"sglang": "runs/d-sglang",
                                      "speculators": "runs/d-speculators"}
