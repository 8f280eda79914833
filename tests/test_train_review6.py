"""Training review 6: --resume with other run-shaping options, a shard rewritten in place."""

from __future__ import annotations

import warnings

import pytest
from test_train_review5 import config

from draftsmith.errors import DraftsmithError
from draftsmith.train import TrainConfig, train


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


def quiet_train(cfg: TrainConfig) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg)


def stopped(root, out: str, **over) -> None:
    """A run stopped at its first logged step with a checkpoint (--time-limit 0)."""
    quiet_train(config(root, out, time_limit=0.0, **over))


def test_resume_with_other_bf16_is_refused_naming_both_values(root):
    stopped(root, "bf16", bf16=False)
    with pytest.raises(DraftsmithError) as e:
        quiet_train(config(root, "bf16", resume=True, bf16=True))
    said = str(e.value)
    assert "\n" not in said and "bf16 was False in that run, now True" in said, said


@pytest.mark.parametrize(("option", "value"), [("lr", 1e-3), ("seed", 1), ("ttt_steps", 3),
                                               ("batch_size", 1), ("draft_vocab_size", 32)])
def test_resume_with_another_run_shaping_option_is_refused(root, option, value):
    out = f"shaped-{option}"
    stopped(root, out)
    with pytest.raises(DraftsmithError) as e:
        quiet_train(config(root, out, resume=True, **{option: value}))
    assert f"{option} was " in str(e.value) and f"now {value!r}" in str(e.value), str(e.value)


def test_resume_with_another_pad_multiple_is_noted_once_and_goes_on(root, capfd):
    """A speed-only option changed: the run resumes and says so in one line."""
    stopped(root, "padded")
    capfd.readouterr()
    quiet_train(config(root, "padded", resume=True, pad_multiple=8))
    err = capfd.readouterr().err
    noted = [x for x in err.splitlines() if "pad_multiple 1 -> 8" in x]
    assert len(noted) == 1 and "speed only" in noted[0], err


def test_a_checkpoint_that_did_not_record_bf16_resumes_and_says_so(root, capfd):
    """Checkpoints written before bf16 was resolved hold None: accepted, and said."""
    import torch

    from draftsmith.train.checkpoint import STATE, latest_checkpoint

    stopped(root, "older")
    path = latest_checkpoint(root / "older") / STATE
    state = torch.load(path, weights_only=False)
    state["config"]["bf16"] = None
    del state["config"]["compile_loss"]
    torch.save(state, path)
    capfd.readouterr()
    quiet_train(config(root, "older", resume=True, bf16=False))
    err = capfd.readouterr().err
    assert "does not record bf16, compile_loss (an older run)" in err, err
    assert (root / "older" / "model.safetensors").is_file()


def rewrite_in_place(path, keep_mtime: bool) -> None:
    """`cp other path` (or `cp -p`): the same inode, its bytes rewritten, size unchanged."""
    import os

    st = os.stat(path)
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        f.seek(size - 64)
        f.write(bytes(64))  # the last rows of `hidden` zeroed
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_ino == st.st_ino and os.stat(path).st_size == st.st_size


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_shard_rewritten_in_place_under_an_open_reader_is_refused(root, tmp_path, keep_mtime):
    """The reader held the shard open and read the new bytes without a word: only a file
    opened again was compared. Each read now compares the open file with the one planned on."""
    import shutil

    from draftsmith.data.shards import Dataset
    from draftsmith.train.reader import ShardReader

    shutil.copytree(root / "data", tmp_path / "data")
    reader = ShardReader(Dataset(tmp_path / "data"))
    reader.check_shapes(3, Dataset(tmp_path / "data").manifest["hidden_size"])
    reader[0]  # shard 0 now held open
    shard = tmp_path / "data" / reader.shards[0]["file"]
    rewrite_in_place(shard, keep_mtime)
    with pytest.raises(DraftsmithError) as e:
        reader[1]
    assert str(e.value).startswith(f"{shard}: the shard changed on disk"), str(e.value)


@pytest.mark.parametrize("torn", ["model.safetensors", "draftsmith.json", "trainer_state.pt"])
def test_a_torn_latest_checkpoint_names_the_folder_to_delete_and_the_one_before(root, torn):
    """A host crash after the rename leaves a checkpoint of cut-short files: its weights or
    config failed with a reader's error that said nothing of the checkpoints before."""
    from draftsmith.train.checkpoint import list_checkpoints

    out = f"torn-{torn.split('.')[0]}"
    quiet_train(config(root, out, save_every=2, max_steps=4))
    first, last = list_checkpoints(root / out)
    (last / torn).write_bytes((last / torn).read_bytes()[:40])
    with pytest.raises(DraftsmithError) as e:
        quiet_train(config(root, out, save_every=2, max_steps=4, resume=True))
    said = str(e.value)
    assert "\n" not in said and said.startswith(str(last / torn)), said
    assert said.endswith(f"delete {last} and --resume resumes from {first.name}"), said


def test_a_checkpoint_is_on_disk_before_it_is_renamed_into_place(root, monkeypatch):
    """No fsync: after a host crash the renamed folder could hold empty files while the
    older checkpoints were already deleted. Each file and both folders are synced now."""
    import os

    real, synced = os.fsync, []

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    quiet_train(config(root, "synced", max_steps=2))
    final = root / "synced" / "checkpoints" / "step-00000002"
    tmp = final.with_name(".step-00000002.tmp")
    assert {str(tmp / p.name) for p in final.iterdir()} <= set(synced), synced
    assert str(tmp) in synced and str(final.parent) in synced


def test_progress_lines_off_a_terminal_say_time_spent_and_left(root, capfd):
    """Off a terminal (`> train.log`) the lines had no time left, which the bar shows; a
    resumed run paces itself on its own steps, not on those of the run before."""
    stopped(root, "eta", progress=True)
    quiet_train(config(root, "eta", resume=True, progress=True))
    steps = [x for x in capfd.readouterr().err.splitlines()
             if x.startswith("draftsmith train: step ")]
    assert len(steps) == 3 and all(" spent, eta " in x for x in steps), steps
    assert steps[-1].endswith("eta 00:00"), steps


def test_a_second_train_into_an_out_another_is_writing_is_refused(root):
    """A rerun in another shell with --resume trained beside the first into one folder, each
    deleting the other's checkpoints (keep-last) and rewriting its log. The running one
    holds --out now; a killed one holds nothing, so --resume after it goes on."""
    import fcntl
    import os

    from draftsmith.train.checkpoint import list_checkpoints

    stopped(root, "held")
    log = (root / "held" / "train_log.jsonl").read_text()
    fd = os.open(root / "held", os.O_RDONLY)  # the lock as the running train holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DraftsmithError) as e:
            quiet_train(config(root, "held", resume=True))
    finally:
        os.close(fd)
    assert "another `draftsmith train` is writing into it" in str(e.value)
    # the refused run's closed descriptor is not left listed: a later fork closed whatever
    # reused its number (a DDP test's pipe, which hung)
    from draftsmith.train.checkpoint import FLOCKS
    assert FLOCKS == []
    assert [p.name for p in list_checkpoints(root / "held")] == ["step-00000002"]
    assert (root / "held" / "train_log.jsonl").read_text() == log
    quiet_train(config(root, "held", resume=True))
    assert (root / "held" / "model.safetensors").is_file()


def test_loader_workers_do_not_hold_the_out_lock(root, monkeypatch):
    """Forked workers inherited the locked folder's descriptor, so a killed run's orphans
    kept --out locked (a --resume refused) until they noticed their parent was gone."""
    import multiprocessing
    import os

    from draftsmith.train.loop import Trainer

    out, real, seen = root / "workers-lock", Trainer.train_step, []

    def look(self):
        real(self)
        for child in multiprocessing.active_children():
            fds = f"/proc/{child.pid}/fd"
            seen.append(sorted(os.readlink(f"{fds}/{n}") for n in os.listdir(fds)))

    monkeypatch.setattr(Trainer, "train_step", look)
    quiet_train(config(root, out.name, max_steps=2, loader_workers=1))
    assert seen and not any(str(out) in fds for fds in seen), seen
