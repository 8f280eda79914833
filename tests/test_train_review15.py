"""Review 15 of train/*: the plot over edited log rows, tmp folders of cut-short checkpoints."""

from __future__ import annotations

import json

import pytest

from draftsmith.train import report
from draftsmith.train.checkpoint import CHECKPOINTS, checkpoint_dir, list_checkpoints


@pytest.mark.parametrize("edited", [{"acc": 0.6}, {"accept_length": "x"},
                                    {"acc": ["x", None], "coverage": "x"}])
def test_the_plot_reads_a_row_edited_to_other_types(tmp_path, edited):
    """A row whose "acc" is no list or whose accept length is no number raised TypeError at
    every checkpoint (the plot is drawn there), ending the run; such figures are gaps."""
    rows = [{"step": 2, "loss": 1.0, "acc": [0.5, 0.2], "accept_length": 1.6, "coverage": 0.9},
            {"step": 4, "loss": 0.9, **edited}]
    (tmp_path / report.LOG).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.plot(tmp_path) == tmp_path / report.PLOT


def test_the_tmp_folder_of_a_checkpoint_write_cut_short_goes_at_the_next_rotation(tmp_path):
    """A kill while a checkpoint was written left `.step-N.tmp` (a whole drafter's weights) that
    nothing removed unless a later run wrote step N again."""
    from test_train_internals_review3 import _tiny_drafter

    from draftsmith.train.checkpoint import save_checkpoint

    drafter = _tiny_drafter()
    save_checkpoint(tmp_path, 1, drafter, {"step": 1}, {}, keep_last=2)
    cut = checkpoint_dir(tmp_path, 5).with_name(".step-00000005.tmp")
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"x" * 64)
    mine = tmp_path / CHECKPOINTS / ".step-notes.tmp"  # not our name: left alone
    mine.mkdir()
    save_checkpoint(tmp_path, 2, drafter, {"step": 2}, {}, keep_last=2)
    assert list_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, 1), checkpoint_dir(tmp_path, 2)]
    assert not cut.exists() and mine.is_dir()


def test_a_checkpoint_written_again_loses_its_trainer_state_before_its_weights(tmp_path,
                                                                             monkeypatch):
    """Writing step N again removed the old step-N folder in no set order: a kill partway could
    leave its trainer state beside half its weights, a checkpoint --resume would take."""
    import shutil

    from test_train_internals_review3 import _tiny_drafter

    from draftsmith.train import checkpoint

    drafter = _tiny_drafter()
    checkpoint.save_checkpoint(tmp_path, 3, drafter, {"step": 3}, {}, keep_last=2)
    old = checkpoint_dir(tmp_path, 3)
    seen = []
    real = shutil.rmtree

    def rmtree(path, *a, **kw):
        if path == old:
            seen.append(sorted(p.name for p in old.iterdir()))
        return real(path, *a, **kw)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    checkpoint.save_checkpoint(tmp_path, 3, drafter, {"step": 3}, {}, keep_last=2)
    assert seen and checkpoint.STATE not in seen[0], seen


def test_a_nan_temperature_is_refused_by_the_answers_config():
    """`RegenConfig` let NaN through (`nan < 0` is false): answers decoded at no temperature."""
    from draftsmith.data.regenerate import RegenConfig
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match=r"--temperature \(nan\) must be a finite number"):
        RegenConfig(temperature=float("nan"))


def test_the_shard_hash_reads_without_preadv(tmp_path, monkeypatch):
    """`sha256_fd` read through os.preadv, which macOS's Python lacks: every offline training
    start there was an AttributeError."""
    import hashlib
    import os

    from draftsmith.train.reader import sha256_fd

    path = tmp_path / "shard.safetensors"
    path.write_bytes(data := os.urandom(5 << 20))
    monkeypatch.delattr(os, "preadv", raising=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert sha256_fd(fd, path) == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)
