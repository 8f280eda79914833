"""Mends after session 60's final read: each found by a probe of that session's changes."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from test_doctor_review22 import three  # noqa: F401 - data on layers 1, 3, 5, three shards
from test_tune_cli import _tiny_pair
from test_tune_review21 import _fakes

from draftsmith.errors import DraftsmithError
from draftsmith.tune.cost_model import Measurement


@pytest.mark.parametrize("text", ["1 0", "1 4,x", "-1 4"])
def test_the_comma_hint_rewrites_only_into_a_list_that_passes(text: str) -> None:
    """`_comma_hint` rewrote '1 0' as '--steps 1,0', itself refused."""
    from draftsmith.options import int_list

    with pytest.raises(DraftsmithError) as e:
        int_list(text, "--steps")
    assert "separate values with commas" not in str(e.value)
    with pytest.raises(DraftsmithError, match="as --steps 1,4$"):
        int_list("1 4", "--steps")


def test_a_csv_of_cr_line_ends_is_not_blamed_on_quotes(tmp_path: Path) -> None:
    from draftsmith.data.prompts import load_prompts

    path = tmp_path / "mac.csv"
    path.write_bytes(b"prompt\rhello there\rsecond one\r")
    with pytest.raises(DraftsmithError, match="CR alone") as e:
        load_prompts(path, strict=True)
    assert "quotes" not in str(e.value)


def test_a_greedy_short_run_is_not_told_to_rerun_or_reseed() -> None:
    from draftsmith.data.selfmade import MagpieConfig, _short

    stats = {"kept": 0, "duplicates": 0, "length_filtered": 1, "unfinished": 0,
             "bare_openings": 0}
    said = _short(stats, MagpieConfig(n=1, temperature=0.0), 1)
    assert "greedy decodes each opening alike" in said and "--seed" not in said
    assert "another --seed" in _short(stats, MagpieConfig(n=1), 1)


def test_a_demo_target_recorded_relative_is_left_to_the_data_stage(tmp_path: Path) -> None:
    """make.json holds --target as typed; from another folder a relative one named another
    place, and the same target was refused as another's."""
    from draftsmith.demo import check_demo_target

    (tmp_path / "out" / "data").mkdir(parents=True)
    (tmp_path / "out" / "data" / "make.json").write_text(json.dumps({"target": "models/x"}))
    check_demo_target(tmp_path / "out", "x")
    (tmp_path / "out" / "data" / "make.json").write_text(json.dumps({"target": "/models/x"}))
    with pytest.raises(DraftsmithError, match="holds the demo of another target"):
        check_demo_target(tmp_path / "out", "/models/y")


def test_a_model_listing_that_cannot_be_read_is_left_to_the_answers() -> None:
    """An HTML page at /v1/models made the openai client raise AttributeError out of
    check_listed: a run that had worked with --model stopped on a traceback."""
    from draftsmith.data.regenerate import check_listed

    class Models:
        def list(self):
            raise AttributeError("'str' object has no attribute '_set_private_attributes'")

    class Client:
        models = Models()

    said: list[str] = []
    check_listed(Client(), "http://127.0.0.1:9/v1", "m", said.append)
    assert said == []


def _oom_at_batch_2(eng, s, ids, b, *a):
    if b == 2:
        raise torch.OutOfMemoryError("CUDA out of memory")
    return Measurement(s, b, 100.0 + 10 * s.steps + b)


def test_a_batch_where_every_setting_failed_recommends_none(tmp_path, monkeypatch) -> None:
    """The choice fell back to the best prediction, a setting just seen failing."""
    from draftsmith.tune.cli import run_tune

    folder, prompts = _tiny_pair(tmp_path)
    _fakes(monkeypatch, _oom_at_batch_2)
    report = run_tune(tmp_path / "d", str(folder), prompts, [1, 2], 3, 8, 2, "cpu",
                      torch.float32, False, tmp_path / "tune", max_topk=1)
    saved = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert [r["batch"] for r in saved["recommendations"]] == [1]
    last = report["texts"][-1]
    assert last.startswith("batch 2: no setting ran, so none is recommended")
    assert "failed: no speculation" in last


def test_sglang_export_writes_fc_norm_and_norm_output_and_reads_them_back(target, tmp_path):
    """SGLang's newer llama_eagle3.py reads both flags; the export refused them while the import
    read them, so a SpecForge folder imported could not go back to its own layout."""
    from test_export import make

    from draftsmith.export import export_drafter, read_any
    from draftsmith.models.eagle3 import load_drafter

    src = make(target, tmp_path / "d", fc_norm=True, norm_output=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_drafter(src, "sglang", tmp_path / "sg", target=str(target.folder))
    assert any("fc_norm and norm_output written to config.json" in str(w.message)
               for w in caught)
    c = json.loads((out / "config.json").read_text())
    assert c["fc_norm"] is True and c["norm_output"] is True
    back, d = read_any(out, target=str(target.folder)), load_drafter(src)
    assert back.cfg.fc_norm and back.cfg.norm_output
    want, got = d.state_dict(), back.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(DraftsmithError, match="norm_before_fc"):
        export_drafter(make(target, tmp_path / "nb", norm_before_fc=True), "sglang",
                       tmp_path / "sg2", target=str(target.folder))


def test_a_manifest_wide_fault_is_said_once(three, tmp_path) -> None:  # noqa: F811
    """A wrong dtype in manifest.json was one error for every shard after the first."""
    from draftsmith.data.shards import read_manifest
    from draftsmith.doctor.checks import data_files

    folder = shutil.copytree(three, tmp_path / "edited")
    m = json.loads((folder / "manifest.json").read_text())
    m["dtype"] = "float16" if m["dtype"] != "float16" else "bfloat16"
    (folder / "manifest.json").write_text(json.dumps(m))
    found = [f for f in data_files(folder, read_manifest(folder), None) if f.check == "dtype"]
    assert len(found) == 1, [f.what for f in found]


def test_the_doctors_capturable_ids_on_a_one_layer_target() -> None:
    """On one layer the default aux layers raise, naming the very ids -1,0; the doctor's fix
    for an engine that cannot capture them raised it instead of saying what can be given."""
    from draftsmith.doctor.engines import capturable_ids

    assert capturable_ids("vllm", 1, 2) == [-1, 0]
    assert capturable_ids("sglang", 1, 2) is None


def test_vllm_edge_ids_on_a_one_layer_target_warn_not_raise() -> None:
    """Every id of a one-layer target is an edge; the export's warning raised the default aux
    layers' refusal instead, telling the user to give the ids given."""
    from draftsmith.export.speculators import warn_edge_ids

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        warn_edge_ids([-1, 0], 1)
