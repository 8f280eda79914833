"""Shared utilities under odd input: an interrupted atomic write, a private file rewritten, JSON
that parses to no integer, nests too deeply, cannot be read, or is UTF-8 under another locale."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.data.atomic import atomic_write, replacing
from draftsmith.errors import DraftsmithError
from draftsmith.jsonfile import read_json, read_versioned


def test_interrupted_write_leaves_no_tmp_file(tmp_path: Path) -> None:
    """A ctrl-C (or any error the caller does not list) mid-write: no tmp file, the old file."""
    path = tmp_path / "m.json"
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), replacing(path, "kept") as tmp:
        tmp.write_bytes(b"part")
        raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["m.json"]
    assert path.read_bytes() == b"old"


def test_rewrite_keeps_the_files_mode(tmp_path: Path) -> None:
    """A file made private (0600) stays private when rewritten, not readable by all."""
    path = tmp_path / "m.json"
    path.write_bytes(b"old")
    path.chmod(0o600)
    atomic_write(path, b"new")
    assert path.read_bytes() == b"new"
    assert path.stat().st_mode & 0o777 == 0o600


def test_new_file_mode_follows_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "new.json"
    atomic_write(path, b"new")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_full_disk_at_fsync_keeps_the_old_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.json"
    path.write_bytes(b"old")

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DraftsmithError, match=r"m.json: cannot write it \(No space left on "
                                              r"device\); the file there before is unchanged$"):
        atomic_write(path, b"new")
    assert sorted(os.listdir(tmp_path)) == ["m.json"]
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_format_version_not_a_number(tmp_path: Path, value: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(f'{{"format": "f", "format_version": {value}}}')
    with pytest.raises(DraftsmithError, match=r"m.json: format_version is .*, expected an "
                                              "integer$"):
        read_versioned(path, "not a folder", "f", 1)


def test_json_nested_too_deeply(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(DraftsmithError, match=r"m.json: not valid JSON \(it nests arrays or "
                                              r"objects too deeply\)$"):
        read_json(path, "")


def test_json_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file there but not readable (permissions, an I/O error): one line, not a traceback."""
    path = tmp_path / "m.json"
    path.write_text("{}")

    def refuse(*args: object, **kwargs: object) -> bytes:
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_bytes", refuse)
    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(DraftsmithError, match=r"m.json: cannot read it \(Permission denied\)$"):
        read_json(path, "")


def test_json_read_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """JSON is UTF-8 (RFC 8259): a config with non-ASCII text reads the same under a C locale."""
    path = tmp_path / "config.json"
    path.write_bytes('{"name": "caf\u00e9"}'.encode())
    code = ("import sys; from pathlib import Path; from draftsmith.jsonfile import read_json; "
            "print(ascii(read_json(Path(sys.argv[1]), '')))")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0",
           "PYTHONCOERCECLOCALE": "0"}
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == ascii({"name": "caf\u00e9"}), out.stderr[-500:]


def test_nan_written_and_read_back(tmp_path: Path) -> None:
    from draftsmith.data.atomic import write_json
    path = tmp_path / "m.json"
    write_json(path, {"a": float("inf"), "b": [1.5]})
    assert read_json(path, "") == {"a": float("inf"), "b": [1.5]}


def test_append_interrupted_mid_record_is_cut_back(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A ctrl-C between two partial writes of a record: the file still ends after whole ones."""
    from draftsmith.data import atomic
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"a": 1}\n')
    real_open = open

    class Halting:
        def __init__(self, f: object) -> None:
            self.f = f

        def __enter__(self) -> Halting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def __getattr__(self, name: str) -> object:
            return getattr(self.f, name)

        def write(self, view: memoryview) -> int:
            if len(view) < 4:
                raise KeyboardInterrupt
            return self.f.write(view[:len(view) // 2])

    monkeypatch.setattr(atomic, "open", lambda *a, **k: Halting(real_open(*a, **k)),
                        raising=False)
    with pytest.raises(KeyboardInterrupt):
        atomic.append_whole(path, b'{"b": 2}\n', "kept")
    assert path.read_bytes() == b'{"a": 1}\n'
