"""Import review 9: norm flags of SGLang-layout folders (SpecForge, NVIDIA ModelOpt) and
export-then-import round trips."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from test_export import make
from test_export_review import engine_folder

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, read_any
from draftsmith.export.layout import ImportNote
from draftsmith.models.eagle3 import load_drafter


def _fused_equal(a, b) -> bool:
    aux = torch.randn(1, 5, 3, a.cfg.target_hidden_size)
    return torch.equal(a.fuse(aux), b.fuse(aux))


@pytest.mark.parametrize("where", ["eagle_config", "top"])
def test_sglang_layout_reads_norm_before_fc(target, tmp_path, where):
    """vLLM's llama_eagle3.py builds `input_norm` from eagle_config's norm_before_fc (PR
    #42143, NVIDIA's checkpoints), else the top-level one; the import ignored both, left out
    input_norm.weight as a tensor SGLang does not load, and drafted without that norm."""
    d = load_drafter(make(target, tmp_path / "d", norm_before_fc=True))
    with torch.no_grad():
        d.input_norm.weight.uniform_(0.5, 1.5)
    if where == "top":
        out = engine_folder(d, target, tmp_path / "sg", norm_before_fc=True)
    else:
        out = engine_folder(d, target, tmp_path / "sg")
        cfg = json.loads((out / "config.json").read_text())
        cfg["eagle_config"]["norm_before_fc"] = True
        (out / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImportNote)
        back = read_any(out, target=str(target.folder))
    assert back.cfg.norm_before_fc
    assert torch.equal(back.input_norm.weight, d.input_norm.weight)
    assert _fused_equal(back, d)


def test_sglang_layout_eagle_config_flag_wins_over_top_level(target, tmp_path):
    """vLLM reads eagle_config's norm_before_fc first: false there turns off a true top level
    (its loader then skips input_norm.*, as the import leaves it out, named)."""
    d = load_drafter(make(target, tmp_path / "d"))
    out = engine_folder(d, target, tmp_path / "sg", norm_before_fc=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["norm_before_fc"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    assert not read_any(out, target=str(target.folder)).cfg.norm_before_fc


def test_sglang_layout_nested_flag_as_text_refused(target, tmp_path):
    d = load_drafter(make(target, tmp_path / "d"))
    out = engine_folder(d, target, tmp_path / "sg")
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"]["norm_before_fc"] = "false"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match=r"eagle_config\.norm_before_fc is \"false\""):
        read_any(out, target=str(target.folder))


def test_sglang_layout_norm_output_reading_is_said(target, tmp_path):
    """SpecForge's Eagle-3.1 config writes norm_output true; vLLM's and SGLang's Eagle-3
    models then feed the normed state back to the next step, and the import reads it so (it
    kept the plain reading of SpecForge before PR #879 until SGLang's llama_eagle3.py was
    read: `aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux`),
    saying in one line which reading it took."""
    d = load_drafter(make(target, tmp_path / "d", fc_norm=True))
    out = engine_folder(d, target, tmp_path / "sg", fc_norm=True, norm_output=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = read_any(out, target=str(target.folder))
    assert back.cfg.norm_output
    said = [str(w.message) for w in caught if "norm_output" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0]


@pytest.mark.parametrize("flags", [{}, {"norm_before_fc": True, "norm_before_residual": True},
                                   {"fc_norm": True, "norm_output": True}])
def test_speculators_round_trip_is_bit_equal(target, tmp_path, flags):
    d = load_drafter(make(target, tmp_path / "d", **flags))
    out = export_drafter(tmp_path / "d", "speculators", tmp_path / "sp",
                         target=str(target.folder))
    back = read_any(out, target=str(target.folder))
    for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert getattr(back.cfg, k) == getattr(d.cfg, k), k
    want, got = d.state_dict(), back.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_sglang_round_trip_is_bit_equal(target, tmp_path):
    d = load_drafter(make(target, tmp_path / "d"))
    out = export_drafter(tmp_path / "d", "sglang", tmp_path / "sg", target=str(target.folder))
    back = read_any(out, target=str(target.folder))
    want, got = d.state_dict(), back.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert back.cfg.aux_layer_ids == d.cfg.aux_layer_ids
