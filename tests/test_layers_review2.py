"""Layer-id lists as typed: spaces between digits are no separator (they joined "1 2" into 12)."""

from __future__ import annotations

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.layers import parse_ids


@pytest.mark.parametrize("text", ["1 2 4", "0 2", "1,2 3"])
def test_ids_parted_by_spaces_are_refused_not_joined(text):
    with pytest.raises(DraftsmithError, match="expected comma-separated integers"):
        parse_ids(text)


@pytest.mark.parametrize("text", ["-1,0,5", " -1, 0, 5 ", "-1 ,0 ,5", "-1,0,5,"])
def test_ids_with_spaces_around_them_read_as_typed(text):
    assert parse_ids(text) == [-1, 0, 5]
