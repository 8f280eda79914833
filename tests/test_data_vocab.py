"""Draft vocabulary: top-N by loss-masked frequency, d2t/t2d round trip, coverage."""

from __future__ import annotations

import pytest
import torch

from draftsmith.data.shards import Sample, ShardWriter
from draftsmith.data.vocab import (
    build_vocab,
    count_dataset,
    count_ids,
    coverage_table,
    load_vocab,
    save_vocab,
)
from draftsmith.errors import DraftsmithError


def test_top_n_and_round_trip(tmp_path):
    ids = [5, 5, 5, 9, 9, 2, 7, 7, 7, 7, 1]
    mask = [True] * 10 + [False]  # token 1 is not an assistant token
    counts = count_ids([(ids, mask)], vocab_size=12)
    assert counts[1] == 0 and counts[7] == 4
    v = build_vocab(counts, 3, 12)
    assert v.used.tolist() == [5, 7, 9]
    assert v.d2t.dtype == torch.int64 and v.d2t.tolist() == [5, 6, 7]
    assert v.t2d.dtype == torch.bool and v.t2d.shape == (12,)
    assert v.t2d.nonzero().flatten().tolist() == [5, 7, 9]
    draft = torch.arange(3)
    assert torch.equal(draft + v.d2t[draft], v.used)  # d2t: draft index -> target id
    assert torch.equal(v.t2d.nonzero().flatten(), draft + v.d2t)  # t2d marks exactly those
    assert v.coverage == pytest.approx(9 / 10)
    save_vocab(v, tmp_path)
    d2t, t2d = load_vocab(tmp_path)
    assert torch.equal(d2t, v.d2t) and torch.equal(t2d, v.t2d)


def test_ties_are_deterministic_and_small_data_warns():
    counts = torch.tensor([0, 3, 3, 3, 0, 1])
    assert build_vocab(counts, 2).used.tolist() == [1, 2]
    with pytest.warns(UserWarning, match="only 4 distinct"):
        v = build_vocab(counts, 10)
    assert v.used.tolist() == [1, 2, 3, 5] and v.coverage == 1.0 and v.t2d.numel() == 6


def test_bad_input():
    with pytest.raises(DraftsmithError, match="no loss-masked tokens"):
        build_vocab(torch.zeros(5, dtype=torch.int64), 2)
    with pytest.raises(DraftsmithError, match="outside the target vocab"):
        build_vocab(count_ids([([9], [True])], 4), 2, 4)


def test_count_over_dataset_shards(tmp_path):
    w = ShardWriter(tmp_path, {"aux_layer_ids": [0], "hidden_size": 4, "vocab_size": 16}, ())
    for k in range(2):
        ids = torch.tensor([3, 4, 4, 8 + k])
        mask = torch.tensor([False, True, True, True])
        w.write(k, [Sample(str(k), ids, mask, torch.zeros(4, 1, 4), torch.zeros(4, 4))])
    counts = count_dataset(tmp_path)
    assert counts.numel() == 16 and counts[3] == 0 and counts[4] == 4 and counts[9] == 1
    assert coverage_table(counts, [1, 2, 3]) == [(1, 4 / 6), (2, 5 / 6), (3, 1.0)]
