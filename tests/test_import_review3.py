"""Import leftovers: tensors SGLang skips, the engines' default ids on 3- and 4-layer targets,
a foreign folder's target recorded, and the import's warnings as doctor findings."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_folder
from test_export import make
from test_import_review import _edit

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter, read_any
from draftsmith.models.eagle3 import load_drafter, read_drafter_meta
from draftsmith.targets import load_target

IDS = "eagle_aux_hidden_state_layer_ids"


def _read(folder: Path, target) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = read_any(folder, target=str(target.folder))
    return d, [str(w.message) for w in caught]


def _no_ids(c: dict) -> None:
    c.pop(IDS, None)
    (c.get("eagle_config") or {}).pop(IDS, None)


EXTRA = {"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(8), "extra.scale": torch.ones(2)}


def test_tensors_sglang_skips_are_left_out_with_one_warning(target, tmp_path):
    """SGLang's LlamaForCausalLMEagle3.load_weights skips names it has no parameter for (an
    EAGLE checkpoint's rotary inv_freq); import refused such a folder as "unexpected tensors"."""
    src = make(target, tmp_path / "d")
    out = _edit(export_drafter(src, "sglang", tmp_path / "sg"), weights=lambda w: w.update(EXTRA))
    d, said = _read(out, target)
    assert torch.equal(d.fc.weight, load_drafter(src).fc.weight)
    assert len(said) == 1 and "SGLang does not load" in said[0]
    assert all(n in said[0] for n in EXTRA)
    _edit(out, weights=lambda w: w.pop("norm.weight"))  # a missing one is still refused
    with pytest.raises(DraftsmithError, match=r"missing tensors \['norm.weight'\]"), \
            pytest.warns(UserWarning, match="SGLang does not load"):
        read_any(out, target=str(target.folder))


def test_speculators_stays_strict_and_sglang_extra_layers_are_refused(target, tmp_path):
    """vLLM's loader raises on a name it does not know; SGLang builds `additional_layers` for
    num_hidden_layers > 1, which import would have left out as unknown tensors."""
    src = make(target, tmp_path / "d")
    sp = _edit(export_drafter(src, "speculators", tmp_path / "sp"),
               weights=lambda w: w.update(EXTRA))
    with pytest.raises(DraftsmithError, match="unexpected tensors"):
        read_any(sp, target=str(target.folder))
    sg = _edit(export_drafter(src, "sglang", tmp_path / "sg"),
               config=lambda c: c.update(num_hidden_layers=2))
    with pytest.raises(DraftsmithError, match="num_hidden_layers is 2"):
        read_any(sg, target=str(target.folder))
    _edit(sg, config=lambda c: c.update(num_hidden_layers=1, bias=True))  # SGLang's fc bias
    with pytest.raises(DraftsmithError, match="bias true"):
        read_any(sg, target=str(target.folder))


@pytest.mark.parametrize(("layers", "fed"), [(3, [-1, 0, 1]), (4, [0, 1, 1])])
def test_default_ids_of_short_targets_read_ascending(layers, fed):
    """The engines' defaults are inputs of [2, L//2, L-3]: [2, 1, 0] and [2, 2, 1] here. They
    capture walking the layers, so they feed them ascending; import kept the listed order."""
    from draftsmith.doctor.engines import feed_from_written
    from draftsmith.export.layout import imported_ids

    for layout in ("sglang", "speculators"):
        assert imported_ids({}, layout, layers, "x") == fed
    assert feed_from_written(None, "vllm", layers).canonical == fed
    assert ("repeat a layer" in feed_from_written(None, "sglang", layers).note) == (layers == 4)


def test_a_3_layer_target_default_ids_import_ascending(tmp_path):
    t3 = load_target(write_tiny_folder(tmp_path / "t3", "llama", num_hidden_layers=3))
    out = _edit(export_drafter(make(t3, tmp_path / "d", aux=[-1, 0, 1]), "speculators",
                               tmp_path / "sp"), config=_no_ids)
    d, said = _read(out, t3)
    assert d.cfg.aux_layer_ids == [-1, 0, 1] and not [m for m in said if "layer" in m]


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_a_foreign_folder_records_the_target_it_was_checked_against(target, tmp_path, layout):
    """A folder without draftsmith's record imported with --target kept an empty fingerprint:
    a later command took any target of the same shapes."""
    folder = _edit(export_drafter(make(target, tmp_path / "d"), layout, tmp_path / layout),
                   config=lambda c: c.pop("draftsmith"))
    out = import_drafter(folder, tmp_path / "imp", target=str(target.folder))
    cfg = read_drafter_meta(out)["config"]
    assert cfg["target_fingerprint"] == target.fingerprint
    assert cfg["target_source"] == str(Path(target.folder).resolve())
    twin = write_tiny_folder(tmp_path / "twin", "llama", seed=7)
    with pytest.raises(DraftsmithError, match="records its target as"):
        read_any(out, target=str(twin))
    bare = import_drafter(tmp_path / "imp", tmp_path / "again")  # no --target: nothing invented
    assert read_drafter_meta(bare)["config"]["target_fingerprint"] == target.fingerprint


def test_doctor_json_reports_import_warnings_as_findings(target, tmp_path):
    """The doctor's run loads the folder as import reads it; what that reading warned (the
    stored embedding SGLang replaces, unsorted ids) was a Python warning, not a finding."""
    import typer
    from typer.testing import CliRunner

    from draftsmith.doctor import doctor as command

    app = typer.Typer()
    app.command()(command)
    app.command("other")(lambda: None)
    out = _edit(export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sg"),
                config=lambda c: c["eagle_config"].update({IDS: [1, 4, 2]}),
                weights=lambda w: w.__setitem__("embed_tokens.weight", torch.randn(128, 64)))
    res = CliRunner().invoke(app, ["doctor", "--drafter", str(out), "--target",
                                   str(target.folder), "--json", "--prompts", "1",
                                   "--max-new-tokens", "2", "--steps", "1"])
    rep = json.loads(res.output[res.output.index("{"):])
    loads = [f for f in rep["findings"] if f["check"] == "loads"]
    assert [f["severity"] for f in loads] == ["warning", "warning"], rep["findings"]
    whats = " | ".join(f["what"] for f in loads)
    assert "embed_tokens.weight differs" in whats and "not ascending" in whats
    assert all(f["fix"] and f["where"] == str(out) for f in loads)
