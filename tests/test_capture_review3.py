"""Capture, third review: a multi-rank capture over a single-process dataset, settings that are
no whole numbers, shards whose widths the manifest does not describe, a shard's bytes held
twice in memory, non-finite states, an empty input."""

from __future__ import annotations

import dataclasses
import tracemalloc
from pathlib import Path

import pytest
import torch

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.data.prompts import Conversation
from draftsmith.data.shards import MANIFEST, Dataset, Sample, ShardWriter, read_manifest, verify
from draftsmith.errors import DraftsmithError

CFG = CaptureConfig(aux_layer_ids=[-1, 0, 5], batch_size=4, samples_per_shard=2, max_len=400)


def convs(n: int = 5) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"q{i}?"},
                          {"role": "assistant", "content": f"a{i}."}]) for i in range(n)]


def run(target, model, out: Path, cfg: CaptureConfig = CFG, cs=None, **kw):
    return capture(target, convs() if cs is None else cs, out, cfg, progress=False, model=model,
                   log=lambda s: None, **kw)


def test_a_multi_rank_capture_over_a_single_process_dataset_is_refused_and_keeps_it(
        target, model, tmp_path, monkeypatch):
    """The ranks captured beside it and the merge wrote its manifest over the dataset there
    (another target's too), its shards left unlisted: a dataset lost without --overwrite."""
    run(target, model, tmp_path)
    before = (tmp_path / MANIFEST).read_bytes()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DraftsmithError, match=r"holds a dataset made with a different world_size "
                       r"\(1 there, 2 now\); use another folder or --overwrite"):
        run(target, model, tmp_path)
    assert (tmp_path / MANIFEST).read_bytes() == before and not (tmp_path / "rank-0").exists()
    run(target, model, tmp_path, overwrite=True)  # --overwrite still starts over
    assert (tmp_path / "rank-0" / MANIFEST).is_file() and not (tmp_path / MANIFEST).exists()


@pytest.mark.parametrize("change", [
    {"max_len": 300.0}, {"samples_per_shard": 2.5}, {"batch_size": True}, {"max_len": "400"},
    {"aux_layer_ids": [1.5, 3]}, {"aux_layer_ids": [True, 3]}, {"aux_layer_ids": "1,3"},
    {"dtype": "bfloat16"}, {"too_long": None}])
def test_settings_of_the_wrong_kind_are_one_error(change):
    """A float max_len was recorded in the manifest as 300.0, samples_per_shard 2.5 was a bare
    TypeError, aux id 1.5 was captured as layer 1 and True as layer 1."""
    key = next(iter(change))
    with pytest.raises(DraftsmithError) as e:
        CaptureConfig(**change)
    said = str(e.value)
    assert said.startswith(f"{key} must be ") and said.endswith(f", got {change[key]!r}"), said
    assert "\n" not in said


def sample(t: int, n_aux: int, h: int, sid: str = "s") -> Sample:
    return Sample(sid, torch.arange(t), torch.ones(t, dtype=torch.bool),
                  torch.zeros(t, n_aux, h), torch.zeros(t, h))


@pytest.mark.parametrize("bad, said", [
    (sample(4, 3, 16), r"holds aux states \[3, 16\] and hidden \[16\] a token, but the "
                       r"manifest says 2 aux layers of 8"),
    (Sample("s", torch.arange(4), torch.ones(3, dtype=torch.bool), torch.zeros(4, 2, 8),
            torch.zeros(4, 8)),
     r"sample 's': 4 input_ids, 3 loss_mask, 4 aux and 4 hidden rows"),
])
def test_a_shard_the_manifest_would_not_describe_is_refused_unwritten(tmp_path, bad, said):
    """A model of another width (capture's `model=`) was written under the manifest's
    hidden_size and aux ids: a dataset that read fine until training's first step."""
    w = ShardWriter(tmp_path, {"aux_layer_ids": [0, 2], "hidden_size": 8}, ("hidden_size",))
    with pytest.raises(DraftsmithError, match=said):
        w.write(0, [sample(3, 2, 8, "ok"), bad])
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST]
    assert read_manifest(tmp_path)["shards"] == []


def test_a_shard_is_written_without_its_bytes_held_in_memory(tmp_path):
    """The shard was serialized to one bytes object (safetensors' `save`, twice its size at
    the peak) beside the tensors: a 256-sample shard of an 8B target held 4x its size."""
    w = ShardWriter(tmp_path, {"aux_layer_ids": [0, 2], "hidden_size": 512}, ())
    samples = [sample(4096, 2, 512, f"s{i}") for i in range(2)]  # a 24 MiB shard
    tracemalloc.start()
    try:
        entry = w.write(0, samples)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert entry["bytes"] > 24 * 2**20 and peak < 8 * 2**20, peak
    assert verify(tmp_path)["samples"] == 2 and not list(tmp_path.glob(".*.tmp"))


class Overflowing(torch.nn.Module):
    """The target, but one conversation's states at one layer overflow (float16 past 65504)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, **kw):
        fo = self.model(tokens, positions, **kw)
        fo.aux[-1, 2, 1] = float("inf")
        return fo


def test_non_finite_states_are_refused_naming_the_conversation_and_what_is_kept(
        target, model, tmp_path):
    """inf states were stored: the capture finished and training's loss went NaN."""
    with pytest.raises(DraftsmithError, match=r"^capture: conversation \d \(id [0-9a-f]+\): the "
                       r"target's state at aux layer 0 is inf or NaN at token 2 \(compute dtype "
                       r"float32\); the target overflows at float32 .damaged weights\?.; nothing "
                       r"of it was stored, the 0 shard.s. finished before are kept$"):
        run(target, Overflowing(model), tmp_path, dataclasses.replace(CFG, samples_per_shard=5))
    assert read_manifest(tmp_path)["shards"] == []


def test_an_empty_input_says_so(target, model, tmp_path):
    """It said no conversation has assistant tokens (skipped: none)."""
    with pytest.raises(DraftsmithError, match=r"^no conversations to capture: the input is "
                       r"empty$"):
        run(target, model, tmp_path, cs=[])
    assert not tmp_path.joinpath(MANIFEST).exists()
    run(target, model, tmp_path / "d", cs=convs(1))
    assert len(Dataset(tmp_path / "d")) == 1
