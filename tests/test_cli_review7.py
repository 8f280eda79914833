"""Command-line review, seventh pass: a drafter folder given where a target goes (`targets
show d2`, `--target d2`) is named as a drafter of its recorded target, not as a folder that
lacks config.json."""

from __future__ import annotations

import json
import warnings

import pytest
from test_cli_review import run_main
from test_export import make

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter
from draftsmith.targets import load_target


def test_targets_show_of_a_drafter_folder_names_its_target(monkeypatch, capsys, target,
                                                            tmp_path):
    """It said "no config.json (not a Hugging Face checkpoint folder)"."""
    d2 = make(target, tmp_path / "d2")
    code, out, err = run_main(monkeypatch, capsys, "targets", "show", str(d2))
    assert code == 2 and not out
    assert err.strip() == (
        f"draftsmith: error: {d2}: a draftsmith drafter folder (draftsmith.json), not a "
        f"target; it was made for target {target.folder}: pass that instead (a target is an "
        "HF checkpoint folder, a .gguf file or 'default')")


def test_a_drafter_recording_no_target_says_so(target, tmp_path):
    d2 = make(target, tmp_path / "d2", target_source="")
    with pytest.raises(DraftsmithError, match=r"draftsmith drafter folder \(draftsmith.json\), "
                       "not a target; it records no target: pass its target's instead"):
        load_target(d2)


@pytest.mark.parametrize("fmt, layout", [("sglang", "SGLang"), ("speculators", "speculators")])
def test_an_exported_folder_is_named_by_its_layout(target, tmp_path, fmt, layout):
    """An export holds a config.json: it was read as a target's (or refused as one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export's own engine notes
        out = export_drafter(make(target, tmp_path / "d"), fmt, tmp_path / fmt)
    with pytest.raises(DraftsmithError) as e:
        load_target(out)
    assert str(e.value) == (
        f"{out}: an EAGLE-3 drafter folder in the {layout} layout, not a target; it was made "
        f"for target {target.folder}: pass that instead (a target is an HF checkpoint folder, "
        "a .gguf file or 'default')")


def test_a_recorded_default_is_named_default(target, tmp_path):
    d2 = make(target, tmp_path / "d2", target_source="default")
    with pytest.raises(DraftsmithError, match="made for target default: pass that"):
        load_target(d2)


def test_a_plain_folder_without_config_still_says_so(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({}))
    with pytest.raises(DraftsmithError, match=r"no config.json \(not a Hugging Face"):
        load_target(tmp_path)
