"""Engine edge cases found in review: sampling settings that cannot sample, top-p at an exact
tie with its threshold, a decoder whose runtime is too short for its drafting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_speculative import make_drafter, tiny_target

from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import RowSampling, SamplingParams, probs
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError


@pytest.mark.parametrize(("kw", "what"), [
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"temperature": math.inf, "top_k": 5}, "temperature must be a finite number"),
    ({"temperature": "0.7"}, "temperature must be a finite number"),
    ({"temperature": 1.0, "top_k": 2.5}, "top_k must be a whole number"),
    ({"temperature": 1.0, "top_k": True}, "top_k must be a whole number"),
    ({"temperature": 1.0, "top_p": math.nan}, r"top_p must be in \(0, 1\]"),
])
def test_settings_that_cannot_sample_are_refused(kw, what):
    """A NaN temperature passed every check and decoded token 0 forever; an infinite one turned
    the logits into ties, so top-k kept the whole vocabulary; a fractional or boolean top_k
    failed deep in a tensor copy."""
    with pytest.raises(DraftsmithError, match=what) as e:
        SamplingParams(**kw)
    assert "\n" not in str(e.value)


def test_numbers_of_numpy_and_int_types_still_sample():
    p = SamplingParams(temperature=1, top_p=np.float32(0.5), top_k=np.int64(3))
    assert (p.kind, p.top_k, p.top_p) == ("filtered", 3, 0.5)


def test_top_p_drops_the_tokens_past_a_prefix_that_reaches_it_exactly():
    """top_p keeps the fewest top tokens whose mass reaches top_p, as HF's and vLLM's warpers
    do; a prefix at exactly top_p kept the next token too (0.5 of [0.5, 0.25, 0.25] kept two)."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]]))
    p = SamplingParams(temperature=1.0, top_p=0.5)
    for got in (probs(logits, p), RowSampling(2, "cpu", p).probs(logits)):
        assert got[0].tolist() == [1.0, 0.0, 0.0, 0.0]
        assert sorted(got[1].tolist()) == [0.0, 0.0, 0.5, 0.5]


@pytest.mark.parametrize(("steps", "topk", "n", "need"), [(5, 1, None, 14), (3, 2, 6, 16),
                                                          (5, 4, 60, 74)])
def test_a_runtime_too_short_for_the_drafting_is_refused_with_the_length_it_needs(steps, topk,
                                                                                   n, need):
    """A tree wider than the runtime failed in a tensor allocation; a short chain built a decoder
    of negative capacity that refused every prompt. The length named suffices for a one-token
    prompt and one new token."""
    target = tiny_target()
    drafter = make_drafter(target, 96)
    with pytest.raises(DraftsmithError, match=f"needs at least {need}$"):
        SpecDecoder(Runtime(target, 1, need - 1), drafter, steps, topk, n)
    dec = SpecDecoder(Runtime(target, 1, need), drafter, steps, topk, n)
    assert dec.generate([[3]], 1, eos_ids=[]).tokens == generate(target, [[3]], 1)
