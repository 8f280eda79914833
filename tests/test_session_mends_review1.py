"""Mends from a read of the session's changes (2026-12-07): a record's own `data` list beside a
prompt, an old draftsmith SGLang export read one layer high, the doctor's mixup search on data
whose final states are its own, and a tied model pick told as a loss."""

from __future__ import annotations

import json
import warnings

import pytest
from test_export import make
from test_import_review import _relist

from draftsmith.data.prompts import parse_record
from draftsmith.export import export_drafter, import_drafter
from draftsmith.export.layout import ImportNote


@pytest.mark.parametrize("rec,user", [({"prompt": "hi", "data": []}, "hi"),
                                      ({"prompt": "hi", "data": [{"x": 1}]}, "hi"),
                                      ({"instruction": "do it", "data": [1]}, "do it")])
def test_a_prompt_beside_its_own_data_list_is_read_as_before(rec, user):
    """The UltraChat reader took any `data` list first: these records were refused."""
    conv = parse_record(rec)
    assert user in conv.first_user()


def test_an_sglang_export_whose_record_names_other_ids_is_noted(target, tmp_path):
    """draftsmith before 2026-12-07 wrote canonical [2, 3, 4] as [3, 4, 5] for SGLang; read
    now as outputs, import took [3, 4, 5] without a word though the folder records [2, 3, 4]."""
    folder = export_drafter(make(target, tmp_path / "d", aux=[2, 3, 4]), "sglang",
                            tmp_path / "sg", target=str(target.folder))
    assert json.loads((folder / "config.json").read_text())["draftsmith"][
        "aux_layer_ids_canonical"] == [2, 3, 4]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        import_drafter(folder, tmp_path / "ok", target=str(target.folder))
    assert not [w for w in said if "recorded the drafter's" in str(w.message)]
    _relist(folder, "sglang", [3, 4, 5])
    with pytest.warns(ImportNote, match=r"canonical \[3, 4, 5\], but the export recorded the "
                      r"drafter's as \[2, 3, 4\]"):
        import_drafter(folder, tmp_path / "old", target=str(target.folder))


def test_no_mixup_search_where_the_final_hidden_is_each_samples_own(monkeypatch):
    """An aux slot matching only approximately (bf16 storage of a large target) sent the doctor
    to run extra target forwards looking for shuffled samples, though the stored final hidden
    matched its own tokens exactly."""
    from types import SimpleNamespace

    from draftsmith.doctor import wiring

    slots = [SimpleNamespace(status="approximate"), SimpleNamespace(status="exact")]
    mm = SimpleNamespace(slots=slots, samples=[0, 1])
    monkeypatch.setattr(wiring, "_match", lambda *a, **k: mm)

    def searched(*a, **k):
        raise AssertionError("searched for shuffled samples")

    monkeypatch.setattr(wiring, "_mixups", searched)
    assert wiring.match(None, None, 4) is mm


def test_a_model_pick_that_ties_the_best_is_no_loss():
    from types import SimpleNamespace

    from draftsmith.tune.flags import model_pick_line

    rec = SimpleNamespace(regret_tps=0.0, regret_pct=0.0, predicted_best="tree 3/2/6",
                          setting="chain 3", rows=(), predicted_best_measured_tps=100.0)
    assert model_pick_line(rec) == ["  model's pick: the measured best (tied: tree 3/2/6)"]
