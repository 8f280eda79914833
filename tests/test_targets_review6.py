"""Targets, sixth review: a drafter trained before targets were recorded portably names the
default by its GGUF conversion's cache folder; that folder reads as "default" wherever a
recorded target is read (loading it, an export's record), whatever cache it lay in."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from test_export import make

import draftsmith.targets as targets
from draftsmith.export import export_drafter
from draftsmith.targets import DEFAULT_NAME, cache_dir, load_target, portable_source


@pytest.fixture
def default_gguf(tmp_path, monkeypatch) -> Path:
    """A stand-in for the embedded GGUF: the cache key reads only its path, size and mtime."""
    gguf = tmp_path / "smollm2.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    monkeypatch.setenv("DRAFTSMITH_DEFAULT_GGUF", str(gguf))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return gguf


# the converter suffixes draftsmith keyed its conversions by, oldest first
CONVERTERS = ("", ":2", ":3", ":4", ":5", ":6")


def _old_cache_folder(gguf: Path, converter: str = ":5") -> Path:
    """Where draftsmith converted `gguf` (its cache key as every version computed it)."""
    st = gguf.stat()
    key = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}{converter}"
    return cache_dir() / "targets" / hashlib.sha256(key.encode()).hexdigest()[:16]


def test_the_converters_are_all_known():
    assert (*targets.EARLIER_CONVERTERS, targets.CONVERTER) == CONVERTERS


@pytest.mark.parametrize("converter", CONVERTERS)
def test_the_defaults_cache_folder_is_named_default(default_gguf, converter):
    """Its cache folder (of this or an earlier converter) was kept as the target's name."""
    folder = _old_cache_folder(default_gguf, converter)
    assert targets.portable(str(folder)) == "default"
    elsewhere = Path("/another/cache/targets") / folder.name  # another DRAFTSMITH_CACHE's
    assert targets.portable(str(elsewhere)) == "default"


def test_another_ggufs_cache_folder_and_plain_paths_stay_paths(default_gguf, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    folder = str(_old_cache_folder(other))
    assert targets.portable(folder) == folder
    assert targets.portable("") == "" and targets.portable("org/model") == "org/model"
    assert targets.portable(DEFAULT_NAME) == "default"


def test_no_default_installed_reads_no_folder_as_default(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_DEFAULT_GGUF", str(tmp_path / "absent.gguf"))
    folder = str(tmp_path / "targets" / "0123456789abcdef")
    assert targets.portable(folder) == folder


@pytest.fixture
def converted(default_gguf, monkeypatch, target) -> list[Path]:
    """The default's conversion is the tiny target's folder (the real one is 135M); the GGUFs
    asked for are listed."""
    asked = []

    def convert(path):
        asked.append(path)
        return targets._load_folder(target.folder, "gguf", str(path))

    monkeypatch.setattr(targets, "_load_gguf", convert)
    return asked


def test_loading_a_recorded_cache_folder_loads_the_default(default_gguf, converted):
    """The recorded folder (here cleared with the cache) was loaded as a plain HF folder, or
    refused as gone: now it is the default, converted again where its cache lost it."""
    t = load_target(str(_old_cache_folder(default_gguf, ":4")))
    assert (t.kind, t.source, converted) == ("default", DEFAULT_NAME, [default_gguf])
    assert portable_source(t) == "default"


def test_a_target_loaded_from_the_defaults_folder_is_recorded_as_default(default_gguf, target):
    folder = _old_cache_folder(default_gguf)
    t = targets.Target(str(folder), "hf", target.cfg, target.hf_config, target.tokenizer,
                       target.weights, folder, target.fingerprint)
    assert portable_source(t) == "default"


def test_an_old_default_drafter_reads_its_target_as_default(default_gguf, target, tmp_path):
    """Loaded (train --init-from, export) and read by the doctor, its target was the cache
    path: gone with the cache, the doctor said the target was moved or deleted."""
    from draftsmith.doctor.artifacts import read_drafter
    from draftsmith.doctor.run import drafter_target
    from draftsmith.models.eagle3 import load_drafter

    src = make(target, tmp_path / "d", target_source=str(_old_cache_folder(default_gguf, ":4")))
    assert load_drafter(src).cfg.target_source == "default"
    assert drafter_target(read_drafter(src)) == "default"
    kept = make(target, tmp_path / "k", target_source=str(target.folder))
    assert load_drafter(kept).cfg.target_source == str(target.folder)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_export_of_an_old_default_drafter_records_default(default_gguf, converted, target,
                                                          tmp_path, fmt):
    """An export without --target wrote the machine's cache path as draftsmith.target (and an
    old converter's folder as the verifier, a stale conversion where it was still there)."""
    old = _old_cache_folder(default_gguf, ":3")
    src = make(target, tmp_path / "d", target_source=str(old))
    out = export_drafter(src, fmt, tmp_path / fmt)
    c = json.loads((out / "config.json").read_text())
    assert c["draftsmith"]["target"] == "default"
    if fmt == "speculators":  # vLLM loads the verifier: the default's folder now
        assert c["speculators_config"]["verifier"]["name_or_path"] == str(target.folder)


def test_one_local_path_rule(tmp_path, monkeypatch):
    """One local-path rule (export resolves through it too): a path here absolute,
    anything else as it is."""
    (tmp_path / "t").mkdir()
    monkeypatch.chdir(tmp_path)
    assert targets.local_path("t") == str(tmp_path / "t")
    assert targets.local_path("gone") == "gone"
    assert os.path.isabs(targets.portable("t"))
