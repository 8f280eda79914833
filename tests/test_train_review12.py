"""Training review 12: a drafter names its target portably (the default as "default", a GGUF by
its file, a folder absolute), export reads "default" back; a train log row without a step;
non-numeric drafter sizes and rope_theta named by the doctor instead of a traceback."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_doctor import errors, make_drafter

from draftsmith.errors import DraftsmithError
from draftsmith.layers import default_aux_layers
from draftsmith.targets import DEFAULT_NAME, load_target, portable_source
from draftsmith.train import report
from draftsmith.train.loop import TrainConfig, train


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def _train(root: Path, out: str, **over) -> Path:
    base = dict(out=str(root / out), data=str(root / "data"), target=str(root / "target"),
                max_steps=2, batch_size=2, max_len=48, ttt_steps=2, lr=3e-3, log_every=2,
                save_every=100, draft_vocab_size=64, progress=False, loader_workers=0,
                device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(TrainConfig(**(base | over)))


def _recorded(folder: Path) -> str:
    return json.loads((folder / "draftsmith.json").read_text())["config"]["target_source"]


def test_the_default_target_is_recorded_as_default_not_its_cache(tmp_path):
    """It recorded the GGUF conversion's cache folder: gone with the cache (or another
    DRAFTSMITH_CACHE, or machine), the doctor and export said the target was gone."""
    cache = tmp_path / "cache" / "targets" / "abc"
    cache.mkdir(parents=True)
    t = SimpleNamespace(kind="default", folder=cache, source=DEFAULT_NAME)
    assert portable_source(t) == "default"


def test_a_gguf_target_is_recorded_by_its_file_absolute(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"")
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.chdir(tmp_path)
    t = SimpleNamespace(kind="gguf", folder=cache, source="m.gguf")
    assert portable_source(t) == str(tmp_path / "m.gguf")


@pytest.fixture(scope="module")
def relative(root, tmp_path_factory) -> Path:
    """A run given `--target target` from the folder holding it."""
    here = Path.cwd()
    import os

    os.chdir(root)
    try:
        return _train(root, "rel12", target="target")
    finally:
        os.chdir(here)


def test_a_relative_target_folder_is_recorded_absolute(root, relative):
    """`--target target` was recorded as "target": read from any other working folder it
    named nothing (or another folder)."""
    assert _recorded(relative) == str((root / "target").resolve())


def test_an_init_from_run_records_this_runs_target(root, relative, tmp_path):
    """An --init-from run kept the earlier drafter's name for the target: an old drafter's
    cache path, gone with the cache."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(relative, old, ignore=shutil.ignore_patterns("checkpoints"))
    meta = json.loads((old / "draftsmith.json").read_text())
    meta["config"]["target_source"] = str(root / "gone-cache")
    (old / "draftsmith.json").write_text(json.dumps(meta))
    new = _train(root, "init12", init_from=str(old), max_steps=1, log_every=1)
    assert _recorded(new) == str((root / "target").resolve())


def _default_is(monkeypatch, folder: Path) -> None:
    """`load_target("default")` loads `folder` (the embedded GGUF is 135M parameters)."""
    import draftsmith.targets as targets
    import draftsmith.train.sources as sources

    def load(src=None):
        return load_target(folder if src in (None, "", "default") else src)

    monkeypatch.setattr(targets, "load_target", load)
    monkeypatch.setattr(sources, "load_target", load)


def test_export_of_a_default_drafter_names_the_default_targets_folder(target, tmp_path,
                                                                      monkeypatch):
    """"default" was written as the verifier as typed (or, with a folder named `default` in the
    working folder, as that folder), and its dtype read from ./default/config.json."""
    from draftsmith.export import export_drafter

    ids = default_aux_layers(target.cfg.num_layers)
    folder = make_drafter(tmp_path / "d", target, ids, target_source="default")
    _default_is(monkeypatch, target.folder)
    decoy = tmp_path / "default"
    decoy.mkdir()
    (decoy / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    monkeypatch.chdir(tmp_path)
    out = export_drafter(folder, "speculators", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target.folder.resolve())
    assert cfg["dtype"] != "float16"


def test_the_doctor_finds_a_target_recorded_as_default(target, tmp_path, monkeypatch):
    from test_doctor import doctor

    ids = default_aux_layers(target.cfg.num_layers)
    folder = make_drafter(tmp_path / "d", target, ids, target_source="default")
    _default_is(monkeypatch, target.folder)
    rep = doctor(drafter=folder)
    assert rep.context["target"]["from"] == "the drafter config"
    assert not errors(rep, "target")


def test_truncate_log_drops_a_row_without_a_step(tmp_path):
    """A hand-edited row without "step" (or not an object) raised KeyError on --resume."""
    rows = [{"step": 2, "loss": 1.0}, {"loss": 0.5}, [1, 2], {"step": 4, "loss": 0.4},
            {"step": "x"}, {"step": 6, "loss": 0.3}]
    (tmp_path / report.LOG).write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="dropped 3 row"):
        report.truncate_log(tmp_path, 4)
    assert report.read_log(tmp_path) == [{"step": 2, "loss": 1.0}, {"step": 4, "loss": 0.4}]


def test_the_plot_reads_a_log_with_an_edited_row(tmp_path):
    """A row without "loss" (or with no step) raised KeyError at every checkpoint, ending the
    run."""
    rows = [{"step": 2, "loss": 1.0, "acc": [0.5]}, {"note": "x"}, {"step": 4, "acc": [0.6]}]
    (tmp_path / report.LOG).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.plot(tmp_path) is not None


def _edited(folder: Path, **config) -> Path:
    meta = json.loads((folder / "draftsmith.json").read_text())
    meta["config"].update(config)
    (folder / "draftsmith.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("key,value", [("hidden_size", "big"), ("vocab_size", [1]),
                                       ("max_position_embeddings", "4k"),
                                       ("target_hidden_size", 64.5)])
def test_a_non_numeric_size_is_one_error(target, tmp_path, key, value):
    from draftsmith.doctor.artifacts import read_drafter

    ids = default_aux_layers(target.cfg.num_layers)
    folder = _edited(make_drafter(tmp_path / "d", target, ids), **{key: value})
    with pytest.raises(DraftsmithError, match=f"{key} is .*not a positive whole number"):
        read_drafter(folder)


def test_a_non_numeric_rope_theta_and_layer_count_are_findings(target, tmp_path):
    from draftsmith.doctor import checks
    from draftsmith.doctor.artifacts import read_drafter

    ids = default_aux_layers(target.cfg.num_layers)
    folder = _edited(make_drafter(tmp_path / "d", target, ids), rope_theta="ten thousand",
                     target_num_layers="six")
    info = read_drafter(folder)
    found = checks.positions(target, info)
    assert [f.severity for f in found] == ["error"] and "rope_theta" in found[0].what
    sizes = checks.sizes(target, None, None, info, None)
    assert any("target_num_layers 'six'" in f.what for f in sizes)


def test_a_recorded_gguf_is_named_by_the_folder_it_loads_from(target, tmp_path, monkeypatch):
    """As for --target x.gguf, an export names the HF folder a GGUF loads from, which an
    engine can load; an old drafter recording that folder is named by it as before."""
    import draftsmith.targets as targets
    from draftsmith.export.layout import TargetInfo
    from draftsmith.models.eagle3 import Eagle3Config

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    monkeypatch.setattr(targets, "load_target",
                        lambda src=None: target if src == str(gguf) else load_target(src))
    ids = default_aux_layers(target.cfg.num_layers)
    for source in (str(gguf), str(target.folder)):
        cfg = Eagle3Config.for_target(target.cfg, 64, ids, target_source=source)
        assert TargetInfo.of_drafter(cfg).name_or_path == str(target.folder.resolve())
