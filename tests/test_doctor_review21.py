"""Doctor review 21: every realignment, 1 to 3 tokens too, passes the first-states screen (a wrong
dropped token was named, and a layer lost, on a target whose first token weighs little), and a
re-pairing judges an aux slot beside the final hidden (shuffled samples whose final hidden was
stored before the final norm read as another target's data)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_doctor as td
import torch
from conftest import tiny_hf_model
from rich.console import Console
from test_doctor import TRUE, doctor
from test_doctor_review2 import edit_shards
from test_doctor_review18 import _shifted
from test_doctor_review19 import _capture, _swap

from draftsmith.data.shards import Dataset
from draftsmith.doctor import render, wiring
from draftsmith.doctor.verdict import conventions

# test_doctor's module fixtures: its tiny 8-layer target, data on layers 1, 3, 5 (96 tokens each)
target_dir, target = td.target_dir, td.target
FIRST, LEAD = (1, 3), (3, 92, 90, 76, 89, 6)  # the tiny target's BOS/template first, opening


@pytest.fixture(scope="module")
def sink(tmp_path_factory) -> tuple[Any, Path]:
    """A tiny target whose attention outputs are halved (its states lean on earlier tokens as
    little as a real target's lean on its attention-sink first token), and data of it."""
    from draftsmith.targets import load_target
    from draftsmith.targets.tokenizer import write_byte_tokenizer

    root = tmp_path_factory.mktemp("sink")
    hf = tiny_hf_model("llama", 0, num_hidden_layers=8)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.5)
    hf.save_pretrained(root / "t")
    write_byte_tokenizer(root / "t", vocab_size=hf.config.vocab_size)
    t = load_target(root / "t")
    return t, _capture(t, root / "d", TRUE)


@pytest.mark.parametrize(("by", "dropped"), [(-1, (3,)), (-2, (3, 92))])
def test_a_small_shift_names_the_tokens_really_dropped_and_every_layer(sink, tmp_path, by,
                                                                       dropped):
    """Unscreened, the BOS (1) put back in front of ids one ahead passed the probe: "the dropped
    first token 1", and aux[2] matched no layer (true_ids [1, 3, None]); two ahead, [3, 3]."""
    t, data = sink
    ds = Dataset(_shifted(data, tmp_path / "s", by))
    mm = wiring.match(t.build(torch.float32, "cpu"), ds, 8, 2, 256, True, FIRST, LEAD)
    assert mm.token_shift == by and mm.dropped == dropped and mm.true_ids() == TRUE
    assert [s.status for s in mm.slots] == ["exact"] * 4


class _PreNorm:
    """Data captured on layers 1, 3, 5, 7 read as layers 1, 3, 5 with layer 7's output stored
    as the final hidden (before the final norm, as a capture hooked on the last layer)."""

    def __init__(self, folder: Path) -> None:
        self.ds = Dataset(folder)
        self.manifest = {**self.ds.manifest, "aux_layer_ids": TRUE}

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = dict(self.ds[i])
        s["hidden"], s["aux"] = s["aux"][:, 3], s["aux"][:, :3]
        return s


def test_shuffled_samples_with_a_pre_norm_final_hidden_are_re_paired(target, tmp_path):
    """The final hidden alone matched no sample's live one: no pair, every slot "none" (read as
    data of another target, `--target` the fix), though each aux slot is sample 2's layers."""
    data = edit_shards(_capture(target, tmp_path / "d", [*TRUE, 7]), tmp_path / "sw", _swap)
    mm = wiring.match(target.build(torch.float32, "cpu"), _PreNorm(data), 8, 2, 256, True,
                      FIRST, LEAD)
    assert mm.paired == {0: 2, 5: 4} and mm.true_ids() == TRUE
    assert mm.rows[mm.slots[-1].best_row] == "layer 7" and mm.slots[-1].status == "exact"


def test_unshuffled_pre_norm_final_hidden_pairs_nothing(target, tmp_path):
    mm = wiring.match(target.build(torch.float32, "cpu"),
                      _PreNorm(_capture(target, tmp_path / "d", [*TRUE, 7])), 8, 2, 256, True,
                      FIRST, LEAD)
    assert not mm.paired and mm.true_ids() == TRUE


def test_each_convention_line_names_hf_hidden_states_indices():
    """HF's output_hidden_states index was missing: hidden_states[j + 1] is layer j's output,
    but hidden_states[L] is after the final norm, so the last layer's output has no index."""
    out = conventions([-1, 1, 4], 8)
    assert out["hf_hidden_states"] == [0, 2, 5] and out["vllm"] == [0, 2, 5]
    assert conventions([1, 3, 7], 8)["hf_hidden_states"] is None


def test_the_data_line_says_the_hf_indices(target, target_dir, tmp_path):
    rep = doctor(data=_capture(target, tmp_path / "d", TRUE), target=str(target_dir))
    con = Console(record=True, width=200)
    render._verdict(con, rep)
    assert "hf_hidden_states [2, 4, 6]" in con.export_text()
