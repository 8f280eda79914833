"""`draftsmith bench`, second review: a grid's trees that cannot run are named, not dropped
without a word, and a grid that cannot run is refused before anything loads."""

from __future__ import annotations

import json

import pytest
from test_bench import bench_json, drafter_dir, invoke  # noqa: F401 (a fixture)

from draftsmith.bench.run import BenchConfig
from draftsmith.errors import DraftsmithError


def test_a_tree_that_cannot_run_is_named_not_dropped():
    """--steps 1,3 --topk 4 --num-draft-tokens 8: steps 1 of topk 4 verifies at most 5 tokens,
    so tree 1/4/8 was left out of the run and the report without a word."""
    cfg = BenchConfig(steps=[1, 3], topk=[1, 4], num_draft_tokens=[8])
    assert cfg.settings() == [(1, 1, 2), (3, 1, 4), (3, 4, 8)]
    assert cfg.unfit() == ["tree 1/4/8: --steps 1, --topk 4 verify 2 to 5 tokens, not 8"]
    assert BenchConfig(steps=[3], topk=[4], num_draft_tokens=[8]).unfit() == []


@pytest.mark.parametrize(
    ("grid", "says"),
    [
        ({"steps": [2], "topk": [2], "num_draft_tokens": [8]},
         "no setting of this grid can run: tree 2/2/8: --steps 2, --topk 2 verify 2 to 7"),
        ({"steps": [2], "topk": [1], "num_draft_tokens": [4]},
         r"--num-draft-tokens 4: a chain \(--topk 1\) verifies --steps \+ 1 = 3 tokens"),
        ({"steps": [2], "topk": [1, 2]}, "--topk 2 drafts a tree: give --num-draft-tokens"),
    ],
)
def test_a_grid_that_cannot_run_is_refused_as_it_is_made(grid, says):
    with pytest.raises(DraftsmithError, match=says):
        BenchConfig(**grid)


def test_bench_warns_of_the_trees_it_skips(tiny_llama_dir, drafter_dir,  # noqa: F811
                                           tmp_path):
    res = invoke("--target", str(tiny_llama_dir), "--drafter", str(drafter_dir), "--steps", "1,2",
                 "--topk", "2", "--num-draft-tokens", "5", "--num-prompts", "1",
                 "--max-new-tokens", "3", "--device", "cpu", "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, (res.output, res.exception)
    report = bench_json(res)
    assert [r["setting"] for r in report["results"]] == ["baseline", "tree 2/2/5"]
    assert report["meta"]["warnings"] == [
        "skipped tree 1/2/5: --steps 1, --topk 2 verify 2 to 3 tokens, not 5"]
    assert "warning: skipped tree 1/2/5" in res.stderr


def _strict_loads(text: str):
    def refuse(name: str):
        raise ValueError(f"{name} in strict JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_gap_that_cannot_be_read_is_null_not_nan(tmp_path, capsys):
    """A completion that stops where the target names no EOS id had a NaN gap: bench.json held
    NaN (and max_gap with it), which jq and JavaScript refuse."""
    from rich.console import Console
    from test_speculative import tiny_target

    from draftsmith.bench.report import print_report, write_json
    from draftsmith.bench.run import agreement

    model = tiny_target()
    a = agreement(model, [[[1, 2], [3]]], [[5, 6, 7], [8, 9]], [[5, 6], [8, 4]], [])
    assert [d["gap"] is None for d in a["divergences"]] == [True, False]
    assert a["divergences"][0]["relative_gap"] is None
    assert a["max_gap"] == a["divergences"][1]["gap"] > 0
    alone = agreement(model, [[[1, 2]]], [[5, 6, 7]], [[5, 6]], [])
    assert alone["max_gap"] is None
    assert agreement(model, [[[1, 2]]], [[5, 6, 7]], [[5, 6]], [500])["max_gap"] is None
    report = {"meta": {"device": "cpu", "dtype": "float32"}, "results": [
        {"suite": "chat", "batch": 1, "setting": "chain 1", "tokens_per_s": float("inf"),
         "speedup": None, "decode_tokens_per_s": 1.0, "decode_speedup": float("nan"),
         "mean_accept_length": 1.0, "accept_rate": 0.0, "position_rates": [None],
         "agreement": alone}]}
    got = _strict_loads(write_json(report, tmp_path / "bench.json").read_text())
    row = got["results"][0]
    assert (row["tokens_per_s"], row["decode_speedup"], row["agreement"]["max_gap"]) == (
        None, None, None)
    print_report(report, Console(width=200))
    out = capsys.readouterr().out
    assert _strict_loads(out.strip().splitlines()[-1]) == got
    assert "largest candidate-logit gap at a divergence -" in out


def test_bench_refuses_to_decode_past_the_targets_positions(tiny_llama_dir, tmp_path,
                                                             monkeypatch):
    """-n 5000 on a 512-position target decoded 2,648 tokens without a word (serve refuses
    the same); refused before the weights load."""
    from draftsmith.targets import Target

    def build(*_a, **_k):
        raise AssertionError("weights loaded before the check")

    monkeypatch.setattr(Target, "build", build)
    res = invoke("--target", str(tiny_llama_dir), "--drafter", "random", "--num-prompts", "1",
                 "--steps", "1", "-n", "600", "--device", "cpu", "--out", str(tmp_path / "o"))
    assert isinstance(res.exception, DraftsmithError), res.output
    assert "--max-new-tokens = " in str(res.exception)
    assert str(res.exception).endswith("exceeds the target's max_position_embeddings 512")
