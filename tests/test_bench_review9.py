"""A drafter whose d2t sends two draft ids to one target token: a sampled tree bench ran its
baseline (minutes) before the first speculative setting refused the drafter, losing the rows."""

from __future__ import annotations

import pytest
import torch

import draftsmith.bench.run as bench_run
from draftsmith.bench.run import BenchConfig, run_bench
from draftsmith.engine.sampling import SamplingParams
from draftsmith.errors import DraftsmithError


def _never(*_a, **_k):
    raise AssertionError("the baseline ran before the drafter was checked")


@pytest.fixture
def shared_d2t(monkeypatch):
    import draftsmith.bench.drafters as drafters

    real = drafters.get_drafter

    def shared(spec, target, model):
        drafter, warns = real(spec, target, model)
        with torch.no_grad():
            drafter.d2t[5] = int(drafter.d2t[3]) + 3 - 5  # draft ids 3 and 5: one target id
        return drafter, warns

    monkeypatch.setattr(drafters, "get_drafter", shared)


@pytest.mark.parametrize("topk, refused", [(2, True), (1, False)])
def test_a_sampled_tree_bench_refuses_the_drafter_before_its_baseline(tiny_llama_dir, shared_d2t,
                                                                      monkeypatch, topk,
                                                                      refused):
    monkeypatch.setattr(bench_run, "_baseline", _never)
    cfg = BenchConfig(target=str(tiny_llama_dir), drafter="random", steps=[2], topk=[topk],
                      num_draft_tokens=[4] if topk > 1 else [], num_prompts=1, max_new_tokens=4,
                      params=SamplingParams(temperature=0.7))
    if refused:
        with pytest.raises(DraftsmithError, match="draft ids 3 and 5 to one target id"):
            run_bench(cfg, log=lambda s: None)
    else:  # a sampled chain keeps the target's distribution with it: the baseline runs
        with pytest.raises(AssertionError, match="the baseline ran"):
            run_bench(cfg, log=lambda s: None)
