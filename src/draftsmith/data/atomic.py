"""Atomic file writes: a tmp file beside the target, fsync, os.replace, fsync of the folder.
Output paths are checked here too, so a wrong one is a clear error before anything is written."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.options import check_folder


def check_file_path(path: Path) -> None:
    """Refuse a file output path that is an existing folder."""
    if Path(path).is_dir():
        raise DraftsmithError(f"{path}: is a folder, expected a file path")


def make_folder(path: Path) -> Path:
    path = Path(path)
    check_folder(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot create the folder ({e.strerror})") from None
    return path


@contextmanager
def replacing(path: Path, kept: str,
              errors: tuple[type[BaseException], ...] = (OSError,)) -> Iterator[Path]:
    """A tmp path beside `path` for the block to write (and fsync); then moved onto `path`, so
    the file is there whole or not at all. One of `errors` (a full disk) leaves no tmp file and
    the file there before as it was: one error, `kept` ending it."""
    check_file_path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        _keep_mode(path, tmp)
        os.replace(tmp, path)
    except errors as e:
        tmp.unlink(missing_ok=True)
        raise DraftsmithError(f"{path}: cannot write it ({getattr(e, 'strerror', None) or e}); "
                              f"{kept}") from None
    except BaseException:  # a ctrl-C or another error mid-write: no tmp file left behind
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _keep_mode(path: Path, tmp: Path) -> None:
    """`path`'s permission bits onto `tmp`, so a rewrite keeps a private file private."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    os.chmod(tmp, mode & 0o7777)


def atomic_write(path: Path, data: bytes,
                 kept: str = "the file there before is unchanged") -> None:
    """`data` at `path` whole or not at all; `kept` ends the error a failed write gives."""
    with replacing(path, kept) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def append_whole(path: Path, data: bytes, kept: str) -> None:
    """Append `data` whole or not at all: a failed write (a full disk) is cut back off, so the
    file ends after whole records and a rerun resumes as an uninterrupted run goes on. `kept`
    ends the error: what the file keeps, and how to go on. Empty `data`: only checks that the
    file can be appended to."""
    try:
        with open(path, "ab", buffering=0) as f:
            end = f.seek(0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[f.write(view):]
            except BaseException:  # a full disk, or a ctrl-C between two partial writes
                f.truncate(end)
                raise
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot write it ({e.strerror or e}); {kept}") from None


def fsync_file(path: Path) -> None:
    """`path`'s bytes on disk (a failure is a failed write)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """A folder's entries (a rename into it) on disk; a file system that refuses is skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any, kept: str = "the file there before is unchanged") -> None:
    atomic_write(path, (json.dumps(obj, indent=1) + "\n").encode(), kept)
