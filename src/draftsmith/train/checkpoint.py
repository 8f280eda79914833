"""Training checkpoints: `OUT/checkpoints/step-NNNNNNNN/`, written whole or not at all.

Each holds the drafter in the draftsmith layout (fp32 master weights), `trainer_state.pt`
(optimizer, scheduler, step, metric accumulators) and one `rng-R.pt` per rank. A checkpoint is
built in a dot-named tmp folder and renamed into place; older ones beyond `keep_last` go after.
`lock_out` holds --out while a run writes into it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import socket
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle3 import CONFIG_FILE, Eagle3Drafter, save_drafter
from draftsmith.targets import pid_alive
from draftsmith.train.dist import shared_failure

CHECKPOINTS = "checkpoints"
STATE = "trainer_state.pt"


def checkpoint_dir(out: Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:08d}"


def _step_folders(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step-N` entry, by step; only our names: a copy beside them
    (step-00000100.bak) was a ValueError on --resume."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    steps = [(int(p.name.split("-")[1]), p) for p in root.iterdir()
             if re.fullmatch(r"step-\d+", p.name)]
    return sorted(steps, key=lambda sp: sp[0])


def list_checkpoints(out: Path) -> list[Path]:
    return [p for _, p in _step_folders(out) if (p / STATE).is_file()]


def _stateless(out: Path) -> tuple[int, list[tuple[int, Path]]]:
    """(the newest whole checkpoint's step, -1 for none; the `step-N` folders that hold no
    trainer state: a write or a removal cut short)."""
    steps = _step_folders(out)
    whole = [n for n, p in steps if (p / STATE).is_file()]
    return (whole[-1] if whole else -1,
            [(n, p) for n, p in steps if p.is_dir() and not (p / STATE).is_file()])


def torn_checkpoints(out: Path) -> list[Path]:
    """`step-N` folders past the newest whole checkpoint that hold no trainer state (a write or
    a removal cut short): --resume passes over them, and says so."""
    newest, stateless = _stateless(out)
    return [p for n, p in stateless if n > newest]


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def stopped_at(folder: Path) -> Path | None:
    """The latest checkpoint of a training run in `folder` that has written no final drafter
    (its draftsmith.json) yet: what to pass where a drafter is asked for; None otherwise."""
    return None if (folder / CONFIG_FILE).is_file() else latest_checkpoint(folder)


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
        # a host of more GPUs wrote states for devices this one lacks (an IndexError)
        for i, cuda in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda, i)
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
        if final.exists():  # its trainer state first: a removal cut short is no checkpoint
            (final / STATE).unlink(missing_ok=True)
            shutil.rmtree(final)
        tmp.rename(final)
        _synced(final.parent, folder=True)  # the rename on disk before older ones go
    _drop_old(out, keep_last)


def _drop_old(out: Path, keep_last: int) -> None:
    """Checkpoints past the `keep_last` newest removed, each its trainer state first (a folder
    cut short is then no checkpoint --resume takes). One that cannot go (a permission error)
    is a warning naming it: rank 0 alone raising left the other ranks waiting."""
    left: list[str] = []
    for old in list_checkpoints(out)[:-keep_last] if keep_last > 0 else []:
        try:
            (old / STATE).unlink(missing_ok=True)
            shutil.rmtree(old)
        except FileNotFoundError:
            continue
        except OSError as e:
            left.append(f"{old} ({e.strerror or e})")
    if left:
        warnings.warn(f"could not remove older checkpoint(s) {', '.join(left)}; training goes "
                      "on: remove them by hand", stacklevel=2)
    _drop_remains(out)


def _drop_remains(out: Path) -> None:
    """`step-N` folders older than the newest checkpoint that hold no trainer state (a removal
    cut short: a kill, a host crash) and `.step-N.tmp` folders (a write cut short): weights and
    all, which no --resume takes and no later rotation saw. Best effort: one that cannot go
    was warned about when it was dropped."""
    newest, stateless = _stateless(out)
    for n, old in stateless:
        if n < newest:
            with contextlib.suppress(OSError):
                shutil.rmtree(old)
    # a write cut short (a kill, a full disk on another rank) left its tmp folder, weights and
    # all; this step's was just renamed and no other is written now (every rank is past it)
    root = Path(out) / CHECKPOINTS
    for tmp in root.glob(".step-*.tmp") if root.is_dir() else []:
        if re.fullmatch(r"\.step-\d+\.tmp", tmp.name) and tmp.is_dir():
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)


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
    """(trainer state, this rank's RNG state or None when the run had fewer ranks). A rank of
    the run whose RNG file is gone (a damaged copy) is an unreadable checkpoint, not a resume
    that silently skips restoring its RNG."""
    with unreadable(folder):
        trainer = _load(folder / STATE)
        if not isinstance(trainer, dict) or "step" not in trainer:
            raise DraftsmithError(f"{folder / STATE}: holds no trainer state")
        # every rank's file looked for on every rank: all refuse alike, none waits for another
        gone = [f"rng-{r}.pt" for r in range(trainer.get("world", 1))
                if not (folder / f"rng-{r}.pt").is_file()]
        if gone:
            raise DraftsmithError(f"{folder}: no {', '.join(gone)} (a rank's RNG state)")
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


# --out held while a run writes into it (`lock_out`)
LOCK_FILE = ".draftsmith-train.lock"
# the flocks this process holds: a forked child (a loader worker) closes its copies, as a flock
# lives while any copy is open (a killed run's orphans would keep --out locked)
FLOCKS: list[int] = []


def _close_flocks() -> None:
    while FLOCKS:
        os.close(FLOCKS.pop())


os.register_at_fork(after_in_child=_close_flocks)


@dataclass
class OutLock:
    """A held --out: an flock on the folder (`fd`), or where the file system has none (NFS
    refuses one on a folder) a lock file made whole by a hard link, naming its holder."""

    fd: int | None = None
    file: Path | None = None
    holder: dict[str, Any] | None = None

    def release(self) -> None:
        if self.fd is not None:
            if self.fd in FLOCKS:
                FLOCKS.remove(self.fd)
                os.close(self.fd)
            self.fd = None
        mine = self.holder is not None and self.holder["pid"] == os.getpid()  # not a fork's
        if self.file is not None and mine and _holder_of(self.file) == self.holder:
            self.file.unlink(missing_ok=True)
        self.file = None


def lock_out(out: Path) -> OutLock:
    """Hold the folder `out` while this run writes into it, or refuse: a second `train` into it
    (a rerun in another shell, on another host) would delete the first's checkpoints."""
    try:
        fd = os.open(out, os.O_RDONLY)
    except OSError as e:
        raise DraftsmithError(f"--out {out}: cannot open it ({e.strerror or e})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DraftsmithError(f"--out {out}: {BUSY}") from None
    except OSError:  # no flock on this file system: a lock file instead
        os.close(fd)
        return _lock_file(Path(out))
    FLOCKS.append(fd)
    return OutLock(fd=fd)


def check_free(out: Path) -> None:
    """Refuse an existing --out another run holds now, before this one loads its target or reads
    its checkpoints (it was told to pass --resume, or said "resumed from", then refused); the
    lock is let go at once and taken for the run by `lock_out` once --out is made."""
    if Path(out).is_dir():
        lock_out(out).release()


BUSY = ("another `draftsmith train` is writing into it; wait for it to end (then --resume "
        "continues it) or train into another --out")


def _lock_file(out: Path) -> OutLock:
    path, me = out / LOCK_FILE, _me()
    for _ in range(3):
        if _link_lock(path, me):
            return OutLock(file=path, holder=me)
        held = _holder_of(path)
        if held is None or not _stale(held):
            raise DraftsmithError(_busy(path, held))
        _break(path, held)
    raise DraftsmithError(_busy(path, _holder_of(path)))


def _link_lock(path: Path, me: dict[str, Any]) -> bool:
    """Whether `path` now names a file holding `me`: written whole under a name of its own,
    then hard-linked (atomic, and refused where `path` exists, over NFS too)."""
    tmp = path.with_name(f"{path.name}.{me['host']}.{me['pid']}")
    try:
        tmp.write_text(json.dumps(me))
        try:
            os.link(tmp, path)
        except FileExistsError:
            return tmp.stat().st_nlink == 2  # NFS: a link whose reply was lost
        return True
    except OSError as e:
        raise DraftsmithError(f"--out {path.parent}: cannot lock it ({e.strerror or e}); "
                              "train into another --out") from None
    finally:
        tmp.unlink(missing_ok=True)


def _busy(path: Path, held: dict[str, Any] | None) -> str:
    who = ("" if held is None else
           f" (host {held.get('host')}, pid {held.get('pid')}, since {held.get('since')})")
    return (f"--out {path.parent}: another `draftsmith train`{who} is writing into it, says "
            f"{path} (this file system has no flock); wait for it to end (then --resume "
            "continues it) or train into another --out; if no run is writing there (one killed "
            "on another host), delete that file")


def _me() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _holder_of(path: Path) -> dict[str, Any] | None:
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return held if isinstance(held, dict) else None


def _stale(held: dict[str, Any]) -> bool:
    """Whether the lock's holder is gone: only on this host can we tell."""
    if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
        return False
    if not pid_alive(held["pid"]):
        return True
    started = _start_time(held["pid"])
    return None not in (started, held.get("started")) and started != held["started"]


def _start_time(pid: int) -> int | None:
    """The process's start (clock ticks since boot): a pid used again is another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _break(path: Path, held: dict[str, Any]) -> None:
    """Remove the stale lock `held`: renamed aside first, so a lock another run took after we
    read this one is put back, not deleted."""
    aside = path.with_name(f"{path.name}.stale.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _holder_of(aside) != held:
        with contextlib.suppress(OSError):
            os.link(aside, path)
    aside.unlink(missing_ok=True)
