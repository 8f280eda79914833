"""Doctor review 22: the "as each convention writes them" line names no SGLang ids for layers
SGLang cannot capture (the embedding, the last layer's output), says why the HF index is missing,
and that vLLM's edge ids need newer vLLM model files; a dataset with several damaged shards names
each of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_doctor as td
from rich.console import Console
from test_doctor import TRUE, doctor, errors

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.doctor import render
from draftsmith.doctor.report import Report
from draftsmith.doctor.verdict import conventions

# test_doctor's module fixtures: its tiny 8-layer target
target_dir, target = td.target_dir, td.target


def _line(ids: list[int], layers: int) -> str:
    rep = Report(context={"target": {"layers": layers},
                          "in_each_convention": conventions(ids, layers)},
                 wiring={"true_ids": ids, "convention": "canonical"})
    con = Console(record=True, width=400)
    render._verdict(con, rep)
    return con.export_text()


@pytest.mark.parametrize(("layers", "ids", "why"), [
    (30, [-1, 14, 29], "id -1 (embedding output)"),
    (30, [1, 14, 29], "id 29 (last layer output)"),
    (4, [-1, 0, 1], "id -1 (embedding output)"),
    (4, [1, 2, 3], "id 3 (last layer output)"),
])
def test_sglang_ids_it_cannot_capture_are_not_written(layers: int, ids: list[int],
                                                      why: str) -> None:
    """SGLang's convention was the canonical ids as they are: "sglang [-1, 14, 29]", ids its
    capture hook cannot take (ANCHORS: no embedding, no last layer's output)."""
    assert conventions(ids, layers)["sglang"] is None
    text = _line(ids, layers)
    assert f"sglang {ids}" not in text
    assert "sglang cannot capture" in text and why in text


@pytest.mark.parametrize(("layers", "ids"), [(30, [1, 14, 26]), (4, [0, 1, 2])])
def test_inner_ids_keep_their_sglang_ids(layers: int, ids: list[int]) -> None:
    assert conventions(ids, layers)["sglang"] == ids
    assert f"sglang {ids}" in _line(ids, layers)


def test_vllm_edge_ids_say_newer_vllm_only() -> None:
    """vLLM id 0 (the embedding) and L (the last layer's output) read as any other id."""
    text = _line([-1, 14, 29], 30)
    assert "vllm [0, 15, 30] (0, 30: newer vLLM model files only)" in text
    assert "(0, 30: newer" not in _line([1, 14, 26], 30)


def test_missing_hf_index_says_why() -> None:
    """"hf_hidden_states None" named no reason."""
    text = _line([1, 14, 29], 30)
    assert "hf_hidden_states None" not in text
    assert "hf_hidden_states none (layer 29's output: hidden_states[30] is after the final " \
           "norm)" in text


@pytest.fixture(scope="module")
def three(target, tmp_path_factory) -> Path:
    """Data on layers 1, 3, 5 in three shards of two samples."""
    out = tmp_path_factory.mktemp("three")
    cfg = CaptureConfig(aux_layer_ids=TRUE, batch_size=6, samples_per_shard=2, max_len=96)
    capture(target, td.convs(), out, cfg, progress=False, log=lambda s: None)
    return out


def _damaged(three: Path, out: Path) -> Path:
    shutil.copytree(three, out)
    flip = out / "shard-00001.safetensors"
    raw = bytearray(flip.read_bytes())
    raw[-100] ^= 0xFF  # same size: only its hash tells
    flip.write_bytes(bytes(raw))
    cut = out / "shard-00002.safetensors"
    cut.write_bytes(cut.read_bytes()[:-100])
    return out


@pytest.mark.parametrize("full", [False, True])
def test_every_damaged_shard_is_named(three, target_dir, tmp_path, full: bool) -> None:
    """The shard check stopped at the first bad shard: shard-00002, cut short, went unnamed
    (a rerun after recapturing shard-00001 alone failed again)."""
    rep = doctor(data=_damaged(three, tmp_path / "bad"), target=str(target_dir),
                 samples=4, full_verify=full)  # samples 0, 2, 3, 5: every shard hashed
    found = [f.what for f in errors(rep, "shards")]
    assert len(found) == 2, found
    assert "shard-00001.safetensors: sha256" in found[0]
    assert "shard-00002.safetensors: " in found[1] and "the manifest says" in found[1]
    assert rep.exit_code() == 1


def test_data_other_than_the_drafters_own_is_not_a_config_to_rewrite(three, target,
                                                                     target_dir, tmp_path):
    """A drafter trained on `three` (layers 1, 3, 5, its config alike) checked against other
    data, of layers 0, 2, 4: the fix said "write config.aux_layer_ids: [0, 2, 4]", feeding the
    drafter layers its fc never learnt."""
    other = tmp_path / "d024"
    cfg = CaptureConfig(aux_layer_ids=[0, 2, 4], batch_size=6, samples_per_shard=3, max_len=96)
    capture(target, td.convs(), other, cfg, progress=False, log=lambda s: None)
    folder = td.make_drafter(tmp_path / "dr", target, TRUE)
    meta = json.loads((folder / "draftsmith.json").read_text())
    meta["data"]["folder"] = str(three.resolve())
    (folder / "draftsmith.json").write_text(json.dumps(meta))
    rep = doctor(data=other, drafter=folder, target=str(target_dir))
    (f,) = errors(rep, "wiring")
    assert f.what == (f"the drafter was trained on {three.resolve()}, of canonical layers "
                      "[1, 3, 5] as its config says, not on this data, which holds [0, 2, 4]")
    assert f.fix == (f"check the pair: pass --data {three.resolve()}, or retrain on this data")
    assert "write config.aux_layer_ids" not in f.fix and rep.exit_code() == 1
    assert not errors(doctor(data=three, drafter=folder, target=str(target_dir)), "wiring")
