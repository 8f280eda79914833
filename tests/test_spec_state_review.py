"""SpecResult.merged: what bench and compare add up over batches."""

import pytest

from draftsmith.engine.spec_state import SpecResult
from draftsmith.errors import DraftsmithError


def _result(steps: int, tokens: list[list[int]]) -> SpecResult:
    return SpecResult(tokens, 0.5, 1.0, 3, steps, [0, 2, 1] + [0] * (steps - 1), [3] * steps,
                      [2] * steps)


def test_merging_sums_the_runs():
    got = SpecResult.merged([_result(2, [[1, 2]]), _result(2, [[3], [4, 5]])])
    assert got.tokens == [[1, 2], [3], [4, 5]] and got.cycles == 6 and got.steps == 2
    assert got.accept_hist == [0, 4, 2, 0] and got.reached == [6, 6] and got.decode_s == 2.0


def test_merging_no_runs_or_other_depths_is_one_error():
    """merged([]) was an IndexError; results of 2 and 3 steps a bare ValueError from zip."""
    with pytest.raises(DraftsmithError, match="no speculative results to merge"):
        SpecResult.merged([])
    with pytest.raises(DraftsmithError, match=r"drafting \[2, 3\] steps cannot merge"):
        SpecResult.merged([_result(2, [[1]]), _result(3, [[1]])])
