"""Reading the project's JSON files with one set of errors: missing, not JSON, wrong format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError


def read_json(path: Path, not_found: str) -> Any:
    """The parsed file; `not_found` says what the folder is not when the file is missing."""
    if not path.is_file():
        raise DraftsmithError(f"{path.parent}: no {path.name} ({not_found})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path}: not valid JSON ({e})") from None


def read_versioned(path: Path, not_found: str, fmt: str, version: int) -> dict[str, Any]:
    """A file with `format` and `format_version` keys that this draftsmith can read."""
    meta = read_json(path, not_found)
    if meta.get("format") != fmt:
        raise DraftsmithError(f"{path}: format is {meta.get('format')!r}, expected {fmt!r}")
    if int(meta.get("format_version", 0)) > version:
        raise DraftsmithError(f"{path}: format version {meta['format_version']} is newer than "
                              f"this draftsmith reads ({version})")
    return meta
