"""Training review 24: a second `train` into an --out another run is writing is refused first,
before it loads the target or reads the checkpoint (it was told to pass --resume, or said
"resumed from" a checkpoint, then refused once the target had loaded)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_train_review6 import config, quiet_train, stopped

from draftsmith.errors import DraftsmithError
from draftsmith.train import loop
from draftsmith.train.checkpoint import FLOCKS


@pytest.fixture(scope="module")
def root(train_root):
    return train_root


@contextmanager
def held(out: Path) -> Iterator[None]:
    """--out locked as a running `draftsmith train` holds it."""
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


@pytest.fixture
def no_target(monkeypatch) -> list[str]:
    """The targets the run resolved (none, where it is refused first)."""
    loaded: list[str] = []
    real = loop.resolve_target

    def resolve(target, data, manifest=None):
        loaded.append(str(target))
        return real(target, data, manifest)

    monkeypatch.setattr(loop, "resolve_target", resolve)
    return loaded


@pytest.mark.parametrize("resume", [False, True])
def test_a_train_into_an_out_another_is_writing_is_refused_before_anything(root, capfd,
                                                                           no_target, resume):
    """Without --resume it said "already holds a training run; pass --resume", which was
    refused in turn; with it, it said "resumed from step-N" first. Both loaded the target."""
    out = f"busy-{resume}"
    stopped(root, out)
    no_target.clear()
    capfd.readouterr()
    with held(root / out), pytest.raises(DraftsmithError) as e:
        quiet_train(config(root, out, resume=resume))
    assert "another `draftsmith train` is writing into it" in str(e.value), str(e.value)
    assert no_target == [] and "resumed from" not in capfd.readouterr().err
    assert FLOCKS == []
    quiet_train(config(root, out, resume=True))  # the probe let it go: the run goes on
    assert (root / out / "model.safetensors").is_file()
