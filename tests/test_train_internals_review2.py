"""`draftsmith train` holds --out through `checkpoint.lock_out`: where the file system has no
flock (NFS refuses one on a folder), the loop went on unguarded and two runs wrote into one
--out; now a lock file names the run that holds it."""

from __future__ import annotations

import errno
import json

import pytest
from test_train_review6 import config, quiet_train, stopped

from draftsmith.errors import DraftsmithError
from draftsmith.train import checkpoint as ckpt


def test_train_without_flock_is_refused_an_out_another_host_holds(train_root, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.EBADF, "Bad file descriptor")  # as NFS answers for a folder

    monkeypatch.setattr(ckpt.fcntl, "flock", no_flock)
    stopped(train_root, "nfs")
    lock = train_root / "nfs" / ckpt.LOCK_FILE
    assert not lock.exists()  # the stopped run let it go
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 7, "started": 1,
                                "since": "2026-12-06 08:00:00"}))
    log = (train_root / "nfs" / "train_log.jsonl").read_text()
    with pytest.raises(DraftsmithError, match="host elsewhere, pid 7"):
        quiet_train(config(train_root, "nfs", resume=True))
    assert (train_root / "nfs" / "train_log.jsonl").read_text() == log
    lock.unlink()  # that run is gone: the user deletes its file, as the error says
    quiet_train(config(train_root, "nfs", resume=True))
    assert (train_root / "nfs" / "model.safetensors").is_file() and not lock.exists()
