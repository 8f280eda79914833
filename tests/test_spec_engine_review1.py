"""Speculative engine review 1: a decoder's own runtime too short for its drafting margin, and a
drafter whose draft vocabulary maps past the target's."""

from __future__ import annotations

import pytest
import torch
from test_speculative import make_drafter, tiny_target

from draftsmith.engine.generate import generate
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError


def small():
    return tiny_target(64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=16)


@pytest.mark.parametrize(("steps", "topk", "n", "need"), [(3, 1, None, 10), (3, 2, 6, 16),
                                                          (1, 1, None, 6)])
def test_a_decoders_own_runtime_too_short_names_the_drafting_it_needs(steps, topk, n, need):
    """SpecDecoder(model, max_seq=...) sized its runtime's kept positions as max_seq minus the
    drafting margin; a margin of max_seq or more reached Runtime, whose "kept must be a whole
    number from 1 to max_seq" said nothing of steps or tree size."""
    target = small()
    drafter = make_drafter(target, 32)
    for short in (need - 1, need - 3, 1):
        with pytest.raises(DraftsmithError, match=f"steps {steps} .*needs at least {need}$") as e:
            SpecDecoder(target, drafter, steps, topk, n, max_seq=short)
        assert "kept" not in str(e.value)
    dec = SpecDecoder(target, drafter, steps, topk, n, max_seq=need)
    assert dec.capacity() == 2
    assert dec.generate([[3]], 1, eos_ids=[]).tokens == generate(target, [[3]], 1)


@pytest.mark.parametrize(("topk", "n"), [(1, None), (2, 5)])
@pytest.mark.parametrize("shift", [64 - 31 + 3, -40])
def test_a_draft_vocabulary_mapped_outside_the_target_is_refused(topk, n, shift):
    """A d2t mapping a draft id past the target's vocabulary (or below 0) drafted that id into
    the verify: an IndexError in the embedding on CPU, a device-side assert on a GPU."""
    target = small()
    drafter = make_drafter(target, 32)
    with torch.no_grad():
        drafter.d2t[31] = shift
    with pytest.raises(DraftsmithError, match="d2t maps 1 draft id.* vocabulary of 64 "
                                              r"\(draft id 31 -> "):
        SpecDecoder(target, drafter, 3, topk, n, max_seq=64)
