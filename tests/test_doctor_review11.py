"""Doctor review 11: a speculators folder checked without --engine is held to vLLM's capture
limits (only vLLM serves that layout), not SGLang's."""

from __future__ import annotations

import warnings

from test_doctor import doctor
from test_export import make

from draftsmith.export import export_drafter


def test_a_speculators_folder_gets_vllms_capture_advice_not_sglangs(target, tmp_path):
    """Without --engine the finding said "SGLang's capture hook cannot provide" the embedding,
    for a folder SGLang does not load, and said nothing of the vLLM versions that fail on it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export's own vLLM edge warning
        sp = export_drafter(make(target, tmp_path / "d", aux=[-1, 2, 4]), "speculators",
                            tmp_path / "sp")
    rep = doctor(drafter=sp, target=str(target.folder))
    (f,) = [f for f in rep.findings if f.check == "capturable"]
    assert f.severity == "warning" and "SGLang" not in f.what
    assert f.what.startswith("id -1 needs vLLM id 0")
    assert f.fix.startswith("serve it with newer vLLM model files")
    sgl = doctor(drafter=sp, target=str(target.folder), engine="sglang")
    assert any("SGLang's capture hook" in f.what for f in sgl.findings
               if f.check == "capturable")  # an explicit --engine still rules


def test_a_foreign_speculators_folder_naming_layer_l_is_told_of_older_vllm(target, tmp_path):
    """A speculators folder of another trainer (no draftsmith record) whose top-level ids name
    L, the last layer's output (speculators' data generation appends it): the doctor checked
    nothing, so a user on an older vLLM, which fails on it, heard no word."""
    from test_import_review import _edit

    sp = export_drafter(make(target, tmp_path / "d", aux=[0, 2, 4]), "speculators",
                        tmp_path / "sp")
    layers = target.cfg.num_layers
    _edit(sp, config=lambda c: (c.pop("draftsmith"),
                                c.update(eagle_aux_hidden_state_layer_ids=[1, 3, layers])))
    rep = doctor(drafter=sp, target=str(target.folder))
    (f,) = [f for f in rep.findings if f.check == "capturable"]
    assert f.severity == "warning"
    assert f.what.startswith(f"id {layers - 1} needs vLLM id {layers}; vLLM aux layer id "
                             f"{layers} (the last layer's output)")
    ok = _edit(sp, config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 5]))
    assert not [f for f in doctor(drafter=ok, target=str(target.folder)).findings
                if f.check == "capturable"]
