"""The engine's request checks, second review: a prompt that is no list is one clear error."""

from __future__ import annotations

import numpy as np
import pytest
from test_speculative import tiny_target

from draftsmith.engine.generate import run_generation
from draftsmith.errors import DraftsmithError


@pytest.mark.parametrize("bad", [[5.0], [np.int64(3)], [None], [[1, 2], 7.0]])
def test_a_prompt_that_is_no_list_is_refused_by_name(bad):
    """A float, numpy id or None in place of a prompt was a TypeError (`has no len()`)."""
    with pytest.raises(DraftsmithError, match="prompts: lists of token ids"):
        run_generation(tiny_target(), bad, 2)


def test_prompts_as_arrays_and_tuples_still_decode():
    out = run_generation(tiny_target(), [np.array([1, 5, 9]), (1, 60)], 3).tokens
    assert [len(t) for t in out] == [3, 3]
