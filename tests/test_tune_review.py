"""`draftsmith tune` edge cases from a review: options refused before loading, the settings
its limits allow, vLLM's flags for a tree choice, and acceptance where every answer ends at
once."""

from __future__ import annotations

import json

import pytest
import torch
from test_tune_cli import _tiny_pair, invoke_tune

from draftsmith.errors import DraftsmithError
from draftsmith.tune.cost_model import Measurement, SpecSetting, recommend


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 2"),
        (["--top-k", "20"], "--top-k and --top-p apply to sampling"),
        (["--top-p", "0.9"], "--top-k and --top-p apply to sampling"),
        (["--tp", "2", "--nccl-sweep", "--nccl-grid", "fast"], "--nccl-grid 'fast'"),
        (["--nccl-grid", "full"], "give --nccl-sweep with it"),  # it was ignored
    ],
)
def test_tune_refuses_options_before_loading(tmp_path, monkeypatch, args, says):
    """Each was found only after minutes of loading and measuring (--max-new-tokens 1: an
    obscure 'chain counts' error; --nccl-grid: after the whole tune), or never (--top-k at
    temperature 0 decoded greedily while the report recorded top-k)."""
    from draftsmith.tune import cli

    monkeypatch.setattr(cli, "run_tune", lambda *a, **k: pytest.fail("tune ran"))
    never = str(tmp_path / "never-loaded")
    res = invoke_tune("--drafter", never, "--target", never, "--device", "cpu", *args)
    assert isinstance(res.exception, DraftsmithError) and says in str(res.exception), (
        args, res.exception)


def test_tune_sweeps_each_batch_size_once(tmp_path, monkeypatch):
    """--batch-sizes 8,1,8 measured and swept batch 8 twice."""
    from draftsmith.tune import cli

    seen = []
    monkeypatch.setattr(cli, "run_tune", lambda *a, **k: seen.append(a[3]) or {"texts": []})
    res = invoke_tune("--drafter", str(tmp_path), "--device", "cpu", "--batch-sizes", "8,1,8",
                      "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.exception
    assert seen == [[1, 8]]


def test_tune_names_a_missing_drafter_before_loading_the_target(tmp_path, monkeypatch):
    import draftsmith.targets
    from draftsmith.tune.cli import run_tune

    monkeypatch.setattr(draftsmith.targets, "load_target",
                        lambda *a: pytest.fail("the target loaded before the drafter was read"))
    (prompts := tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(DraftsmithError, match="no such folder"):
        run_tune(tmp_path / "typo", "default", prompts, [1], 2, 4, 1, "cpu", torch.float32,
                 False, tmp_path / "o")


def test_max_draft_tokens_bounds_trees_not_chains():
    """--max-draft-tokens 4 with --max-steps 7 dropped chains of 4 steps and more from the
    predictions and the sweep (its help: the most tokens a tree may verify)."""
    from draftsmith.tune.cli import within

    limits = (7, 4, 4)
    assert all(within(SpecSetting(s), *limits) for s in range(1, 8))
    assert not within(SpecSetting(8), *limits)
    assert within(SpecSetting(3, 2, 4), *limits)
    assert not within(SpecSetting(3, 2, 5), *limits)
    assert not within(SpecSetting(3, 8, 4), *limits)


def _tree_choice(chain_tps: dict[int, float]):
    measured = [Measurement(SpecSetting(s), 1, tps, accept_length=1.5)
                for s, tps in chain_tps.items()]
    measured.append(Measurement(SpecSetting(6, 4, 16), 1, 150.0, accept_length=3.0))
    (rec,) = recommend([], measured)
    assert rec.setting == SpecSetting(6, 4, 16)
    return rec


def test_vllm_flags_for_a_tree_name_the_fastest_measured_chain():
    """A tree's vLLM flags named the chain of the tree's depth (6 here), measured at a third of
    the speed of the 2-step chain, and said its speed was not measured."""
    from draftsmith.tune.flags import export_paths, recommendation_text

    rec = _tree_choice({0: 90.0, 2: 130.0, 6: 45.0})
    text = recommendation_text(rec, "runs/d", exports=export_paths("runs/d"))
    assert '"num_speculative_tokens": 2' in text and '"num_speculative_tokens": 6' not in text
    assert "--speculative-tokens 2 --out runs/d-speculators" in text
    assert "steps 2, topk 1, 3 draft tokens (measured 130.0 tok/s)" in text
    assert "--speculative-num-steps 6 --speculative-eagle-topk 4" in text  # SGLang: the tree


def test_vllm_flags_for_a_tree_say_no_speculation_where_no_chain_beat_it():
    from draftsmith.tune.flags import export_paths, recommendation_text

    rec = _tree_choice({0: 90.0, 1: 80.0, 2: 70.0})
    text = recommendation_text(rec, "runs/d", exports=export_paths("runs/d"))
    assert "--speculative-config" not in text.replace("without --speculative-config", "")
    assert "no chain beat no speculation (measured 90.0 tok/s)" in text
    assert "--format speculators" not in text and "--format sglang" in text


def test_acceptance_where_every_answer_ends_at_its_first_token_is_named(tmp_path):
    from draftsmith.engine.drafter_runtime import DrafterRuntime
    from draftsmith.engine.runtime import Runtime
    from draftsmith.models.eagle3 import load_drafter
    from draftsmith.targets import load_target
    from draftsmith.tune import measure

    folder, _ = _tiny_pair(tmp_path)
    model = load_target(folder).build(torch.float32, "cpu")
    drafter = load_drafter(tmp_path / "d", "cpu", torch.float32, embed=model.embed.weight)
    eng = measure.Engine(Runtime(model, 2, 64), DrafterRuntime(drafter, 2, 256, False), drafter)
    prompts = [[1, 2, 3], [4, 5]]
    firsts = measure.decoder(eng, SpecSetting(2)).generate(prompts, 1, []).tokens
    with pytest.raises(DraftsmithError, match="ended at its first token"):
        measure.chain_acceptance(eng, prompts, 2, 8, sorted({t[0] for t in firsts}))


def _shape_rank(tp, job: dict) -> dict:
    return {"rank": tp.rank, "pid": 0, "env": {}, "backend": "gloo",
            "verify": [{"batch": b, "tokens": n, "ms": 1.0} for b, n in job["shapes"]]}


def test_nccl_sweep_refuses_a_bad_timeout_or_noise_and_times_each_shape_once():
    """--timeout 0 spawned every setting only to fail it; --tokens 4,4 timed and tabled a shape
    twice."""
    from draftsmith.tune import nccl

    kw = dict(target="tiny", settings=[nccl.DEFAULTS], shapes=[(1, 4), (1, 4)], device="cpu",
              dtype="fp32", iters=1, rank_fn=_shape_rank, log=lambda _: None)
    for bad in ({"timeout_s": 0.0}, {"noise_pct": -1.0}, {"noise_pct": float("nan")}):
        with pytest.raises(DraftsmithError, match="--timeout must be > 0 and --noise-pct >= 0"):
            nccl.run_nccl_sweep(1, **kw, **bad)
    rep = nccl.run_nccl_sweep(1, **kw)
    assert rep["shapes"] == [[1, 4]] and rep["job"]["shapes"] == [[1, 4]]
