"""Data records how its target splits text (`tokenization_hash`), which the vocabulary-only
fingerprint misses: training refuses data split otherwise, data made before the record stays
usable and resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_capture_review3 import run

from draftsmith.data.shards import MANIFEST, read_manifest
from draftsmith.errors import DraftsmithError
from draftsmith.targets.tokenizer import tokenization_hash
from draftsmith.train.sources import open_offline


def edit_target(out: Path, **change) -> None:
    m = json.loads((out / MANIFEST).read_text())
    for k, v in change.items():
        if v is None:
            m["target"].pop(k)
        else:
            m["target"][k] = v
    (out / MANIFEST).write_text(json.dumps(m))


def test_a_capture_records_its_targets_tokenization(target, model, tmp_path):
    run(target, model, tmp_path)
    m = read_manifest(tmp_path)
    assert m["target"]["tokenization_hash"] == tokenization_hash(target.tokenizer)
    assert open_offline(tmp_path, target, None).lengths  # its own target trains on it


def test_data_split_otherwise_is_refused_for_training(target, model, tmp_path):
    """Data tokenized by a tokenizer of the same vocabulary that splits otherwise (the default
    target before its digit split) has the target's fingerprint and trained silently."""
    run(target, model, tmp_path)
    edit_target(tmp_path, tokenization_hash="0123456789abcdef")
    with pytest.raises(DraftsmithError, match=r"manifest.json: tokenized with tokenization "
                       r"0123456789abcdef, but target .* splits text otherwise .*recapture"):
        open_offline(tmp_path, target, None)


def test_data_made_before_the_record_trains_and_resumes(target, model, tmp_path):
    """A manifest without the hash (every dataset made before it) is neither refused by training
    nor taken for another target's by a capture that goes on with it."""
    run(target, model, tmp_path, cs=None)
    edit_target(tmp_path, tokenization_hash=None)
    assert open_offline(tmp_path, target, None).lengths
    shards = read_manifest(tmp_path)["shards"]
    (tmp_path / shards[-1]["file"]).unlink()  # one shard to make again: a resumed capture
    run(target, model, tmp_path)
    assert len(read_manifest(tmp_path)["shards"]) == len(shards)
