"""Training checkpoints: `OUT/checkpoints/step-NNNNNNNN/`, written whole or not at all.

Each holds the drafter in the draftsmith layout (fp32 master weights), `trainer_state.pt`
(optimizer, scheduler, step, metric accumulators) and one `rng-R.pt` per rank. A checkpoint is
built in a dot-named tmp folder and renamed into place; older ones beyond `keep_last` go after.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import Eagle3Drafter, save_drafter
from draftsmith.train.dist import shared_failure

CHECKPOINTS = "checkpoints"
STATE = "trainer_state.pt"


def checkpoint_dir(out: Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:08d}"


def list_checkpoints(out: Path) -> list[Path]:
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith("step-") and (p / STATE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def save_checkpoint(
    out: Path,
    step: int,
    drafter: Eagle3Drafter,
    trainer: dict[str, Any],
    summary: dict[str, Any],
    keep_last: int,
    rank: int = 0,
    world: int = 1,
) -> Path:
    """Every rank calls this (collective); rank 0 writes the model and trainer state. A write
    that fails on any rank stops every rank with its error."""
    final = checkpoint_dir(out, step)
    tmp = final.with_name(f".{final.name}.tmp")
    with shared_failure(world):
        if rank == 0:
            with writing(final, tmp):
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
                save_drafter(drafter, tmp, **summary)
                torch.save(trainer, tmp / STATE)
                _synced(*(p for p in tmp.iterdir() if p.is_file()))
    with shared_failure(world), writing(final, tmp):
        torch.save(rng_state(), tmp / f"rng-{rank}.pt")
        _synced(tmp / f"rng-{rank}.pt")
    with shared_failure(world):
        if rank == 0:
            _put_in_place(final, tmp, out, keep_last)
    return final


def _put_in_place(final: Path, tmp: Path, out: Path, keep_last: int) -> None:
    with writing(final, tmp):
        _synced(tmp, folder=True)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _synced(final.parent, folder=True)  # the rename on disk before older ones go
    for old in list_checkpoints(out)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)


def _synced(*paths: Path, folder: bool = False) -> None:
    """The files (or a folder's entries) on disk: a checkpoint renamed into place must be whole
    after a host crash (a lent machine taken back) too, not only after a killed process. A
    folder's fsync that the file system refuses is skipped; a file's is a failed write."""
    from draftsmith.data.atomic import fsync_dir, fsync_file

    for path in paths:
        (fsync_dir if folder else fsync_file)(path)


@contextmanager
def writing(what: Path, *tmps: Path) -> Iterator[None]:
    """`what` not written (a full disk, a read-only folder) as one error; its tmp files or
    folders go, the checkpoints written before stay."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as e:  # torch.save: RuntimeError
        for tmp in tmps:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        raise DraftsmithError(f"{what}: cannot write it ({e}); the checkpoints written before "
                              "are kept: make room and rerun the same command with --resume"
                              ) from None


def load_trainer_state(folder: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(trainer state, this rank's RNG state or None when the run had fewer ranks)."""
    with unreadable(folder):
        trainer = _load(folder / STATE)
        rng_path = folder / f"rng-{rank}.pt"
        return trainer, _load(rng_path) if rng_path.is_file() else None


@contextmanager
def unreadable(folder: Path) -> Iterator[None]:
    """A file of checkpoint `folder` that cannot be read (torn by a crash, a bad copy) as one
    error saying which folder to delete and where --resume then starts."""
    try:
        yield
    except DraftsmithError as e:
        before = [p for p in list_checkpoints(folder.parent.parent)
                  if int(p.name.split("-")[1]) < int(folder.name.split("-")[1])]
        then = f"resumes from {before[-1].name}" if before else "starts over"
        raise DraftsmithError(f"{e}; that checkpoint is unreadable: delete {folder} and "
                              f"--resume {then}") from None


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise DraftsmithError(f"{path}: unreadable checkpoint ({e})") from None
