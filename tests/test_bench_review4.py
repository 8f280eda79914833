"""`draftsmith bench`, fourth review: `BenchConfig` (run_bench's Python API) refuses a grid of
no or non-positive values as it is made, not after the target loaded and the baseline ran."""

from __future__ import annotations

import pytest

from draftsmith.bench.run import BenchConfig
from draftsmith.errors import DraftsmithError


@pytest.mark.parametrize(
    ("grid", "says"),
    [
        # steps 0 ran the baseline, then SpecDecoder refused it: the baseline's minutes lost
        ({"steps": [0]}, "--steps must be whole numbers >= 1, got 0"),
        # "no setting of this grid can run: " with no reason after it
        ({"topk": [0]}, "--topk must be whole numbers >= 1, got 0"),
        ({"steps": []}, "--steps: give at least one value"),
        # fill_batches(prompts, 0): ZeroDivisionError after the weights loaded
        ({"batch_sizes": [0]}, "--batch-size must be whole numbers >= 1, got 0"),
        # max() of an empty list: ValueError after the weights loaded
        ({"batch_sizes": []}, "--batch-size: give at least one value"),
        ({"topk": [2], "num_draft_tokens": [-3]},
         "--num-draft-tokens must be whole numbers >= 1, got -3"),
        ({"steps": [2.5]}, "--steps must be whole numbers >= 1, got 2.5"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"num_prompts": -1}, "--num-prompts must be >= 0"),
    ],
)
def test_bench_config_refuses_a_grid_of_no_or_non_positive_values(grid, says):
    with pytest.raises(DraftsmithError, match=says):
        BenchConfig(**grid)
