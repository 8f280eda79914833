"""Layers review 3: ids typed in other digits, ids that are no whole numbers, engine ids out of
range told in the engine's own numbers, and every conversion round-tripping."""

from __future__ import annotations

from itertools import combinations

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.layers import Convention, from_convention, parse_ids, to_convention, validate

L = 6


@pytest.mark.parametrize("text", ["1_0,3", "\uff11,2", "\u0663,4", "1,2\u00b2"])
def test_ids_in_other_digits_or_with_underscores_are_refused(text):
    """int() read '1_0' as layer 10 and Arabic-Indic or fullwidth digits as ASCII ones, which
    options.int_list refuses for every other list flag."""
    with pytest.raises(DraftsmithError, match="expected comma-separated integers"):
        parse_ids(text)


def test_signed_ascii_ids_still_read():
    assert parse_ids("-1,+2, 4") == [-1, 2, 4]


@pytest.mark.parametrize("ids", [[True, 3], [1.5, 3], ["1", 3], [None]])
def test_ids_that_are_no_whole_numbers_are_refused_not_truncated(ids):
    """validate took True and 1.5 as layer 1 and '1' as 1 (a manifest's `true` trained on
    layer 1 without a word)."""
    for call in (lambda: validate(ids, L), lambda: to_convention(ids, "vllm", L),
                 lambda: from_convention(ids, "sglang", L)):
        with pytest.raises(DraftsmithError) as e:
            call()
        assert "whole numbers" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("conv", "written", "bad", "span"), [
    ("vllm", [2, 4, 7], "[7]", "[0, 6]"),
    ("speculators", [-1, 2, 4], "[-1]", "[0, 6]"),
    ("eagle", [0, 7, 9], "[7, 9]", "[0, 6]"),
    ("sglang", [1, 3, 6], "[6]", "[-1, 5]"),
])
def test_engine_ids_out_of_range_are_told_as_written(conv, written, bad, span):
    """from_convention named the converted canonical id ('[-2] out of range: canonical ids ...'
    for a vLLM -1), a number the user never wrote."""
    with pytest.raises(DraftsmithError) as e:
        from_convention(written, conv, L)
    msg = str(e.value)
    assert f"{conv} aux layer ids {bad} out of range" in msg and f"lie in {span}" in msg
    assert "canonical" not in msg and "\n" not in msg


def test_an_unknown_convention_is_one_line():
    with pytest.raises(DraftsmithError, match="unknown aux layer convention 'sglang-new': use "
                                              "one of draftsmith, eagle, vllm"):
        to_convention([1], "sglang-new", L)


@pytest.mark.parametrize("conv", list(Convention))
def test_every_convention_round_trips_every_capturable_list(conv):
    canon = range(-1, L)
    for n in (1, 3):
        for ids in map(list, combinations(canon, n)):
            written = to_convention(ids, conv, L)
            assert from_convention(written, conv, L) == ids
            assert to_convention(from_convention(written, conv, L), conv, L) == written
