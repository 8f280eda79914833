"""Training review 9: ctrl-C stops at a checkpoint that --resume finishes exactly; loader
workers outlive a terminal's ctrl-C; the dataset's own vocab (`data make`) named."""

from __future__ import annotations

import os
import shutil
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_train_loop import log_rows
from test_train_review5 import config
from test_train_review6 import quiet_train

from draftsmith.data.vocab import build_vocab, save_vocab
from draftsmith.models.eagle3 import load_drafter
from draftsmith.train import train
from draftsmith.train.checkpoint import list_checkpoints
from draftsmith.train.loop import Trainer
from draftsmith.train.sources import open_offline, resolve_target


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


@pytest.fixture(scope="module")
def straight(root) -> Path:
    """Six steps, logged every other one, no checkpoint before the end."""
    quiet_train(config(root, "straight"))
    return root / "straight"


def ctrl_c_after(monkeypatch, step: int, times: int = 1) -> list[int]:
    """Trainer.train_step spied on: after step `step` completes, SIGINT is raised `times`."""
    calls, real = [], Trainer.train_step

    def spy(self):
        real(self)
        calls.append(1)
        if len(calls) == step:
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(Trainer, "train_step", spy)
    return calls


def same_weights(a: Path, b: Path) -> bool:
    da, db = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    return all(torch.equal(da[k], db[k]) for k in da)


def test_ctrl_c_stops_after_the_step_at_a_checkpoint_that_resume_finishes(root, straight,
                                                                           monkeypatch, capfd):
    """Step 3 is neither a log nor a save step: the run used to die with code 130 and no
    checkpoint; now it finishes the step, writes one at step 3 (its statistics flushed into the
    saved window) and says so, and --resume ends with the straight run's weights and log."""
    before = signal.getsignal(signal.SIGINT)
    ctrl_c_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        quiet_train(config(root, "cut"))
    assert signal.getsignal(signal.SIGINT) is before  # the loop's handler is gone
    cut = root / "cut"
    assert [p.name for p in list_checkpoints(cut)] == ["step-00000003"]
    err = capfd.readouterr().err
    assert "ctrl-C: stopping after this step with a checkpoint" in err
    assert (f"draftsmith train: interrupted at step 3 of 6: checkpoint written to "
            f"{cut / 'checkpoints' / 'step-00000003'}; the same command with --resume "
            "continues") in err
    resumed = ctrl_c_after(monkeypatch, 99)
    quiet_train(config(root, "cut", resume=True))
    assert len(resumed) == 3
    assert same_weights(straight, cut)
    assert log_rows(straight) == log_rows(cut)


def test_a_second_ctrl_c_aborts_at_once_naming_where_resume_starts(root, monkeypatch, capfd):
    """Two ctrl-Cs in step 2: no checkpoint is written (none yet), and the line says so."""
    ctrl_c_after(monkeypatch, 2, times=2)
    with pytest.raises(KeyboardInterrupt):
        quiet_train(config(root, "twice"))
    assert list_checkpoints(root / "twice") == []
    assert ("draftsmith train: aborted after 1 of 6 steps: no checkpoint written yet; the same "
            "command starts over") in capfd.readouterr().err


def _children() -> list[int]:
    me, kids = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            kids.append(int(stat.parent.name))
    return kids


def test_loader_workers_survive_a_terminals_ctrl_c(root, straight, monkeypatch):
    """A terminal sends SIGINT to the whole process group: a loader worker that died of it
    failed the run's next batch ("DataLoader worker exited unexpectedly")."""
    real = Trainer.train_step
    hit = []

    def spy(self):
        real(self)
        if not hit:
            hit.extend(_children())
            for pid in hit:
                os.kill(pid, signal.SIGINT)
            time.sleep(0.3)

    monkeypatch.setattr(Trainer, "train_step", spy)
    quiet_train(config(root, "workers", loader_workers=1, max_steps=12))
    assert hit  # a worker was there to signal
    assert (root / "workers" / "draftsmith.json").is_file()


def test_the_datasets_own_vocab_is_named_where_a_vocab_is_counted(root, tmp_path):
    """`data make` writes DIR/vocab.safetensors; `train --data DIR` without --vocab counts its
    own (as it did: runs resume on it) but now says the dataset's vocab is there, unused."""
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    target = resolve_target(str(root / "target"), str(data))
    counts = open_offline(str(data), target, None).token_counts(target.cfg.vocab_size)
    save_vocab(build_vocab(counts, 16, target.cfg.vocab_size), data)
    vocab = data / "vocab.safetensors"
    with pytest.warns(UserWarning, match=rf"distinct assistant tokens for a draft vocab of "
                      rf"\d+: using \d+; the dataset holds a vocab made by `data make` "
                      rf"\({vocab}, 16 draft tokens\), not used: .* pass --vocab {vocab}"):
        train(config(root, "hint", data=str(data), max_steps=1, draft_vocab_size=None))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train(config(root, "sized", data=str(data), max_steps=1))  # --draft-vocab-size 64
    assert not [w for w in said if "the dataset holds a vocab" in str(w.message)]
