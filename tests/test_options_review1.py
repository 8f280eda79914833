"""Options, first review: every count option (a whole number >= 1) reads a value by one rule
with one wording, whether given alone (`at_least_one`), in a comma list (`int_list`) or by a
Python caller; a list's items are split at commas only."""

from __future__ import annotations

import numpy as np
import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.options import at_least_one, int_list


@pytest.mark.parametrize(("value", "says"), [
    (0, "--steps must be >= 1, got 0"), (-1, "--steps must be >= 1, got -1"),
    (1.5, "--steps must be a whole number >= 1, got 1.5"),
    (2.0, "--steps must be a whole number >= 1, got 2.0"),
    (True, "--steps must be a whole number >= 1, got True"),
    (" 3", "--steps must be a whole number >= 1, got ' 3'")])
def test_a_bad_count_is_refused_alike_alone_and_through_at_least_one(value, says):
    """True and 1.5 passed at_least_one (True >= 1), " 3" was a TypeError traceback."""
    from draftsmith import options

    for check in (lambda: options.count(value, "--steps"),
                  lambda: at_least_one({"--steps": value})):
        with pytest.raises(DraftsmithError) as e:
            check()
        assert str(e.value) == says


def test_good_counts_pass():
    from draftsmith.options import count

    assert count(3, "--steps") == 3 and count(np.int64(2), "--steps") == 2
    at_least_one({"--steps": 1, "--topk": None})


@pytest.mark.parametrize(("text", "says"), [
    ("0", "--steps must be whole numbers >= 1, got 0"),
    ("2,-1", "--steps must be whole numbers >= 1, got -1 in '2,-1'"),
    ("1.5", "--steps must be whole numbers >= 1, got '1.5'"),
    ("2.0", "--steps must be whole numbers >= 1, got '2.0'"),
    ("True", "--steps must be whole numbers >= 1, got 'True'"),
    ("", "--steps: give at least one value, got ''"),
    (" , ", "--steps: give at least one value, got ' , '")])
def test_a_bad_list_is_refused_in_the_wording_bench_uses(text, says):
    """The list's wording is bench's Python check's ("must be whole numbers >= 1, got 0")."""
    with pytest.raises(DraftsmithError) as e:
        int_list(text, "--steps")
    assert str(e.value) == says


def test_list_items_split_at_commas_only():
    """Every space was removed first: `--batch-sizes "1 2"` ran batch 12."""
    assert int_list(" 3", "--steps") == [3] and int_list("1, 2,,4 ", "--steps") == [1, 2, 4]
    with pytest.raises(DraftsmithError, match="got '1 2'"):
        int_list("1 2", "--batch-sizes")
    assert int_list("", "--num-draft-tokens", empty_ok=True) == []
