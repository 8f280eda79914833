"""Refilled rows under review: warming the speculative refill for no prompts builds nothing."""

from __future__ import annotations

import pytest
from test_speculative import make_drafter, tiny_target

from draftsmith.engine import spec_refill
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.speculative import SpecDecoder


@pytest.fixture(scope="module")
def model():
    return tiny_target(vocab=64, seed=1, num_layers=2)


def test_warming_no_prompts_builds_no_state_of_no_rows(model) -> None:
    """warm_refill(dec, [], rows) built a SpecState of 0 rows (on a GPU: the cycle's four graphs
    captured at batch 0) for a run that never comes; it warms nothing now, and a real warm-up
    and run still work after it."""
    dec = SpecDecoder(Runtime(model, 2, 40, graphs=False), make_drafter(model, 48), 2, 1, None,
                      max_batch=2)
    spec_refill.warm_refill(dec, [], 2)
    assert dec.states == {}
    spec_refill.warm_refill(dec, [[1, 2]], 2)
    assert list(dec.states) == [1]
    assert len(spec_refill.generate_refill(dec, [[1, 2], [3]], 3, rows=2).tokens) == 2


def test_prepare_takes_no_rows_as_generate_refill_does(model) -> None:
    """`check_rows` lets rows=None through (every row the runtime has, as generate_refill reads
    it), but prepare then built a state of None rows: a TypeError from torch.full."""
    from draftsmith.engine import refill
    from draftsmith.engine.sampling import SamplingParams

    rt = Runtime(model, 2, 32, graphs=False)
    state, _ = refill.prepare(rt, None, 4, [], SamplingParams(), [[1, 2]])
    assert state.rows == 2 and bool(state.done.all())
    want = refill.generate_refill(Runtime(model, 2, 32, graphs=False), [[1, 2], [3]], 4)
    assert refill.generate_refill(rt, [[1, 2], [3]], 4) == want
