"""Doctor review 6: the wiring findings' words. A final hidden from another target or stored
before the final norm, aux slots out of order, a manifest listing another number of ids, and
layers whose states cannot be told apart, each named as it is with a fix that works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_doctor as td
from conftest import write_tiny_folder
from test_doctor import TRUE, convs, doctor, errors
from test_doctor_review2 import edit_shards

from draftsmith.data.capture import CaptureConfig, capture
from draftsmith.targets import load_target

target_dir, target = td.target_dir, td.target


@pytest.fixture(scope="module")
def last(target, tmp_path_factory) -> Path:
    """Data on layers 1, 3 and 7 (the last): aux[2] holds the hidden before the final norm."""
    out = tmp_path_factory.mktemp("last") / "d"
    capture(target, convs(2), out, CaptureConfig(aux_layer_ids=[1, 3, 7], max_len=48),
            progress=False, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> tuple[Path, Path]:
    """A target whose layer 2 adds nothing (layers 1 and 2 hold the same states), data on
    TRUE."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("twin")
    folder = write_tiny_folder(root / "t", "llama", num_hidden_layers=8)
    w = load_file(str(folder / "model.safetensors"))
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        w[f"model.layers.2.{name}.weight"].zero_()
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    capture(load_target(folder), convs(2), root / "d",
            CaptureConfig(aux_layer_ids=TRUE, max_len=48), progress=False, log=lambda s: None)
    return folder, root / "d"


def _hidden(rep) -> object:
    (f,) = [f for f in errors(rep, "wiring") if f.what.startswith("the stored final hidden")]
    return f


def _relisted(src: Path, dst: Path, ids: object) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["aux_layer_ids"] = ids
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_a_final_hidden_from_another_target_matches_no_live_state(last, tmp_path):
    """It read "best matches final norm (status none), not the live hidden after the final
    norm": the nearest row named as a match, and denied in one breath."""
    other = write_tiny_folder(tmp_path / "other", "llama", seed=1, num_hidden_layers=8)
    f = _hidden(doctor(data=last, target=str(other)))
    assert f.what.startswith("the stored final hidden matches no live state clearly "
                             "(nearest: final norm,")
    assert "status" not in f.what and "--target" in f.fix


def test_a_final_hidden_before_the_final_norm_is_named_so(last, target_dir, tmp_path):
    """It read "best matches layer 7", with a fix to recapture alone."""
    def prenorm(t: dict) -> None:
        t["hidden"][:] = t["aux"][:, 2]

    rep = doctor(data=edit_shards(last, tmp_path / "pre", prenorm), target=str(target_dir))
    f = _hidden(rep)
    assert f.what.startswith("the stored final hidden is the last layer's output before the "
                             "final norm (layer 7,")
    assert f.fix.startswith("apply the target's final norm to the stored hidden, or recapture")
    assert rep.wiring["true_ids"] == [1, 3, 7]
    assert errors(doctor(data=last, target=str(target_dir)), "wiring") == []


def test_aux_slots_out_of_order_get_a_fix_export_accepts(last, target_dir, tmp_path):
    """The fix said to write [7, 3, 1] in the manifest: `train` takes it, `export` refuses."""
    def flip(t: dict) -> None:
        t["aux"][:] = t["aux"].flip(1)

    rep = doctor(data=edit_shards(last, tmp_path / "flip", flip), target=str(target_dir))
    (f,) = [f for f in errors(rep, "wiring") if "manifest says" in f.what]
    assert "the data holds [7, 3, 1]" in f.what
    assert "to [7, 3, 1]" not in f.fix
    assert f.fix.startswith("recapture with ascending ids (`draftsmith data capture "
                            "--aux-layers 1,3,7`), or reorder the stored aux slots to [1, 3, 7]")


@pytest.mark.parametrize("ids", [[1, 3], [1, 3, 7, 5]])
def test_a_manifest_listing_another_number_of_ids_is_quoted(last, target_dir, tmp_path, ids):
    """Two ids for three slots read "the manifest says [1, 3, None]"; four said nothing."""
    rep = doctor(data=_relisted(last, tmp_path / "m", ids), target=str(target_dir))
    (f,) = [f for f in errors(rep, "wiring") if "manifest" in f.what]
    assert f.what.startswith(f"the manifest lists aux_layer_ids {ids} but the shards hold 3 "
                             "aux slots, of layers [1, 3, 7]")
    assert "None" not in f.what and f.fix.startswith("set aux_layer_ids in manifest.json to "
                                                     "[1, 3, 7]")


def test_layers_alike_are_said_indistinct_and_a_manifest_outside_them_is_set(twin, tmp_path):
    """A tie claimed "feeding any of them feeds the same states"; a manifest id outside the
    alike layers got "check --target; recompare with more --samples"."""
    folder, data = twin
    rep = doctor(data=data, target=str(folder))
    (f,) = [f for f in rep.findings if f.check == "wiring"]
    assert f.severity == "info" and "feeds the same states" not in f.what
    assert "cannot be told apart at this capture's precision" in f.what
    rep = doctor(data=_relisted(data, tmp_path / "m", [0, 3, 5]), target=str(folder))
    (f,) = errors(rep, "wiring")
    assert "matches canonical layers [1, 2] alike" in f.what
    assert "the manifest's 0 is none of them" in f.what and "--samples" not in f.fix
    assert f.fix.startswith("set aux_layer_ids in manifest.json to [1, 3, 5]")
