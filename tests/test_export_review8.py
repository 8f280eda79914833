"""Export, eighth review: vLLM's edge aux ids (0 and L) advised from one place, so export's
warning and the doctor's finding say the same."""

from __future__ import annotations

import warnings

import pytest
from test_export import make

from draftsmith.doctor.checks import capturable
from draftsmith.export import export_drafter


@pytest.mark.parametrize("aux", [[-1, 2, 5], [0, 2, 5], [-1, 2, 4]])
def test_export_and_doctor_give_the_same_vllm_edge_advice(target, tmp_path, aux):
    """The two wordings had drifted: the export told to retrain "on layers between", the
    doctor named them; each now says what the other does, the layers to capture included."""
    layers = target.cfg.num_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_drafter(make(target, tmp_path / "d", aux=aux), "speculators", tmp_path / "sp")
    (said,) = [str(w.message) for w in caught if "vLLM aux layer id" in str(w.message)]
    found = capturable(aux, layers, "vllm", "x")
    assert found and all(f.severity == "warning" for f in found)
    assert said == f"{'; '.join(f.what for f in found)}: {found[0].fix}"
    assert said.endswith("`draftsmith data capture --aux-layers 0,2,4`")  # not "layers between"
    for i, j in ((-1, 0), (layers - 1, layers)):
        assert (f"id {i} needs vLLM id {j}" in said) == (i in aux)


def test_no_edge_no_advice(target, tmp_path):
    assert capturable([0, 2, 4], target.cfg.num_layers, "vllm", "x") == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_drafter(make(target, tmp_path / "d", aux=[0, 2, 4]), "speculators",
                       tmp_path / "sp")


def test_layer_zero_first_is_written_for_sglang_as_it_is(target, tmp_path):
    """Data capture's default on a 4-7 layer target starts at layer 0's output, which SGLang's
    Llama classes read from id 0 (they add 1, on every version): export refused it, having read
    SGLang by PR #25454's DeepSeek-V2 rule (a list not starting at 1 = inputs, so no list served
    it), and sent the user to retrain."""
    import json

    src = make(target, tmp_path / "d", aux=[0, 2, 4])
    out = export_drafter(src, "sglang", tmp_path / "sg")
    c = json.loads((out / "config.json").read_text())
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
