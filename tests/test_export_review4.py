"""Export, fourth review: an imported drafter whose aux ids repeat a layer, and values a
--dtype cannot hold."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from test_export import make
from test_import_review import _edit

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter


def _no_ids(c: dict) -> None:
    c.pop("eagle_aux_hidden_state_layer_ids")
    (c.get("eagle_config") or {}).pop("eagle_aux_hidden_state_layer_ids", None)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_refuses_aux_ids_that_repeat_a_layer(target, tmp_path, fmt):
    """A folder naming no ids imports the engines' defaults, [1, 2, 2] on this 6-layer target;
    its export wrote [1, 2, 2] (SGLang) / [2, 3, 3] (vLLM), and each engine then fed 2 states
    to an fc of 3."""
    sg = _edit(export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg"),
               config=_no_ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        imported = import_drafter(sg, tmp_path / "imp", target=str(target.folder))
    said = [str(w.message) for w in caught]
    assert any("repeat a layer" in m and "`draftsmith export` refuses" in m for m in said), said
    with pytest.raises(DraftsmithError, match=r"aux layers \[1, 2, 2\] repeat a layer.*made "
                       r"for 3 states, would get 2.*import it again"):
        export_drafter(imported, fmt, tmp_path / "out", target=str(target.folder))
    assert not (tmp_path / "out").exists()


def _big(folder, value: float) -> None:
    def edit(w: dict) -> None:
        w["fc.weight"] = w["fc.weight"].clone()
        w["fc.weight"][0, 0] = value
    _edit(folder, weights=edit)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_dtype_fp16_refuses_values_past_its_range(target, tmp_path, fmt):
    """--dtype fp16 wrote a weight of 1e5 as inf without a word."""
    d = make(target, tmp_path / "d")
    _big(d, 1e5)
    with pytest.raises(DraftsmithError, match=r"--dtype float16: the drafter's fc.weight holds "
                       r"values up to 100000 in magnitude, past its largest \(65504\).*bf16"):
        export_drafter(d, fmt, tmp_path / "out", dtype=torch.float16)
    assert not (tmp_path / "out").exists()
    out = export_drafter(d, fmt, tmp_path / "bf", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["architectures"]


def test_export_dtype_fp16_keeps_values_that_round_into_its_range(target, tmp_path):
    d = make(target, tmp_path / "d")
    _big(d, 65510.0)  # rounds to 65504, not inf
    export_drafter(d, "sglang", tmp_path / "out", dtype=torch.float16)


def test_a_float16_run_dtype_warns_of_values_past_its_range():
    """A kept float32 drafter beside a float16 target: the engines load it in float16 (its
    config names the target's dtype), a value past 65504 becoming inf there."""
    from draftsmith.export.layout import TargetInfo, run_dtype

    info = TargetInfo(4, 64, 128, dtype="float16")
    w = {"fc.weight": torch.tensor([[1.0, -7e4]]), "d2t": torch.zeros(3, dtype=torch.long)}
    with pytest.warns(UserWarning, match=r"fc.weight holds values up to 70000.*--dtype bfloat16"):
        assert run_dtype(w, info) == "float16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_dtype(w, TargetInfo(4, 64, 128, dtype="bfloat16")) == "bfloat16"
        assert run_dtype({"fc.weight": torch.ones(2)}, info) == "float16"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_export_refuses_weights_that_are_not_finite(target, tmp_path, bad):
    """A drafter holding a NaN (an imported one, or weights edited by hand) was exported as it
    was, and the engines served it."""
    d = make(target, tmp_path / "d")
    _big(d, bad)
    with pytest.raises(DraftsmithError, match=r"the drafter's fc.weight holds NaN or inf"):
        export_drafter(d, "speculators", tmp_path / "out")
    assert not (tmp_path / "out").exists()
