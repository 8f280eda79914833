"""Training review 20: a resume mid-epoch of a later epoch equals the straight run; bad inputs
(a dataset of another target, a --batch-size the data cannot fill, a --vocab of another
target) name what to do in one line; the --out lock and the conversion cache tell a live
process one way."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import write_tiny_folder
from test_train_review3 import config

from draftsmith.data.vocab import build_vocab, save_vocab
from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import load_drafter
from draftsmith.train import train
from draftsmith.train.batches import Plan
from draftsmith.train.loop import Trainer
from draftsmith.train.sources import read_vocab


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def quiet(cfg) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg)


def rows(folder) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"}
            for x in (folder / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stop,workers", [(7, 2), (9, 0)])
def test_a_resume_mid_epoch_of_a_later_epoch_equals_the_straight_run(root, monkeypatch, stop,
                                                                     workers):
    """Three epochs of 3-row steps, warm-up, cosine to a floor and weight decay, stopped inside
    the second epoch between checkpoints (every 3 steps) and log windows (every 2), resumed
    with other loader workers: the same log rows, epochs and lr included, and the same weights."""
    over = dict(max_steps=None, epochs=3, batch_size=3, log_every=2, save_every=3,
                warmup_ratio=0.3, min_lr=1e-4, weight_decay=0.01, keep_last=10)
    quiet(config(root, f"whole{stop}", **over))
    real, n = Trainer.train_step, {"n": 0}

    def dies(self) -> None:
        n["n"] += 1
        if n["n"] == stop:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(Trainer, "train_step", dies)
    with pytest.raises(KeyboardInterrupt):
        quiet(config(root, f"cut{stop}", loader_workers=workers, **over))
    monkeypatch.setattr(Trainer, "train_step", real)
    quiet(config(root, f"cut{stop}", resume=True, loader_workers=2 - workers, **over))
    a, b = root / f"whole{stop}", root / f"cut{stop}"
    assert rows(a) == rows(b) and {r["epoch"] for r in rows(a)} == {0, 1, 2}
    da, db = load_drafter(a).state_dict(), load_drafter(b).state_dict()
    assert all(torch.equal(da[k], db[k]) for k in da)


def test_a_dataset_of_another_target_names_the_fix_and_makes_no_out(root, tmp_path):
    other = write_tiny_folder(tmp_path / "other", "llama", seed=1)
    with pytest.raises(DraftsmithError, match=r"^\S+data: captured from target .* has "
                       r"fingerprint \w+; pass --target with the model the data was captured "
                       r"from, or capture the data again with this target$"):
        quiet(config(root, "other_target", target=str(other)))
    assert not (root / "other_target").exists()


def test_a_batch_size_the_data_cannot_fill_names_the_fix():
    with pytest.raises(DraftsmithError, match=r"^3 samples cannot fill one batch of 4 rows on "
                       r"each of 1 rank\(s\); lower --batch-size to 3 or fewer$"):
        Plan([10, 10, 10], 4, 48, 1, 0, 0)
    with pytest.raises(DraftsmithError, match=r"^3 samples cannot fill one batch of 1 rows on "
                       r"each of 4 rank\(s\); train on 3 rank\(s\) or fewer$"):
        Plan([10, 10, 10], 1, 48, 4, 0, 0)


def test_a_vocab_file_of_another_target_names_the_fix(tmp_path):
    save_vocab(build_vocab(torch.arange(64) + 1, 16, 64), tmp_path / "v")
    with pytest.raises(DraftsmithError, match=r"^\S+vocab.safetensors: t2d covers 64 tokens, "
                       r"the target has 128: made for another target; rebuild it for this "
                       r"target with `draftsmith data vocab`$"):
        read_vocab(tmp_path / "v" / "vocab.safetensors", 128)


def test_the_out_lock_and_the_conversion_cache_share_one_liveness_check():
    from draftsmith import targets
    from draftsmith.train import checkpoint

    assert checkpoint.pid_alive is targets.pid_alive
    assert not hasattr(targets, "_alive")
    gone = {"host": checkpoint.socket.gethostname(), "pid": 2**22 + 12345, "started": 1}
    assert checkpoint._stale(gone)
    me = checkpoint._me()
    assert not checkpoint._stale(me) and not checkpoint._stale({**me, "host": "elsewhere"})
    assert checkpoint._stale({**me, "started": me["started"] + 1})  # the pid used again


def test_a_dataset_of_another_hidden_size_names_the_fix(root, tmp_path):
    """A manifest without a fingerprint (an external capture) whose hidden size is not the
    target's: refused naming both sizes and what to do, no --out made."""
    import shutil

    data = shutil.copytree(root / "data", tmp_path / "data")
    m = json.loads((data / "manifest.json").read_text())
    m["target"]["fingerprint"], m["hidden_size"] = None, 96
    (data / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DraftsmithError, match=r"^\S+data: hidden size 96 != the target's 64; "
                       r"pass --target with the model the data was captured from, or capture "
                       r"the data again with this target$"):
        quiet(config(root, "other_hidden", data=str(data)))
    assert not (root / "other_hidden").exists()
