"""Tmp folders a killed export (SIGKILL, power loss) left beside --out: its `except` never ran,
so nothing removed `.NAME.tmp-PID`, and every later export left it there without a word."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from test_export import make

from draftsmith.export import export_drafter


def dead_pid() -> int:
    """The pid of a process that has exited (reaped), as a killed export's is."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def leftover(folder: Path, files: tuple[str, ...] = ("config.json", "model.safetensors")) -> Path:
    """What a killed export leaves: its tmp folder, a half-written weights file in it."""
    folder.mkdir()
    for name in files:
        (folder / name).write_bytes(b"\x00" * 16)
    return folder


def test_a_later_export_removes_a_killed_exports_tmp_folder(target, tmp_path, capsys):
    src = make(target, tmp_path / "d")
    stale = leftover(tmp_path / f".sp.tmp-{dead_pid()}")
    out = export_drafter(src, "speculators", tmp_path / "sp")
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "sp"]
    notes = [line for line in capsys.readouterr().err.splitlines() if stale.name in line]
    assert len(notes) == 1 and "removed" in notes[0] and str(out.resolve().parent) in notes[0]


def test_an_overwrite_removes_an_empty_tmp_folder_killed_before_writing(target, tmp_path, capsys):
    src = make(target, tmp_path / "d")
    export_drafter(src, "sglang", tmp_path / "sg")
    stale = leftover(tmp_path / f".sg.tmp-{dead_pid()}", files=())
    export_drafter(src, "sglang", tmp_path / "sg", overwrite=True)
    assert not stale.exists()
    assert stale.name in capsys.readouterr().err


def test_only_draftsmiths_dead_tmp_folders_for_this_out_are_removed(target, tmp_path, capsys):
    src = make(target, tmp_path / "d")
    pid = dead_pid()
    kept = [
        leftover(tmp_path / f".sp.tmp-{os.getppid()}"),  # a live export's, writing now
        leftover(tmp_path / f".other.tmp-{pid}"),  # another destination's
        leftover(tmp_path / ".sp.tmp-x1"),  # no pid
        leftover(tmp_path / ".sp.tmp-\u00b2"),  # a digit to isdigit, not to int()
        leftover(tmp_path / ".sp.tmp-"),  # no pid
        leftover(tmp_path / f"sp.tmp-{pid}"),  # not hidden
        leftover(tmp_path / ".sp.tmp-99999999999"),  # past any pid (os.kill would overflow)
    ]
    mine = leftover(tmp_path / f".sp.tmp-{pid}", files=("config.json", "notes.txt"))
    kept.append(mine)  # holds a file no export writes: someone else's
    (tmp_path / "real").mkdir()
    link = tmp_path / f".sp.tmp-{dead_pid()}"
    link.symlink_to(tmp_path / "real")
    export_drafter(src, "speculators", tmp_path / "sp")
    assert all(p.is_dir() and any(p.iterdir()) for p in kept)
    assert link.is_symlink() and (tmp_path / "real").is_dir()
    assert "removed" not in capsys.readouterr().err
