"""Import, fifth review: an exported SGLang folder (no embedding) imported without --target
takes the target its config.json records, where that target loads and is the recorded one."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_export import make
from test_import_review import _edit

from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter
from draftsmith.models.eagle3 import load_drafter


def test_an_exported_sglang_folder_imports_with_its_recorded_target(target, tmp_path, capsys):
    """`import E_sgl -o D` was refused with "pass --target" although the export records its
    target (path and fingerprint), which `doctor --drafter E_sgl` finds untold."""
    sgl = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sgl")
    out = import_drafter(sgl, tmp_path / "imported")
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "no --target given; using the target its config.json " \
        f"records, {target.folder.resolve()} (fingerprint {target.fingerprint} matches)" in said
    d = load_drafter(out)
    assert torch.equal(d.embed_tokens.weight, target.weights["model.embed_tokens.weight"])
    assert d.cfg.target_fingerprint == target.fingerprint


def test_a_recorded_target_that_is_gone_or_other_keeps_the_refusal(target, tmp_path):
    sgl = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sgl")
    other = _edit(shutil.copytree(sgl, tmp_path / "other"),
                  config=lambda c: c["draftsmith"].update(target_fingerprint="0" * 16))
    with pytest.raises(DraftsmithError, match=r"pass --target to take it from there; the "
                       r"target config.json records, .* now has fingerprint .*not the recorded "
                       r"0{16}"):
        import_drafter(other, tmp_path / "o1")
    gone = _edit(shutil.copytree(sgl, tmp_path / "gone"),
                 config=lambda c: c["draftsmith"].update(target=str(tmp_path / "nowhere")))
    with pytest.raises(DraftsmithError, match=r"pass --target.*nowhere, is not here"):
        import_drafter(gone, tmp_path / "o2")
    bare = _edit(shutil.copytree(sgl, tmp_path / "bare"), config=lambda c: c.pop("draftsmith"))
    with pytest.raises(DraftsmithError, match=r"layer count is needed.*pass --target$"):
        import_drafter(bare, tmp_path / "o3")
