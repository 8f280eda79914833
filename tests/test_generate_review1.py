"""The engine's public API, first review: a request past the target's positions is refused by
every engine entry, not decoded at positions the target never learned."""

from __future__ import annotations

import pytest
from test_speculative import make_drafter, tiny_target

from draftsmith.engine.generate import run_generation
from draftsmith.engine.refill import generate_refill
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.spec_refill import generate_refill as spec_generate_refill
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError

PROMPT = [list(range(1, 11))]  # 10 tokens
SAYS = "max_position_embeddings 16"


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(max_position_embeddings=16)
    return target, make_drafter(target, 96)


def test_plain_engine_refuses_decoding_past_the_targets_positions(pair):
    """10 + 12 = 22 positions on a target of 16 decoded silently: the CLI front ends refuse
    it, the API did not."""
    target, _ = pair
    assert len(run_generation(target, PROMPT, 6).tokens[0]) == 6  # 16: within
    with pytest.raises(DraftsmithError, match=SAYS):
        run_generation(target, PROMPT, 12)
    rt = Runtime(target, 1, 64)  # a cache longer than the target's positions
    with pytest.raises(DraftsmithError, match=SAYS):
        run_generation(rt, PROMPT, 12)
    with pytest.raises(DraftsmithError, match=SAYS):
        generate_refill(rt, PROMPT, 12, rows=1)


def test_spec_decoder_refuses_decoding_past_the_targets_positions(pair):
    target, drafter = pair
    dec = SpecDecoder(target, drafter, 2, 1, max_batch=1, max_seq=64)
    assert len(dec.generate(PROMPT, 6).tokens[0]) == 6
    with pytest.raises(DraftsmithError, match=SAYS):
        dec.generate(PROMPT, 12)
    with pytest.raises(DraftsmithError, match=SAYS):
        dec.start(PROMPT, 12, [])
    with pytest.raises(DraftsmithError, match=SAYS):
        spec_generate_refill(dec, PROMPT, 12, rows=1)


@pytest.mark.parametrize(
    ("size", "says"),
    [
        # a float max_seq was a TypeError from torch.zeros deep in the runtime's cache
        ({"max_seq": 64.0}, "max_batch and max_seq must be whole numbers >= 1, got max_seq 64.0"),
        # max_batch 0 made a decoder no batch could run, refused only at its first generate
        ({"max_batch": 0}, "max_batch and max_seq must be whole numbers >= 1, got max_batch 0"),
    ],
)
def test_spec_decoder_refuses_a_runtime_size_that_is_no_count(pair, size, says):
    target, drafter = pair
    with pytest.raises(DraftsmithError, match=says):
        SpecDecoder(target, drafter, 2, 1, **{"max_batch": 1, "max_seq": 64, **size})


def test_spec_decoder_capture_refuses_a_batch_of_no_rows(pair):
    """capture([0]) built a state of no rows without a word."""
    target, drafter = pair
    dec = SpecDecoder(target, drafter, 2, 1, max_batch=2, max_seq=64)
    with pytest.raises(DraftsmithError, match="batch sizes must be whole numbers >= 1, got 0"):
        dec.capture([2, 0])
    assert dec.states == {}  # refused before any capture
