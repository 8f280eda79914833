"""`draftsmith bench`, second review: a grid's trees that cannot run are named, not dropped
without a word, and a grid that cannot run is refused before anything loads."""

from __future__ import annotations

import json

import pytest
from test_bench import drafter_dir, invoke  # noqa: F401 (a fixture)

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
         "--num-draft-tokens sizes trees: give a --topk above 1"),
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
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["setting"] for r in report["results"]] == ["baseline", "tree 2/2/5"]
    assert report["meta"]["warnings"] == [
        "skipped tree 1/2/5: --steps 1, --topk 2 verify 2 to 3 tokens, not 5"]
    assert "warning: skipped tree 1/2/5" in res.stderr
