"""Import, sixth review: an engine folder whose aux ids name no layer of the target is refused
in the ids as written there (the doctor's words), not in a converted id the user never wrote."""

from __future__ import annotations

import pytest
from test_export import make
from test_import_review import _relist

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter
from draftsmith.models.eagle3 import load_drafter


@pytest.mark.parametrize(("layout", "ids", "words"), [
    ("sglang", [1, 3, 6], "SGLang reads [1, 3, 6] as the outputs of layers [1, 3, 6]: id 6 is "
     "out of range for this target (6 layers: it would fail to load the drafter)"),
    ("speculators", [1, 3, 7], "vLLM reads [1, 3, 7] as the inputs of layers [1, 3, 7]: id 7 is "
     "out of range for this target (6 layers: it would fail to load the drafter)"),
])
def test_ids_naming_no_layer_are_refused_in_the_folders_own_numbers(target, tmp_path, layout,
                                                                    ids, words):
    """Import said "[-1, 1, 3] out of range for this target: aux layer ids [-2] out of range:
    canonical ids ... must lie in [-1, 5]": a -2 the user never wrote."""
    folder = export_drafter(make(target, tmp_path / "d"), layout, tmp_path / layout,
                            target=str(target.folder))
    _relist(folder, layout, ids)
    with pytest.raises(DraftsmithError) as e:
        import_drafter(folder, tmp_path / "out", target=str(target.folder))
    msg = str(e.value)
    key = ("eagle_config.eagle_aux_hidden_state_layer_ids" if layout == "sglang"
           else "eagle_aux_hidden_state_layer_ids (top level)")
    assert msg == (f"{folder / 'config.json'}: {key}: {words} (fix: write there the ids of the "
                   f"layers the drafter was trained on; `draftsmith doctor --drafter {folder}` "
                   "names them)")
    assert "[-2]" not in msg and "canonical ids" not in msg and "\n" not in msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_a_folder_whose_ids_name_layers_still_imports(target, tmp_path, layout):
    folder = export_drafter(make(target, tmp_path / "d"), layout, tmp_path / layout,
                            target=str(target.folder))
    out = import_drafter(folder, tmp_path / "out", target=str(target.folder))
    assert load_drafter(out).cfg.aux_layer_ids == load_drafter(tmp_path / "d").cfg.aux_layer_ids
