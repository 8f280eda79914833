"""Export/import, seventh review: an export names the default target portably ("default") in
draftsmith's own record, so an import without --target finds it after its GGUF conversion's
cache folder is gone, while the engines' verifier still names a loadable HF folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_export import make
from test_import_review import _edit

import draftsmith.targets as targets
from draftsmith.errors import DraftsmithError
from draftsmith.export import export_drafter, import_drafter
from draftsmith.models.eagle3 import load_drafter
from draftsmith.targets import DEFAULT_NAME, cache_dir


@pytest.fixture
def default_is_tiny(target, monkeypatch, tmp_path):
    """`load_target("default")` as the real one works, on the tiny llama: the "conversion" is a
    copy into $DRAFTSMITH_CACHE/targets/<key>, made again where the cache lost it."""
    plain = targets.load_target
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache1"))

    def load(src=None):
        if src not in (None, "", "default"):
            return plain(src)
        folder = cache_dir() / "targets" / "0123456789abcdef"
        if not folder.is_dir():
            shutil.copytree(target.folder, folder)
        t = targets._load_folder(folder, "gguf", "/nowhere/smollm2.gguf")
        t.kind, t.source = "default", DEFAULT_NAME
        return t

    monkeypatch.setattr(targets, "load_target", load)
    return load


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _lose_the_cache(monkeypatch, tmp_path) -> None:
    shutil.rmtree(cache_dir())
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache2"))


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("given", [None, "default"])
def test_an_export_of_a_default_drafter_imports_after_the_cache_is_gone(
        target, default_is_tiny, tmp_path, monkeypatch, fmt, given):
    """draftsmith.target named the conversion's cache folder: after a cleared cache (or on
    another machine) `draftsmith import` without --target said the recorded target was gone."""
    src = make(target, tmp_path / "d", target_source="default")
    out = export_drafter(src, fmt, tmp_path / fmt, target=given)
    c = _config(out)
    assert c["draftsmith"]["target"] == "default"
    if fmt == "speculators":  # vLLM loads the verifier: still an HF folder
        verifier = c["speculators_config"]["verifier"]["name_or_path"]
        assert (Path(verifier) / "config.json").is_file()
    _lose_the_cache(monkeypatch, tmp_path)
    d = load_drafter(import_drafter(out, tmp_path / "imp"))
    assert d.cfg.target_source == "default"
    assert d.cfg.target_fingerprint == target.fingerprint


def test_an_import_given_the_default_records_default(target, default_is_tiny, tmp_path):
    """An import with --target default recorded the cache folder (the engine's verifier name)
    as the imported drafter's target."""
    out = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sgl")
    d = load_drafter(import_drafter(out, tmp_path / "imp", target="default"))
    assert d.cfg.target_source == "default"


def test_a_foreign_folder_imported_for_the_default_records_default(target, default_is_tiny,
                                                                   tmp_path, monkeypatch):
    """`_record_target` named the cache folder too: the imported drafter's doctor and export
    lost their target with the cache."""
    out = export_drafter(make(target, tmp_path / "d"), "sglang", tmp_path / "sgl")
    _edit(out, config=lambda c: c.pop("draftsmith"))  # as SpecForge writes it
    imp = import_drafter(out, tmp_path / "imp", target="default")
    d = load_drafter(imp)
    assert d.cfg.target_source == "default"
    again = export_drafter(imp, "sglang", tmp_path / "again")
    assert _config(again)["draftsmith"]["target"] == "default"
    _lose_the_cache(monkeypatch, tmp_path)
    assert load_drafter(import_drafter(again, tmp_path / "imp2")).cfg.target_source == "default"


def test_a_folder_target_is_still_recorded_absolute(target, tmp_path, monkeypatch):
    src = make(target, tmp_path / "d")
    out = export_drafter(src, "speculators", tmp_path / "sp")
    c = _config(out)
    assert c["draftsmith"]["target"] == str(target.folder.resolve())
    assert c["speculators_config"]["verifier"]["name_or_path"] == str(target.folder.resolve())


def test_a_recorded_hub_id_is_not_called_moved_or_deleted(target, tmp_path):
    """A speculators folder naming its verifier by hub id (as most published ones do) was
    refused as if that target had been "moved or deleted"."""
    sp = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp")
    _edit(sp, config=lambda c: (c["draftsmith"].pop("target"), c["speculators_config"][
        "verifier"].update(name_or_path="meta-llama/Llama-3.1-8B-Instruct")),
        weights=lambda w: w.pop("embed_tokens.weight"))
    with pytest.raises(DraftsmithError, match=r"records, meta-llama/Llama-3.1-8B-Instruct, is "
                       r"not here \(a hub id.*draftsmith loads local folders") as e:
        import_drafter(sp, tmp_path / "imp")
    assert "moved or deleted" not in str(e.value) and "\n" not in str(e.value)


def test_a_gguf_target_is_recorded_by_its_file_and_served_by_its_folder(
        target, default_is_tiny, tmp_path, monkeypatch):
    """--target x.gguf wrote its conversion's cache folder as draftsmith.target too."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    loaded = default_is_tiny("default")
    loaded.kind, loaded.source = "gguf", str(gguf)
    monkeypatch.setattr(targets, "load_target",
                        lambda src=None: loaded if src == str(gguf) else default_is_tiny(src))
    out = export_drafter(make(target, tmp_path / "d"), "speculators", tmp_path / "sp",
                         target=str(gguf))
    c = _config(out)
    assert c["draftsmith"]["target"] == str(gguf)
    assert c["speculators_config"]["verifier"]["name_or_path"] == str(loaded.folder.resolve())
