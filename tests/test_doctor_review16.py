"""Doctor review 16: the target identity check compares how the target splits text."""

from __future__ import annotations

import test_doctor as td

from draftsmith.data.shards import read_manifest
from draftsmith.doctor.checks import target_identity

# test_doctor's module fixtures: its tiny 8-layer target, data on layers 1, 3, 5, a drafter
target_dir, target, data_dir, work = td.target_dir, td.target, td.data_dir, td.work


def test_data_split_otherwise_than_the_live_target_is_a_target_error(target, data_dir):
    """Data whose manifest records another `tokenization_hash` (the same vocabulary split by
    another normalizer or pre-tokenizer, one fingerprint) passed the doctor while train refuses
    it (`targets.check_tokenization`); older data without the field still passes."""
    m = read_manifest(data_dir)
    assert m["target"].get("tokenization_hash")
    assert target_identity(target, m, data_dir, None) == []
    other = m | {"target": m["target"] | {"tokenization_hash": "0" * 16}}
    found = target_identity(target, other, data_dir, None)
    assert [f.check for f in found] == ["target"] and found[0].severity == "error"
    assert "tokenization" in found[0].what and "0" * 16 in found[0].what
    assert "recapture the data with this target" in found[0].fix
    old = m | {"target": {k: v for k, v in m["target"].items() if k != "tokenization_hash"}}
    assert target_identity(target, old, data_dir, None) == []
