"""Engine review 15 (CPU): the refusal of per-row settings under drafts drawn from the drafter
says what to do instead."""

from __future__ import annotations

import pytest
import torch
from test_speculative import make_drafter, tiny_target

from draftsmith.engine import spec_refill, speculative
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(64, seed=0)
    return target, make_drafter(target, 48, seed=1)


@torch.no_grad()
def test_drawn_drafts_refusing_row_settings_name_the_way_out(pair, monkeypatch):
    """The refusal named the decoder's setting but no fix: it now names both ways out (every
    row at that setting, or DRAFTSMITH_SAMPLED_DRAFTS=topk, the default, which takes a setting
    a row), at every entry that takes row settings."""
    monkeypatch.setattr(speculative, "SAMPLED_DRAFTS", "drawn")
    target, drafter = pair
    own = SamplingParams(0.7)
    dec = SpecDecoder(Runtime(target, 2, 64), drafter, 2, 1, None, own)
    rows = [own, SamplingParams(0.9)]
    want = (r"^drafts drawn from the drafter \(DRAFTSMITH_SAMPLED_DRAFTS=drawn\) sample with "
            r"the decoder's setting SamplingParams\(temperature=0.7.*\) alone: give every row "
            r"that setting, or unset DRAFTSMITH_SAMPLED_DRAFTS \(its default, topk, takes a "
            r"setting a row\)$")
    for run in (lambda: dec.generate([[1, 2], [3]], 3, [], rows),
                lambda: dec.start([[1, 2], [3]], 3, [], rows),
                lambda: spec_refill.prompt_pass(dec, 2)([0, 1], [[1, 2], [3]], rows)):
        with pytest.raises(DraftsmithError, match=want):
            run()
    assert len(dec.generate([[1, 2], [3]], 3, [], [own, own]).tokens) == 2
