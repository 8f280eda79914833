"""Reading the project's JSON files with one set of errors: missing, not JSON, wrong format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError


def read_json(path: Path, not_found: str) -> Any:
    """The parsed file; `not_found` says what the folder is not when the file is missing."""
    if not path.is_file():
        where = path.parent
        if not where.exists():  # a typo'd path: say so, not which file the folder lacks
            raise DraftsmithError(f"{where}: no such file or folder")
        if not where.is_dir():
            raise DraftsmithError(f"{where}: is a file, {not_found or 'not a folder'}")
        raise DraftsmithError(f"{path.parent}: no {path.name} ({not_found})")
    try:
        text = path.read_bytes()
    except OSError as e:
        raise DraftsmithError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:  # bytes, so JSON's UTF-8 is read whatever the locale's encoding
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise DraftsmithError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise DraftsmithError(f"{path}: not valid JSON (it nests arrays or objects too "
                              "deeply)") from None


def read_versioned(path: Path, not_found: str, fmt: str, version: int) -> dict[str, Any]:
    """A file with `format` and `format_version` keys that this draftsmith can read."""
    meta = read_json(path, not_found)
    if not isinstance(meta, dict):
        raise DraftsmithError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != fmt:
        raise DraftsmithError(f"{path}: format is {meta.get('format')!r}, expected {fmt!r}")
    try:
        got = int(meta.get("format_version", 0))
    except (TypeError, ValueError, OverflowError):  # OverflowError: Infinity
        raise DraftsmithError(f"{path}: format_version is {meta['format_version']!r}, "
                              "expected an integer") from None
    if got > version:
        raise DraftsmithError(f"{path}: format version {got} is newer than this draftsmith "
                              f"reads ({version})")
    return meta
