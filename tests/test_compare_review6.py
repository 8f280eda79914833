"""compare, sixth review: a headless speculators folder named a misfit says why."""

from __future__ import annotations

from test_compare_review4 import _headless

from draftsmith.compare.describe import describe
from draftsmith.compare.report import _params


def test_the_misfit_head_says_d2t_maps_away_from_the_first_ids(target, tmp_path):
    """"does not fit the smaller draft vocabulary" left the user guessing: the shared head's
    first N logits are target ids 0..N-1, and this d2t maps draft ids elsewhere."""
    small = describe(_headless(target, tmp_path, "small", 32), "small").params
    row = {r[0]: r[1:] for r in _params([{"params": small.to_dict()}])}
    served = row["lm_head (as the engine serves it)"][0]
    assert "first N logits, target ids 0..N-1" in served
    assert "d2t maps the draft ids away from 0..N-1" in served
    assert "store the drafter's own lm_head" in served
