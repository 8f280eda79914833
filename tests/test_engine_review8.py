"""Engine review 8: eos ids given as a numpy array of any shape refused or read as torch's are,
not a TypeError from iterating a 0-d array."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftsmith.engine.generate import eos_list
from draftsmith.errors import DraftsmithError


@pytest.mark.parametrize("eos", [np.array(2), np.array([[2, 7]]), torch.tensor(2),
                                 torch.tensor([[2, 7]])])
def test_eos_ids_of_other_than_one_dimension_are_refused(eos):
    """`eos_ids=np.array(tokenizer.eos_token_id)` was a TypeError (iteration over a 0-d array),
    and a 2-d array was refused as holding non-integers; a tensor's were refused by shape."""
    with pytest.raises(DraftsmithError, match="^eos_ids must be a list of token ids, got"):
        eos_list(eos)


def test_eos_ids_of_one_dimension_are_read_as_python_ints():
    for eos in (np.array([2, 7, 2]), torch.tensor([2, 7, 2]), {7, 2}):
        ids = eos_list(eos)
        assert sorted(ids) == [2, 7] and all(type(i) is int for i in ids)


def test_a_row_wider_than_the_decoders_kind_is_refused_before_its_state_is_made():
    """A greedy decoder given a sampled row's setting made (on a GPU: captured) the batch's
    state first, then said only that greedy rows "cannot take" it; now it is refused up front,
    naming what to do."""
    from test_speculative import make_drafter, tiny_target

    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.engine.speculative import SpecDecoder

    target = tiny_target(32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16)
    dec = SpecDecoder(target, make_drafter(target, 16), 2, max_batch=2, max_seq=32)
    with pytest.raises(DraftsmithError, match=r"^rows of greedy sampling cannot take .*"
                       r"\(temperature\): make the decoder with a setting of that kind"):
        dec.generate([[1, 2], [3]], 4, [], params=[SamplingParams(), SamplingParams(0.7)])
    assert not dec.states
