"""Engine review 7: bad arguments to the refilling engines and the plain prefill refused in
one line (`DraftsmithError`) instead of a TypeError, a ValueError or silence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import test_engine_review6 as er6
import torch

from draftsmith.engine import refill, spec_refill
from draftsmith.engine.generate import prefill
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.errors import DraftsmithError

PROMPTS = [[3, 4], [5, 9, 2], [7]]


# test_engine_review6's module fixtures: a tiny target and a chain-3 decoder of 2 rows
target, decoder = er6.target, er6.decoder


@pytest.mark.parametrize("prompts", [5, None, iter([[1, 2]])])
def test_spec_refill_refuses_prompts_that_are_no_list(decoder, prompts):
    with pytest.raises(DraftsmithError, match="prompts must be a list of token-id lists"):
        spec_refill.generate_refill(decoder, prompts, 4)


@pytest.mark.parametrize("every", ["2", 1.5, -1, True])
def test_spec_refill_refuses_a_bad_check_every(decoder, every):
    with pytest.raises(DraftsmithError, match="check_every must be a whole number"):
        spec_refill.generate_refill(decoder, PROMPTS, 4, check_every=every)


def test_spec_refill_check_every_none_or_0_is_the_default(decoder):
    for every in (None, 0):
        res = spec_refill.generate_refill(decoder, PROMPTS, 4, rows=2, check_every=every)
        assert res.extra["check_every"] == spec_refill.refill_every_for(2)


@pytest.mark.parametrize("every", ["x", 1.5, 0, -3, True])
def test_refill_refuses_a_bad_check_every(target, every):
    with pytest.raises(DraftsmithError, match="check_every must be a whole number"):
        refill.generate_refill(Runtime(target, 2, 64), PROMPTS, 4, rows=2, check_every=every)


def test_warm_refill_takes_rows_none_as_generate_refill_does(decoder):
    spec_refill.warm_refill(decoder, PROMPTS, None)  # was a TypeError (min of int and None)


def test_prepare_refuses_a_bad_max_new_or_params(target):
    rt = Runtime(target, 2, 64)
    with pytest.raises(DraftsmithError, match="max_new_tokens must be >= 1"):
        refill.prepare(rt, 1, 0, [], SamplingParams())
    with pytest.raises(DraftsmithError, match="params must be a SamplingParams"):
        refill.prepare(rt, 1, 4, [], [SamplingParams()])


def test_prefill_of_no_prompts_is_refused(target):
    with pytest.raises(DraftsmithError, match="empty prompt"):
        prefill(Runtime(target, 1, 16), [])


def test_warm_prompts_leave_the_random_state_alone():
    """On a GPU the warm-up's prompt passes sample first tokens: a seeded sampled run after
    `prepare(..., prompts)` or `warm_refill` drew other tokens than one without it. A stand-in
    prefill runtime with graphs (CPU) runs the same loop."""
    pre = SimpleNamespace(graphs=object(), max_batch=4, device=torch.device("cpu"),
                          bucket=lambda rows, n: 16)
    seen = []

    def start(rows, prompts):  # a sampled first token per row, as RefillState.start draws
        seen.append(len(rows))
        torch.rand(len(rows))

    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    refill.warm_prompts(pre, [[1, 2], [3]], start, 3)
    assert seen and torch.equal(torch.rand(3), want)
