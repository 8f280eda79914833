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
    map_problem,
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


def test_map_problem_names_each_way_a_map_is_not_one_to_one():
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[[1, 4, 6]] = True
    used, problem = map_problem(torch.tensor([1, 3, 4]), t2d, 8)
    assert used.tolist() == [1, 4, 6] and problem is None
    assert map_problem(torch.tensor([1, 3, 6]), None, 8)[1][0] == "outside"  # draft 2 -> 8
    assert map_problem(torch.tensor([1, 0, 4]), None, 8)[1][0] == "twice"  # 1, 1, 6
    more = t2d.clone()
    more[0] = True  # marks a token no draft id maps to
    for bad in (more, t2d[:7], ~t2d):
        assert map_problem(torch.tensor([1, 3, 4]), bad, 8)[1][0] == "t2d"


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


def test_a_file_that_is_no_vocabulary_is_named(tmp_path):
    from safetensors.torch import save_file

    keep = tmp_path / "keep.txt"
    keep.write_text("notes\n")
    with pytest.raises(DraftsmithError, match="keep.txt: not a draft vocabulary file"):
        load_vocab(keep)
    save_file({"x": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(DraftsmithError, match="holds \\['x'\\].*d2t and t2d"):
        load_vocab(tmp_path / "other.safetensors")
    v = build_vocab(torch.tensor([0, 2, 1]), 2)
    with pytest.raises(DraftsmithError, match="keep.txt: is a file, not a folder"):
        save_vocab(v, keep)
    assert keep.read_text() == "notes\n"


def test_damaged_shard_and_bad_out_in_vocab(tmp_path):
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    head = {"aux_layer_ids": [0], "hidden_size": 4, "vocab_size": 16,
            "target": {"fingerprint": "abc"}}
    w = ShardWriter(tmp_path / "ds", head, ())
    ids, mask = torch.tensor([3, 4, 4]), torch.tensor([False, True, True])
    w.write(0, [Sample("0", ids, mask, torch.zeros(3, 1, 4), torch.zeros(3, 4))])
    keep = tmp_path / "keep.txt"
    keep.write_text("notes\n")
    res = CliRunner().invoke(app, ["vocab", str(tmp_path / "ds"), "-o", str(keep)])
    assert isinstance(res.exception, DraftsmithError) and "keep.txt" in str(res.exception)
    assert keep.read_text() == "notes\n"
    shard = tmp_path / "ds" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DraftsmithError, match="shard-00000.safetensors: unreadable shard"):
        count_dataset(tmp_path / "ds")
