"""Review 8 of `data make`: its vocab.json records the length within which each sample's tokens
were counted (capture's cut, the dataset's max_len), so a `train --max-len` below it can be told
apart from the count it trains on."""

from __future__ import annotations

import json
import re

import pytest
from test_data_make_review6 import _files
from test_data_make_review7 import KW, made  # noqa: F401 - review 7's dataset, made once

from draftsmith.data.pipeline import make_dataset
from draftsmith.data.shards import read_manifest
from draftsmith.errors import DraftsmithError


def test_the_vocab_records_the_length_it_counted_within(target, made):  # noqa: F811
    """The vocab counts the shards, which capture cut at the dataset's max_len: vocab.json said
    only the dataset's path, so nothing told a `train --max-len` below it that the vocab counted
    tokens training never sees."""
    data = made / "dataset"
    rec = json.loads((data / "vocab.json").read_text())
    assert rec["made_from"]["max_len"] == read_manifest(data)["max_len"] == KW["max_len"]
    assert rec["made_from"]["target"] == target.fingerprint


def test_data_vocab_of_the_dataset_records_the_same_length(target, made, tmp_path):  # noqa: F811
    """`data vocab DIR/dataset` counts the same cut samples: its vocab.json says so too, as
    data make's does (it named the dataset and target only)."""
    from typer.testing import CliRunner

    from draftsmith.data.cli import app

    r = CliRunner().invoke(app, ["vocab", str(made / "dataset"), "--size", "8", "--out",
                                 str(tmp_path)])
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "vocab.json").read_text())
    assert rec["made_from"] == {"dataset": str(made / "dataset"), "target": target.fingerprint,
                                "max_len": KW["max_len"]}


def test_a_vocab_stage_that_cannot_write_keeps_the_dataset_and_says_to_rerun(target, made):  # noqa: F811
    """The vocab stage's failed write told a `data make` user to "give another --out", a flag
    data make does not have: it names the rerun of the same command, the stages before kept."""
    data = made / "dataset"
    (data / "vocab.json").unlink()
    (data / "vocab.json" / "x").mkdir(parents=True)  # cannot be unlinked: as a read-only folder
    before, logs = _files(made) | {"shard": (data / "shard-00000.safetensors").read_bytes()}, []
    try:
        with pytest.raises(DraftsmithError) as e:
            make_dataset(made, 3, target=target, log=logs.append, **KW)
    finally:
        (data / "vocab.json" / "x").rmdir(), (data / "vocab.json").rmdir()
    said = str(e.value)
    assert "--out" not in said and "\n" not in said
    assert re.search(r"rerun the same `[^`]*make[^`]*` command", said) and str(data) in said
    assert logs.count("capture: reused (3 samples)") == 1
    now = _files(made) | {"shard": (data / "shard-00000.safetensors").read_bytes()}
    assert {k: v for k, v in now.items() if k != "make.json"} == (
        {k: v for k, v in before.items() if k != "make.json"})
    make_dataset(made, 3, target=target, log=logs.append, **KW)  # the rerun finishes it
    assert (data / "vocab.json").is_file()


def test_a_full_disk_in_the_vocab_stage_names_the_rerun(target, made, monkeypatch):  # noqa: F811
    """A failed vocab.safetensors write ended "the file there before is unchanged": nothing
    said that the dataset stays and the same command goes on from its vocab stage."""
    from draftsmith.data import atomic

    replace = atomic.os.replace

    def full(src, dst):
        if str(dst).endswith("vocab.safetensors"):
            raise OSError(28, "No space left on device")
        return replace(src, dst)

    (made / "dataset" / "vocab.safetensors").unlink()
    monkeypatch.setattr(atomic.os, "replace", full)
    with pytest.raises(DraftsmithError, match="No space left on device") as e:
        make_dataset(made, 3, target=target, log=lambda s: None, **KW)
    assert re.search(r"rerun the same `[^`]*make[^`]*` command", str(e.value))
    monkeypatch.undo()
    make_dataset(made, 3, target=target, log=lambda s: None, **KW)
    assert (made / "dataset" / "vocab.safetensors").is_file()
