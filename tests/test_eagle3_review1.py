"""The drafter's files (save_drafter staged whole, d2t's range checked at load) and the
speculative state's eos capacity."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_drafter import random_drafter, tiny_cfg
from test_speculative import make_drafter, tiny_target

from draftsmith.engine.generate import generate
from draftsmith.engine.runtime import Runtime
from draftsmith.engine.speculative import SpecDecoder
from draftsmith.errors import DraftsmithError
from draftsmith.models import eagle3
from draftsmith.models.eagle3 import CONFIG_FILE, WEIGHTS_FILE, load_drafter, save_drafter


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def run_folder(tmp_path):
    """A training run's folder: drafter A, its log and a checkpoint beside it."""
    folder = tmp_path / "run"
    old = random_drafter(tiny_cfg(), seed=1)
    save_drafter(old, folder, training={"steps": 1})
    (folder / "train_log.jsonl").write_text("{}\n")
    (folder / "checkpoints" / "step-1").mkdir(parents=True)
    return folder, old


def test_a_save_that_fails_after_the_weights_keeps_the_old_drafter(run_folder, monkeypatch):
    """The weights were renamed in before the config was written: a failure there (a full
    disk, ctrl-C) left drafter B's weights beside drafter A's config, loaded as a mix."""
    folder, old = run_folder

    class FullDisk:
        @staticmethod
        def dumps(*args, **kwargs):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(eagle3, "json", FullDisk)
    with pytest.raises(OSError, match="No space"):
        save_drafter(random_drafter(tiny_cfg(), seed=2), folder)
    monkeypatch.undo()
    assert _same(load_drafter(folder), old)
    assert json.loads((folder / CONFIG_FILE).read_text())["training"] == {"steps": 1}
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted([CONFIG_FILE, WEIGHTS_FILE, "train_log.jsonl", "checkpoints"])


def test_a_stop_between_the_renames_never_leaves_a_mixed_drafter(run_folder, monkeypatch):
    """A host crash between moving the weights and the config in: the folder is refused as no
    drafter, not loaded as B's weights under A's config."""
    folder, _ = run_folder
    real = os.replace

    def crash(a, b):
        if os.path.basename(b) == CONFIG_FILE:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_drafter(random_drafter(tiny_cfg(), seed=2), folder)
    monkeypatch.undo()
    with pytest.raises(DraftsmithError, match="not a draftsmith drafter folder"):
        load_drafter(folder)
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_a_save_over_a_run_folder_replaces_the_drafter_and_keeps_the_rest(run_folder):
    folder, _ = run_folder
    new = random_drafter(tiny_cfg(), seed=2)
    save_drafter(new, folder, training={"steps": 2})
    assert _same(load_drafter(folder), new)
    assert (folder / "train_log.jsonl").read_text() == "{}\n"
    assert (folder / "checkpoints" / "step-1").is_dir()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("offset", [1, -1])
def test_a_d2t_mapping_outside_the_target_vocab_is_refused_at_load(tmp_path, offset):
    """A draft id mapped past the config's target vocabulary (or below 0) loaded silently;
    the engine drafted an id the target cannot verify."""
    cfg = tiny_cfg()
    d = random_drafter(cfg)
    d2t = d.d2t.clone()
    edge = cfg.draft_vocab_size - 1 if offset > 0 else 0
    d2t[edge] = (cfg.vocab_size - edge) if offset > 0 else -1
    d.d2t.copy_(d2t)
    folder = save_drafter(d, tmp_path / "d")
    with pytest.raises(DraftsmithError, match=rf"{WEIGHTS_FILE}: d2t: 1 draft ids map outside "
                       rf"the target vocab \[0, {cfg.vocab_size}\), e.g. draft {edge} -> "):
        load_drafter(folder)


def test_a_target_of_more_than_16_eos_ids_decodes_speculatively():
    """More than 16 stop ids (llama.cpp's end-of-generation texts) refused speculative
    decoding outright, while plain decoding took any number."""
    target = tiny_target()
    rt = Runtime(target, 2, 96)
    prompts = [[1, 5, 9, 30, 44], [1, 60, 61]]
    ref = generate(rt, prompts, 24, eos_ids=[])
    stop = ref[0][10]
    eos = [stop, *range(100, 120)]  # 21 ids, the real one among them
    want = generate(rt, prompts, 24, eos_ids=eos)
    got = SpecDecoder(rt, make_drafter(target, 96), 3).generate(prompts, 24, eos_ids=eos)
    assert got.tokens == want and len(got.tokens[0]) <= 10
